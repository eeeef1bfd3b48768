"""What a failure leaves where a tensor would be, on a compute peer.

A failed op leaves a :class:`Failure` in each of its outputs, and a failed transfer in the tensor
it was fetching; whatever reads such a tensor — an op, a read, a grant, a fetch of it — meets the
error instead, with its kind (an ember exception's name, as the wire carries it) and its message.
Without I/O; it imports nothing, so sessions and transfers alike can hold one.
"""

from __future__ import annotations


class Failure:
    """An error in place of a tensor: its kind (an ember exception's name) and its message, raised
    where the tensor is read. The op path tells one from a value with ``type(value) is Failure``."""

    __slots__ = ("kind", "message")

    def __init__(self, kind: str, message: str):
        self.kind, self.message = kind, message

    def __repr__(self) -> str:
        return f"Failure({self.kind!r}, {self.message!r})"
