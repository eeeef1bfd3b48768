"""The interface every engine implements."""

from __future__ import annotations

from typing import Any

import numpy as np

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

    def upload(self, host: np.ndarray) -> Any:
        """A handle holding a copy (or a zero-copy view, locally) of host data."""
        raise NotImplementedError

    def download(self, handle) -> np.ndarray:
        """The value of ``handle`` as a host NumPy array; waits for pending work it depends on."""
        raise NotImplementedError

    def native(self, handle) -> Any:
        """The native array behind ``handle`` (for DLPack and ``__array__``); hosts it if remote."""
        return self.download(handle)

    def sync(self) -> None:
        """Wait until every submitted op has run; raise the first deferred error."""

    def stats(self) -> dict:
        """Counters of this engine's work."""
        return {}
