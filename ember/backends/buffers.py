"""A caching allocator for received tensors: byte buffers lent as arrays of any shape and dtype, and
taken back for the next tensor of the same size once nothing else refers to them.

A fresh buffer of a few MiB costs its page faults (about 1,000 for 4 MB, tens of milliseconds for
256 MiB) where a reused one costs none, so both ends of a connection receive into a
:class:`BufferCache`: the client its downloads (``recall=True``), the compute peer its uploads
(``remote/memory.py``'s ``BufferPool``, charged to the peer's budget, idle buffers expired). The
frame reader takes the cache's :meth:`BufferCache.allocate` as its hook, so the wire knows nothing
of it. Whether a buffer is free is told by reference counts (:func:`held_alone`): one an array,
name or view still uses is never handed out again.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol

import numpy as np

from .base import held_alone


class Charge(Protocol):
    """What a cache's idle buffers are counted against (a compute peer's ``Budget``)."""

    def take(self, nbytes: int, evict: bool = True) -> bool:
        """Count ``nbytes`` more if they fit (``evict=False``: without letting idle buffers go for them)."""

    def give(self, nbytes: int) -> None:
        """Count ``nbytes`` fewer."""


class BufferCache:
    """Byte buffers of ``minimum`` bytes or more, lent as arrays (:meth:`allocate`) and reused for
    the next request of the same size; smaller requests get plain arrays. Thread-safe.

    A buffer comes back one of two ways:

    - **released** (the default): the owner offers the arrays it drops (:meth:`release`), and a
      buffer nothing else refers to becomes idle, kept while idle buffers total at most
      ``capacity`` bytes. A compute peer knows when a tensor is dropped, so it releases.
    - **recalled** (``recall=True``): the cache keeps every buffer it lends, the ``capacity`` bytes
      most recently lent (``lent``, oldest first), and takes one back once it holds the only
      reference. A client hands its reads to a program that never says when it drops them.

    Options for released buffers: ``budget`` (a :class:`Charge`) counts the idle bytes, so a
    buffer is kept only while it has room, and its bytes move to the caller's count when it is
    lent again; one idle for more than ``idle_seconds`` is let go by :meth:`expire` (None: never).
    ``total`` is the bytes of the buffers kept (idle, or lent and recalled); ``let_go`` the bytes
    :meth:`expire` and :meth:`clear` let go since the owner last looked (to hand the pages back)."""

    def __init__(self, capacity: int = 1 << 30, minimum: int = 1 << 20, *, recall: bool = False,
                 budget: Charge | None = None, idle_seconds: float | None = None):
        self.capacity, self.minimum, self.recall, self.idle_seconds = capacity, minimum, recall, idle_seconds
        self.budget = budget
        self.free: dict[int, list] = {}  # idle released buffers by size, the most recently released last
        self.since: dict[int, list[float]] = {}  # when each buffer of free[size] was released, in the same order
        self.lent: list[np.ndarray] = []  # recalled buffers, the least recently lent first
        self.total = 0
        self.let_go = 0
        self.lock = threading.Lock()  # a peer's one cache serves every session

    def allocate(self, shape: tuple, dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` to receive a tensor into (the frame reader's hook)."""
        nbytes = math.prod(shape) * dtype.itemsize
        # a recalled buffer past the capacity would push out every other: the program gets an array of its own
        if nbytes < self.minimum or (self.recall and nbytes > self.capacity):
            return np.empty(shape, dtype)
        buffer = self._recalled(nbytes) if self.recall else self._idle(nbytes)
        return buffer.view(dtype).reshape(shape)

    def _idle(self, nbytes: int) -> np.ndarray:
        """An idle released buffer of ``nbytes`` (its bytes handed to the caller's count), or a fresh one."""
        with self.lock:
            stack = self.free.get(nbytes)
            buffer = stack.pop() if stack else None
            if buffer is not None:
                self.since[nbytes].pop()
                self.total -= nbytes
        if buffer is None:
            return np.empty(nbytes, np.uint8)
        if self.budget is not None:
            self.budget.give(nbytes)  # its bytes now count where the caller counts them
        return buffer

    def _recalled(self, nbytes: int) -> np.ndarray:
        """The least recently lent buffer of ``nbytes`` that nothing refers to any more, or a fresh
        one; either is now the most recently lent."""
        with self.lock:
            lent = self.lent
            alone = held_alone(lent)  # no array or view uses it
            for i in range(len(lent)):
                if lent[i].nbytes == nbytes and alone[i]:
                    buffer = lent.pop(i)
                    lent.append(buffer)
                    return buffer
            buffer = np.empty(nbytes, np.uint8)
            lent.append(buffer)
            self.total += nbytes
            while self.total > self.capacity:  # forget the oldest: a program still using it keeps it
                self.total -= lent.pop(0).nbytes
            return buffer

    def release(self, arrays: list) -> None:
        """Offer the buffers behind ``arrays`` (values just dropped, in a list that holds the
        caller's only references to them) for reuse. A buffer is kept only when nothing else
        refers to it or to its array: no other tensor, name or view (:func:`held_alone`)."""
        picked = [i for i, array in enumerate(arrays) if self._buffer(array) is not None]
        if not picked:  # most drops: small tensors, in no buffer of ours
            return
        roots = [arrays[i].base for i in picked]
        alone = held_alone(arrays)
        # each root is referenced by the list and by its array's base, and by nothing else when free
        for i, root, root_alone in zip(picked, roots, held_alone(roots, besides=1)):
            if not (alone[i] and root_alone) or self.total + root.nbytes > self.capacity:
                continue
            if self.budget is not None and not self.budget.take(root.nbytes, evict=False):
                continue
            with self.lock:
                self.free.setdefault(root.nbytes, []).append(root)
                self.since.setdefault(root.nbytes, []).append(time.monotonic())
                self.total += root.nbytes

    def _buffer(self, array) -> np.ndarray | None:
        """The byte buffer ``array`` is a view of, where it is of the kind :meth:`allocate` makes."""
        root = array.base if type(array) is np.ndarray else None
        if type(root) is not np.ndarray or root.dtype != np.uint8 or root.ndim != 1 or root.nbytes < self.minimum:
            return None
        return root

    def shrink(self, nbytes: int) -> int:
        """Let idle buffers go, the largest first, until ``nbytes`` are freed or none is left;
        returns the bytes freed (the budget calls this when it is short, and counts them itself)."""
        freed = 0
        with self.lock:
            for size in sorted(self.free, reverse=True):
                stack = self.free[size]
                while stack and freed < nbytes:
                    stack.pop()
                    self.since[size].pop()
                    freed += size
                if freed >= nbytes:
                    break
            self._prune()
            self.total -= freed
        return freed

    def expire(self, now: float | None = None) -> int:
        """Let go of the buffers released more than ``idle_seconds`` before ``now`` (the monotonic
        clock; the owner calls this every few seconds) and give their bytes back to the budget;
        returns the bytes freed. The oldest of each size are at the bottom of its stack."""
        if self.idle_seconds is None:
            return 0
        cutoff = (time.monotonic() if now is None else now) - self.idle_seconds
        freed = 0
        with self.lock:
            for size, times in self.since.items():
                old = next((k for k, when in enumerate(times) if when > cutoff), len(times))
                if old:
                    del self.free[size][:old], times[:old]
                    freed += old * size
            if freed:
                self._prune()
                self.total -= freed
                self.let_go += freed
        if freed and self.budget is not None:
            self.budget.give(freed)
        return freed

    def clear(self) -> int:
        """Let go of every idle buffer (no one is about to reuse one) and give their bytes back to
        the budget; returns the bytes freed."""
        with self.lock:
            freed = sum(size * len(stack) for size, stack in self.free.items())  # recalled loans stay
            self.total -= freed
            self.free, self.since = {}, {}
            self.let_go += freed
        if freed and self.budget is not None:
            self.budget.give(freed)
        return freed

    def _prune(self) -> None:
        """Forget the sizes that have no idle buffer left (under the lock)."""
        self.free = {size: stack for size, stack in self.free.items() if stack}
        self.since = {size: self.since[size] for size in self.free}
