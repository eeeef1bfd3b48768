"""A session's side of direct transfers between peers, without I/O: its grants and its fetches.

``x.to_device(b)`` across two peers sends ``grant`` to the source session (its tensor may be read
once, with a capability, by the destination session) and ``fetch`` to the destination (fetch
that tensor as one of its own); transfers.py holds the protocol of both and the peer's table of
grants. Here a session's :class:`Moves` checks what those two messages' records
(``wire/messages.py``: their fields' types checked by ``parse``) hold and counts their bytes in its
:class:`~ember.remote.tensors.TensorTable`: a granted value's until the grant ends, a fetched
tensor's from the message on, its outcome taken when the tensor is first used (``settle``).
"""

from __future__ import annotations

from .. import dtypes as dt
from ..errors import ProtocolError, ResourceLimitError
from ..ops.table import Meta
from ..wire import messages
from ..wire.protocol import CAPABILITY_BYTES
from .failures import Failure
from .memory import TENSOR_OVERHEAD
from .tensors import TensorTable, check_size
from .transfers import FETCHES_PER_SESSION, SCHEMES, Fetch, Grant, Transfers, is_host


class Moves:
    """The grants and fetches of the session named ``session_id`` on the peer ``peer`` (its
    identity: a fetch from it needs no network), over its ``table`` and the peer's ``transfers``."""

    def __init__(self, table: TensorTable, transfers: Transfers, session_id: str, peer: str):
        self.table, self.transfers = table, transfers
        self.session_id, self.peer = session_id, peer

    def grant(self, message: messages.Grant) -> None:
        """Tensor ``message.id`` may be read once by ``message.session`` with ``message.capability``.
        The value is taken now (every earlier op has run); its bytes stay counted until the grant
        ends, so a dropped tensor cannot outlive the quota through a grant."""
        tid, capability, session = message.id, message.capability, message.session
        if len(capability) != CAPABILITY_BYTES:
            raise ProtocolError(f"a capability is {CAPABILITY_BYTES} random bytes")
        if not 0 < len(session) <= 64:
            raise ProtocolError("a grant names the session it is for")
        table = self.table
        if tid in table.incoming:
            table.settle(tid)
        value, meta, nbytes = table.tensors.get(tid), table.metas.get(tid), 0
        if value is None:
            value = table.fail("ExecutionError", table.unknown(tid))
        elif type(value) is not Failure:
            nbytes = meta.nbytes
            reason = table.quota.reserve(nbytes)
            if reason is not None:
                value, nbytes = table.fail("ResourceLimitError", f"grant of tensor {tid}: {reason}"), 0
        refusal = self.transfers.grant(Grant(capability, session, value, table, nbytes))  # the table counts its bytes
        if refusal is not None:
            table.quota.give(nbytes)
            table.report(table.fail("ResourceLimitError", refusal))
        else:
            table.granted += nbytes

    def fetch(self, message: messages.Fetch) -> Fetch | None:
        """Tensor ``message.id`` is the tensor granted with ``capability`` on the peer at
        ``scheme://host:port`` (whose identity is ``peer``). Its bytes are counted now; the fetch to
        perform is returned (see transfers.Fetch: the shell performs it), or None where it is
        refused (the tensor then holds why)."""
        tid, shape, port, peer = message.id, message.shape, message.port, message.peer
        if not isinstance(message.dtype, dt.DType) or len(shape) > 64 or not all(type(n) is int and n >= 0 for n in shape):
            raise ProtocolError("a fetch names the tensor's dtype and shape")
        if message.scheme not in SCHEMES or not is_host(message.host) or not 0 < port < 65536 or len(peer) > 64:
            raise ProtocolError("a fetch names the source peer as scheme, host, port and identity")
        if len(message.capability) != CAPABILITY_BYTES:
            raise ProtocolError(f"a capability is {CAPABILITY_BYTES} random bytes")
        meta, table = Meta(shape, message.dtype), self.table
        job = Fetch(tid, meta, message.scheme, message.host, port, message.capability, self.session_id,
                    local=peer == self.peer, peer=peer)
        try:
            if len(table.incoming) + len(table.cancelled) >= FETCHES_PER_SESSION:
                # those of dropped tensors count until their worker ends: a drop does not make room for more threads
                table.cancelled = [f for f in table.cancelled if not f.over]
                if sum(not f.done.is_set() for f in table.incoming.values()) + len(table.cancelled) >= FETCHES_PER_SESSION:
                    raise ResourceLimitError(f"transfer from {job.source}: {FETCHES_PER_SESSION} transfers to this session "
                                             f"are running already (those of dropped tensors until they stop); read "
                                             f"some of their tensors first")
            check_size(f"transfer from {job.source}", (meta,), table.quota.limits.max_tensor_bytes)
            nbytes = meta.nbytes + TENSOR_OVERHEAD
            table.take(f"transfer from {job.source}", nbytes, 1)
        except ResourceLimitError as error:
            table.poison((tid,), "ResourceLimitError", str(error))
            return None
        table.expect(tid, job, nbytes)
        return job
