"""``em.jit``: a function captured once per (argument structure, shapes, dtypes, device) and
replayed; Python branching on traced values is refused with TracedBranchError."""

from __future__ import annotations

from ..engines.capture import Node
from ..errors import EmberError, NoValueError, OutputError, TracedBranchError
from ..trees import flatten, unflatten
from .scope import capture


class Jitted:
    """A function captured once per (argument structure, shapes, dtypes, device) and replayed."""

    def __init__(self, function):
        self.function = function
        self.graphs: dict = {}
        self.__name__ = getattr(function, "__name__", "function")
        self.__doc__ = getattr(function, "__doc__", None)
        self.__wrapped__ = function

    def __call__(self, *args, **kwargs):
        leaves: list = []
        structure = flatten((args, kwargs), leaves)
        if not leaves:
            return self.function(*args, **kwargs)
        devices = {leaf.device for leaf in leaves}
        if len(devices) > 1:
            raise EmberError(f"jit({self.__name__}): array arguments are on different devices: "
                             f"{', '.join(sorted(map(str, devices)))}")
        device = leaves[0].device
        key = (structure, tuple((leaf.shape, leaf.dtype) for leaf in leaves), device)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(structure, leaves)
        graph, out_structure = entry
        results = graph(*leaves, device=device) if graph is not None else ()
        results = results if isinstance(results, tuple) else (results,)
        return unflatten(out_structure, results)

    def _capture(self, structure, leaves):
        with capture() as cap:
            tracers = [cap.input(leaf.shape, leaf.dtype, name=f"arg{i}") for i, leaf in enumerate(leaves)]
            args, kwargs = unflatten(structure, tracers)
            try:
                result = self.function(*args, **kwargs)
            except NoValueError as error:
                raise TracedBranchError(f"jit({self.__name__}): the function read a traced value while being captured "
                                        f"(Python `if`/`while`/`float()` on an array): {error}. Use em.where for "
                                        f"data-dependent choices, or pass the value as a non-array argument") from None
            out_leaves: list = []
            out_structure = flatten(result, out_leaves)
            for i, leaf in enumerate(out_leaves):
                if type(leaf._handle) is Node and leaf._handle.scope is cap:
                    cap.output(leaf, name=f"out{i}")
                else:
                    raise OutputError(f"jit({self.__name__}): output {i} is not computed in the function "
                                      f"(return it from outside the jitted function)")
        return (cap.graph if out_leaves else None), out_structure  # None: nothing to replay

    def __repr__(self) -> str:
        return f"<jit {self.__name__}: {len(self.graphs)} captured>"


def jit(function):
    """Capture ``function`` on its first call for each argument structure, shapes, dtypes and
    device, and replay the graph afterwards — on a compute peer, the graph is registered once
    and each call sends only a reference and tensor ids."""
    return Jitted(function)
