"""The interface every engine implements."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops.records import LITERAL_METAS
from ..ops.table import Meta, Op


class Engine:
    """What a device does with operations. Subclasses: local, remote, capture, autodiff."""

    #: whether handles hold values that can be read (capture's cannot)
    executes = True

    #: set to a ConnectionLost once the engine can no longer work (a remote peer went away)
    lost = None

    def execute(self, op: Op, inputs: tuple, in_metas: tuple[Meta, ...], attrs: dict,
                metas: tuple[Meta, ...]) -> tuple[tuple, tuple[Meta, ...]]:
        """Run (or record) ``op`` on input handles and Python scalar literals.

        ``in_metas`` describe the inputs (a literal's dtype among them); ``metas`` are the
        outputs the meta rule inferred. The engine returns output handles and the metas with
        every data-dependent (None) dimension resolved.
        """
        raise NotImplementedError

    def apply(self, op: Op, inputs: tuple, in_metas: tuple[Meta, ...], attrs: dict, meta: Meta) -> Any:
        """:meth:`execute` for an op of one output whose meta is known in advance (neither
        ``multiple`` nor ``data_dependent``): the output handle alone. The hot path of eager
        execution; engines override it to skip what such an op never needs."""
        return self.execute(op, inputs, in_metas, attrs, (meta,))[0][0]

    def upload(self, host: np.ndarray) -> Any:
        """A handle holding a copy (or a zero-copy view, locally) of host data."""
        raise NotImplementedError

    def download(self, handle) -> np.ndarray:
        """The value of ``handle`` as a host NumPy array; waits for pending work it depends on."""
        raise NotImplementedError

    def native(self, handle) -> Any:
        """The native array behind ``handle`` (for DLPack and ``__array__``); hosts it if remote."""
        return self.download(handle)

    def move(self, handle, meta: Meta, target: Engine) -> Any:
        """``handle``'s value as a handle of ``target``, moved without passing through this process
        (two compute peers), or None when this engine cannot: the caller then reads and uploads."""
        return None

    def run_graph(self, graph, inputs: list) -> list:
        """Run a captured graph on input handles; returns the output handles.

        The graph's metas are known, so this executes each record without re-inferring it;
        engines that can do better (a peer registers the graph once) override it.
        """
        env = dict(graph.constant_handles(self))
        env.update(zip((i for _, i, _ in graph.inputs), inputs))
        metas = graph.metas
        for op in graph.ops:
            handles, in_metas = [], []
            for ref in op.inputs:
                if type(ref) is int:
                    handles.append(env[ref])
                    in_metas.append(metas[ref])
                else:
                    handles.append(ref[0])
                    in_metas.append(LITERAL_METAS[ref[1]])
            outs, _ = self.execute(op.row, tuple(handles), tuple(in_metas), op.attrs,
                                   tuple(metas[i] for i in op.outputs))
            env.update(zip(op.outputs, outs))
        return [env[i] for _, i in graph.outputs]

    def rebind(self, old, new):
        """The handle an array holds after an in-place update from ``old`` to ``new``."""
        return new

    def unwrap(self, handle):
        """The inner device's handle inside ``handle`` (a wrapping engine, autodiff, overrides)."""
        return handle

    def mixing_error(self, what: str, mine, other):
        """An error that explains why an array on ``other`` cannot meet one of this engine's device
        ``mine`` better than the generic DeviceError does (None: no better explanation)."""
        return None

    def sync(self) -> None:
        """Wait until every submitted op has run; raise the first deferred error."""

    def stats(self) -> dict:
        """Counters of this engine's work."""
        return {}
