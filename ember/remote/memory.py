"""A compute peer's memory: the budget all its sessions share, a session's quota, the figures it counts, the pool.

Every byte a session makes the peer hold is counted before it is allocated, by its
:class:`Quota`: against the session's quota (``limits.max_session_bytes``; a quarter of the budget unless set,
:func:`default_quota`) and the peer's :class:`Budget`, which a session takes in chunks
(:data:`CREDIT`), so most ops take no lock. What a session holds beside its tensors' data — each
tensor id, graph, graph op and remembered run — counts at the fixed figures below, so counts are
bytes too. The :class:`BufferPool` keeps freed upload buffers for reuse, within the budget.
Without I/O; thread-safe where several sessions share an object (the budget, the pool).
"""

from __future__ import annotations

import os
import threading

from ..backends.buffers import BufferCache


def default_memory() -> int:
    """The default memory budget of a peer: three quarters of this machine's physical memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 3 // 4
    except (ValueError, OSError, AttributeError):  # a platform without sysconf
        return 8 << 30


class Budget:
    """The memory all sessions of a peer may hold together (``--max-memory``): their tensors,
    frames being received, replies being built, and the buffer pool's idle buffers, which give
    way first. Thread-safe; sessions take it in chunks (:data:`CREDIT`), so most ops take no lock."""

    def __init__(self, limit: int | None = None):
        self.limit = default_memory() if limit is None else limit
        self.used = 0
        self.lock = threading.Lock()
        self.pool: BufferPool | None = None  # idle buffers to let go of under pressure

    def take(self, nbytes: int, evict: bool = True) -> bool:
        """Count ``nbytes`` more if they fit, letting idle pool buffers go first when ``evict``."""
        with self.lock:
            short = self.used + nbytes - self.limit
            if short > 0 and evict and self.pool is not None:
                self.used -= self.pool.shrink(short)
                short = self.used + nbytes - self.limit
            if short > 0:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self.lock:
            self.used -= nbytes


CREDIT = 1 << 20  # bytes a session keeps taken from the budget beyond what it uses, so small ops take no lock

# What a session holds beyond its tensors' data, counted against its quota and the budget like the
# data (tracemalloc's figures for 3k–50k of each: `python tools/probes/accounting.py --measure`):
TENSOR_OVERHEAD = 512  # per tensor id: its dict entries, Meta, array object or Failure (measured 280–450 B)
GRAPH_OVERHEAD = 2048  # per registered graph: its entry, plan and id (measured 1.35–1.65 KB for a 1-op graph)
GRAPH_NODE_BYTES = 256  # per op, input and output of a registered graph (measured 150–200 B per op)
GRAPH_COMPILE_BYTES = 1024  # per op, while a graph is validated and compiled (measured 780–870 B beyond its header)
RUN_OVERHEAD = 512     # per run a session remembers, beside its blob's bytes (runs.py)
RUN_OP_BYTES = 256     # per record of a compiled run (measured 220 B)
SESSION_SHARE = 4      # a session's default quota is this fraction of the peer's budget (--max-session-bytes overrides)
POOL_IDLE_SECONDS = 30  # an idle pool buffer not reused for this long is let go


def default_quota(budget: Budget) -> int:
    """The quota of a session when ``--max-session-bytes`` is not given: a quarter of the peer's
    budget, so that no one client can make the peer refuse every other: a lone client still gets a
    quarter of the machine, and it takes four sessions at their quota to fill it."""
    return budget.limit // SESSION_SHARE


class Quota:
    """What one session may hold, counted before it is allocated: its bytes against its quota
    (``limits.max_session_bytes``) and the peer's :class:`Budget`, which it takes in chunks of
    :data:`CREDIT`, and its tensor ids (those in ``ids``, a live collection: the tensor table's)
    against ``limits.max_session_tensors``. :meth:`reserve` is the one way in, for ops, puts and
    runs alike, through one fast path (:meth:`fits`: the credit and :attr:`ceiling`, no lock)."""

    __slots__ = ("limits", "budget", "ids", "used", "credit", "ceiling")

    def __init__(self, limits, budget: Budget, ids):
        self.limits, self.budget = limits, budget
        self.ids = ids      # whose len() the cap on tensors counts
        self.used = 0       # bytes counted against the quota
        self.credit = 0     # bytes taken from the budget and not yet used
        self.ceiling = 0    # how far the fast path may raise used without the other checks (see room)
        self.room()

    def fits(self, nbytes: int) -> bool:
        """The fast path: count ``nbytes`` more if they are within the credit and the :attr:`ceiling`
        (then every check would pass); False, counting nothing, where :meth:`reserve` must check.
        ``nbytes`` holds TENSOR_OVERHEAD for each tensor id it is for, at least (every reservation
        for a new id does): that lets the ceiling stand for the cap on tensors. The op path calls
        it first and counts its new ids only when it fails."""
        if nbytes <= self.credit and self.used + nbytes <= self.ceiling:
            self.credit -= nbytes
            self.used += nbytes
            return True
        return False

    def reserve(self, nbytes: int, ids: int = 0) -> str | None:
        """Count ``nbytes`` more, for ``ids`` tensor ids about to be added, if the quota, the cap on
        tensors and the budget have room; else why not (the fast path first: :meth:`fits`)."""
        if self.fits(nbytes):
            return None
        reason = self.refusal(nbytes, ids)
        if reason is not None:
            return reason
        if nbytes > self.credit:
            wanted = nbytes - self.credit
            if self.budget.take(wanted + CREDIT):
                self.credit += wanted + CREDIT
            elif self.budget.take(wanted):
                self.credit += wanted
            else:
                return (f"{nbytes} more bytes would exceed the peer's memory budget of {self.budget.limit} bytes "
                        f"({self.budget.used} in use by all sessions)")
        self.credit -= nbytes
        self.used += nbytes
        if ids:  # (more bytes alone only lower the room the ceiling leaves: it stays right)
            self.room(ids)
        return None

    def refusal(self, nbytes: int, ids: int = 0) -> str | None:
        """Why the quota or the cap on tensors has no room for ``nbytes`` more and ``ids`` more ids, or None."""
        limits = self.limits
        quota = limits.max_session_bytes
        if self.used + nbytes > quota:
            return f"{nbytes} more bytes would exceed this session's quota of {quota} bytes ({self.used} in use)"
        if ids and len(self.ids) + ids > limits.max_session_tensors:
            return (f"{ids} more tensor(s) would exceed this session's limit of {limits.max_session_tensors} tensors "
                    f"({len(self.ids)} held, failed ones included); drop some first")
        return None

    def give(self, nbytes: int) -> None:
        """Count ``nbytes`` no more (every drop comes here), and set the ceiling again."""
        self.used -= nbytes  # give_back and room, inline: two calls less on every drop
        self.credit += nbytes
        if self.credit > 2 * CREDIT:
            self.budget.give(self.credit - CREDIT)
            self.credit = CREDIT
        limits = self.limits
        self.ceiling = min(limits.max_session_bytes,
                           self.used + TENSOR_OVERHEAD * (limits.max_session_tensors - len(self.ids)))

    def give_back(self, nbytes: int) -> None:
        """:meth:`give` without setting the ceiling again: only after a reservation the fast path
        made, for ids since added that raised ``used`` by their overhead at least, net (a replay
        giving back what its outputs let go held): the ceiling then still stops at the cap."""
        self.used -= nbytes
        self.credit += nbytes
        if self.credit > 2 * CREDIT:  # the budget gets back all but one credit
            self.budget.give(self.credit - CREDIT)
            self.credit = CREDIT

    def room(self, pending: int = 0) -> None:
        """Set :attr:`ceiling`, what the fast path checks instead of the quota and the cap on
        tensors: the quota, lowered so that the ids still allowed (less ``pending``, ids just
        reserved for) fit in it at TENSOR_OVERHEAD each. Every id the fast path adds raises ``used``
        by at least that, so it cannot pass the cap without a full check first; whatever lowers
        ``used`` or adds ids otherwise calls this after."""
        limits = self.limits
        self.ceiling = min(limits.max_session_bytes,
                           self.used + TENSOR_OVERHEAD * (limits.max_session_tensors - len(self.ids) - pending))

    def close(self, held: int = 0) -> None:
        """Give everything back to the budget but ``held`` bytes (those a worker still running gives back)."""
        self.budget.give(self.used + self.credit - held)
        self.used = self.credit = 0
        self.room()


class BufferPool(BufferCache):
    """The peer's pool of receive buffers: the buffers of freed received tensors kept for the next
    upload of the same size (a :class:`BufferCache` whose buffers come back by release): a fresh
    256 MiB buffer costs tens of milliseconds of page faults that a reused one does not. A buffer
    is kept only when nothing else refers to it, and only while the peer's budget has room: its
    idle buffers count against it and go first when it is short (the budget calls :meth:`shrink`).
    One not reused for ``idle_seconds`` is let go (:meth:`expire`), and all when no session is open
    (:meth:`clear`): sizes nobody asks for again do not stay until the budget runs short."""

    def __init__(self, capacity: int = 1 << 30, minimum: int = 1 << 20, budget: Budget | None = None,
                 idle_seconds: float = POOL_IDLE_SECONDS):
        super().__init__(capacity, minimum, budget=budget, idle_seconds=idle_seconds)
        if budget is not None:
            budget.pool = self
