"""PyTorch functions captured into ember graphs and replayed: ``ember.torch.jit``.

``step = ember.torch.jit(train_step)`` runs ``train_step`` eagerly on its first call (the warm-up:
optimizers make their state), captures it on its second into a :class:`~ember.CapturedGraph` and
replays that graph from then on — on a compute peer, registered once, then one reference and
tensor ids a call. What the function reads and writes is found as it runs, the way
functionalization finds it: every ember tensor an op reads that lives outside the capture (the
model's parameters, the optimizer's state, the arguments) becomes an input of the graph; every
tensor it writes in place (parameters, momentum), and every tensor it makes that outlives it
(``.grad``), an output — rebound to its new value after each replay, as CUDA graphs replay onto
their static tensors. ``step.graph`` is the graph: it saves, exports to ONNX and verifies across
devices like any captured graph.

As with CUDA graphs, a replay repeats what the capture recorded: Python runs only at capture. A
host value the function reads becomes a constant — ``torch.optim.Adam`` reads its step count that
way, so capture it with SGD, or jit the forward and backward and step Adam outside — and a
dropout mask drawn on the host would repeat, so capture refuses it (``model.eval()``).
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import ember as em
from ember.errors import CaptureError, EmberError

from . import tensor as tensors

WARMUP = 1  # eager calls before the capture: optimizers make their state on their first step


class Recording:
    """What a function did to ember tensors while it was captured: the tensors of real devices it read
    (each now a graph input), those it wrote (their values before, restored afterwards), and the storages
    it made."""

    def __init__(self, scope, arguments: dict):
        self.scope = scope
        self.arguments = arguments           # id(storage) → its argument's position, for the inputs' names
        self.names: list = []                # each input's argument position, or None for state
        self.read: dict[int, tuple] = {}     # id(storage) → (storage, its tracer)
        self.written: dict[int, tuple] = {}  # id(storage) → (storage, its array before)
        self.made: weakref.WeakSet = weakref.WeakSet()
        self.device = None

    def array_of(self, storage) -> em.Array:
        """The array an op reads of ``storage``: a tracer standing for it where it lives outside the capture."""
        array = storage.array
        if array.device is self.scope.device:
            return array
        entry = self.read.get(id(storage))
        if entry is None:
            if self.device is None:
                self.device = array.device
            elif array.device != self.device:
                raise CaptureError(f"ember.torch.jit: the function reads tensors on {self.device} and on "
                                   f"{array.device}; a graph runs on one device")
            position = self.arguments.get(id(storage))
            name = f"arg{position}" if position is not None else f"state{sum(p is None for p in self.names)}"
            self.names.append(position)
            tracer = self.scope.input(array.shape, array.dtype, name=name)
            entry = self.read[id(storage)] = (storage, tracer)
        return entry[1]

    def rebinding(self, storage) -> None:
        """``storage`` is about to take a new value: remember its value before, once."""
        if id(storage) not in self.written and storage not in self.made:
            self.written[id(storage)] = (storage, storage.array)


class Jitted:
    """A PyTorch function captured once per argument structure, shapes and dtypes, then replayed."""

    def __init__(self, function, warmup: int = WARMUP):
        self.function, self.warmup = function, warmup
        self.calls = 0
        self.captures: dict = {}  # key → _Capture
        self.graph = None         # the latest captured graph
        self.__name__ = getattr(function, "__name__", "function")
        self.__wrapped__ = function

    def __call__(self, *args):
        self.calls += 1
        if self.calls <= self.warmup:
            return self.function(*args)
        leaves, structure = tree_flatten(args)
        key = (structure, tuple((type(x), tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x), x)
                                for x in leaves))
        capture = self.captures.get(key)
        if capture is None or not capture.fits():
            capture = self.captures[key] = _Capture(self, args)
            self.graph = capture.graph
        return capture.replay(leaves)

    def __repr__(self) -> str:
        return f"<ember.torch.jit {self.__name__}: {len(self.captures)} captured>"


class _Capture:
    """One captured call: its graph, the storages it reads and those it rebinds, and its results' structure."""

    def __init__(self, jitted: Jitted, args):
        positions = {id(leaf._storage): i for i, leaf in enumerate(tree_flatten(args)[0]) if isinstance(leaf, tensors.Tensor)}
        with em.capture() as scope:
            recording = tensors.record(Recording(scope, positions))
            try:
                result = jitted.function(*args)
                gc.collect()  # what the function made and dropped goes: what stays outlived it
            except em.errors.NoValueError as error:
                raise CaptureError(f"ember.torch.jit({jitted.__name__}): the function read a value while captured "
                                   f"({error}); return tensors instead of .item()") from None
            finally:
                tensors.record(None)
                written = [(storage, storage.array) for storage, _ in recording.written.values()]
                for storage, before in recording.written.values():  # the capture runs nothing: state as it was
                    storage.array = before
            leaves, self.structure = tree_flatten(result)
            self.returned = [i for i, leaf in enumerate(leaves) if isinstance(leaf, tensors.Tensor)]
            self.written = [storage for storage, _ in written]
            mine = {id(leaves[i]._storage) for i in self.returned}
            self.left = [storage for storage in recording.made  # tensors it made that outlive it (.grad)
                         if storage.array.device is scope.device and id(storage) not in mine]
            outputs = [leaves[i]._storage.array for i in self.returned] + [array for _, array in written]
            for k, array in enumerate(outputs + [s.array for s in self.left]):
                if array.device is not scope.device:
                    raise CaptureError(f"ember.torch.jit({jitted.__name__}): output {k} was not computed in the function")
                scope.output(array, name=f"out{k}")
            self.leaves = leaves
        # (the argument it is, or None: state the function reaches itself; the storage; its shape and dtype)
        self.read = [(positions.get(key), storage, tracer.shape, tracer.dtype)
                     for key, (storage, tracer) in recording.read.items()]
        self.graph, self.device = scope.graph, recording.device

    def fits(self) -> bool:
        """Whether the state the graph reads is still of the shapes and dtypes it was captured with."""
        return all(s.array.shape == shape and s.array.dtype == dtype for _, s, shape, dtype in self.read)

    def replay(self, given: list):
        """Run the graph on the state as it stands and ``given``, this call's flattened arguments."""
        if self.device is None:
            raise EmberError("ember.torch.jit: the function reads no ember tensor: nothing to run on a device")
        inputs = [storage.array if position is None else given[position]._storage.array
                  for position, storage, _, _ in self.read]
        results = self.graph(*inputs, device=self.device)
        results = results if isinstance(results, tuple) else (results,)
        returned, rest = results[:len(self.returned)], results[len(self.returned):]
        for storage, array in zip(self.written + self.left, rest):
            storage.array = array
        leaves = list(self.leaves)
        for i, array in zip(self.returned, returned):
            leaves[i] = tensors.Tensor(tensors.Storage(array))
        return tree_unflatten(leaves, self.structure)


def jit(function, warmup: int = WARMUP) -> Jitted:
    """``function`` (of PyTorch tensors on ember devices) captured into an ember graph and replayed: eager for
    its first ``warmup`` calls, captured on the next, replayed after (see the module's docstring)."""
    return Jitted(function, warmup)
