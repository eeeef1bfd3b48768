"""Arrays between a client's sessions with compute peers: an array of another session, or of a
lost one, is refused with words that say why (:func:`check_inputs`, :func:`lost_session`); one
bound for another peer's session moves there directly, without a byte passing through the client
(:class:`PeerTransfers`, the remote engine's part of ``x.to_device``: a capability granted on one
session and presented on the other, which fetches the tensor from the first peer).
"""

from __future__ import annotations

import secrets

from ..errors import ConnectionLost, DeviceError
from ..wire.protocol import CAPABILITY_BYTES


def lost_session(what: str, subject: str, engine) -> ConnectionLost:
    """The error for ``subject`` (an array of ``engine``'s ended session) used by ``what``: its data is
    gone with the session, and the message says why the session ended."""
    return ConnectionLost(f"{what}: {subject} lives in a lost session with {engine.device}; its data is gone "
                          f"({engine.lost or 'the session ended'})")


def check_inputs(engine, name: str, inputs: tuple, handle: type) -> None:
    """Raise ``engine``'s loss if its session is lost, else for an input of op ``name`` (a ``handle``)
    of another session (one peer, two tokens) or of a lost one."""
    if engine.lost is not None:
        raise engine.lost
    for value in inputs:
        if type(value) is handle and value.engine is not engine:
            if value.engine.lost is None:
                raise DeviceError(f"{name}: an input lives in another session with {engine.device}, opened "
                                  f"with another token; move it into this one with x.to_device(device), "
                                  f"passing the Device its other inputs are on (a device string omits the token)")
            raise lost_session(name, "an input", value.engine)


class PeerTransfers:
    """Moves between peers, for the remote engine: it has ``protocol`` (grant, fetch), ``info``
    (the peer's session and identity), ``device``, ``lost`` and ``_locked`` (a protocol call made
    and its frames sent, the lock held). Nothing waits: a failure surfaces at the first read that
    depends on the moved tensor, as a typed error naming the transfer."""

    def move(self, handle, meta, target):
        """Move ``handle`` to another peer's session ``target`` directly (None for any other target):
        a fresh capability, granted here and presented there; see :meth:`grant` and :meth:`fetch`."""
        if type(target) is not type(self) or target is self or type(handle) is not self.protocol.handle \
                or handle.engine is not self or self.lost is not None:
            return None
        capability = secrets.token_bytes(CAPABILITY_BYTES)
        self.grant(handle, capability, target.session)
        return target.fetch(self, capability, meta)

    @property
    def session(self) -> str:
        """This session's name on its peer (what a grant binds a transfer to)."""
        return self.info.get("session", "")

    def grant(self, handle, capability: bytes, session: str) -> None:
        """Let ``session`` (of any peer) read ``handle``'s tensor once, with ``capability`` (32 random
        bytes), before the peer's transfer TTL runs out: sent at once, after every op it depends on
        (the source starts serving it as soon as it gets there, not at the next read); no reply is
        awaited. A step of :meth:`move`, and of any plan moving tensors between peers."""
        if handle.engine is not self:
            raise lost_session("to_device", "the array", handle.engine)
        self._locked(self.protocol.grant, handle.id, capability, session, now=True)

    def fetch(self, source, capability: bytes, meta):
        """A new tensor of this session: the one ``source``'s session granted with ``capability``, of
        ``meta``, fetched by this peer from that one; sent at once, well within the capability's
        lifetime."""
        tid = self._locked(self.protocol.fetch, meta, capability, source.device, source.info.get("peer", ""), now=True)
        return self.protocol.handle(self, tid)
