"""The buffer cache both ends receive tensors into (ember/backends/buffers.py), without I/O: recalled
buffers (the client's downloads), released ones (the peer's uploads, remote/memory.py's BufferPool),
a budget as a hook and the expiry of idle buffers. Reference counts decide, so these cannot run
under mutmut's trampolines (tools/mutation.py)."""

from __future__ import annotations

import time

import numpy as np

from ember.backends.buffers import BufferCache
from ember.remote.memory import POOL_IDLE_SECONDS, Budget, BufferPool

MiB = 1 << 20


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


class _Ledger:
    """A budget of ``limit`` bytes that records what the cache takes and gives (a :class:`Charge`)."""

    def __init__(self, limit: int):
        self.limit, self.used, self.calls = limit, 0, []

    def take(self, nbytes, evict=True):
        self.calls.append(("take", nbytes, evict))
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes):
        self.calls.append(("give", nbytes))
        self.used -= nbytes


# --- recalled: the client's downloads -------------------------------------------------------------

def test_recalled_buffers_are_reused_only_once_nothing_refers_to_them():
    buffers = BufferCache(capacity=4 << 20, minimum=1 << 20, recall=True)
    first = buffers.allocate((1 << 18,), np.dtype(np.float32))  # 1 MiB
    where = _address(first)
    kept = buffers.allocate((1 << 18,), np.dtype(np.float32))  # the first is in use: new memory
    assert _address(kept) != where
    del first
    again = buffers.allocate((512, 512), np.dtype(np.int32))  # the same bytes, another shape and dtype
    assert _address(again) == where and again.shape == (512, 512) and again.dtype == np.int32
    view = again[::2]
    del again
    assert _address(buffers.allocate((1 << 20,), np.dtype(np.uint8))) != where  # a view still uses it
    del view
    small = buffers.allocate((100,), np.dtype(np.float64))  # under the minimum: never kept
    assert all(b.nbytes >= 1 << 20 for b in buffers.lent)
    pooled = [_address(b) for b in buffers.lent]
    huge = buffers.allocate((5 << 20,), np.dtype(np.uint8))  # over the capacity: never kept, and evicts nothing
    assert [_address(b) for b in buffers.lent] == pooled
    assert buffers.total == sum(b.nbytes for b in buffers.lent) <= 4 << 20
    reused = buffers.allocate((1 << 20,), np.dtype(np.uint8))  # the oldest free buffer, lent again: now the newest
    held = [buffers.allocate((1 << 20,), np.dtype(np.uint8)) for _ in range(3)]  # in use: new buffers
    newest = [_address(a) for a in (reused, *held)]
    assert [_address(b) for b in buffers.lent] == newest  # the capacity keeps the four most recently lent
    assert buffers.total == sum(b.nbytes for b in buffers.lent) == 4 << 20
    assert small.nbytes == 800 and huge.nbytes == 5 << 20


def test_a_recalled_buffer_is_the_least_recently_lent_free_one_and_outside_the_bounds_a_plain_array():
    buffers = BufferCache(capacity=8 * MiB, minimum=MiB, recall=True)
    first, second = (buffers.allocate((MiB,), np.dtype(np.uint8)) for _ in range(2))
    order = [_address(first), _address(second)]
    del first, second  # both free: the one lent first comes back first
    assert _address(buffers.allocate((MiB,), np.dtype(np.uint8))) == order[0]
    assert [_address(b) for b in buffers.lent] == order[::-1]
    # a program's own arrays: the cache neither lends nor keeps them
    assert buffers.allocate((MiB - 1,), np.dtype(np.uint8)).base is None
    assert buffers.allocate((8 * MiB + 1,), np.dtype(np.uint8)).base is None and buffers.total == 2 * MiB
    assert buffers.allocate((8 * MiB,), np.dtype(np.uint8)).base is not None  # exactly the capacity: lent
    assert buffers.total == 8 * MiB and len(buffers.lent) == 1  # and the older loans forgotten for it


def test_recalled_loans_are_not_idle_buffers_clear_expire_and_shrink_keep_them():
    buffers = BufferCache(capacity=8 * MiB, minimum=MiB, recall=True, idle_seconds=0)
    kept = buffers.allocate((MiB,), np.dtype(np.uint8))
    assert buffers.clear() == 0 and buffers.expire(time.monotonic() + 60) == 0 and buffers.shrink(MiB) == 0
    assert buffers.total == MiB and len(buffers.lent) == 1 and buffers.let_go == 0
    del kept
    assert len(buffers.lent) == 1 and buffers.allocate((MiB,), np.dtype(np.uint8)).base is buffers.lent[0]


# --- released: the peer's uploads, with a budget and expiry -------------------------------------------

def test_a_released_buffer_without_a_budget_or_expiry_stays_until_it_is_reused_or_cleared():
    cache = BufferCache(capacity=4 * MiB, minimum=MiB)
    assert cache.idle_seconds is None and cache.budget is None and not cache.recall
    offered = [cache.allocate((MiB // 8,), np.dtype(np.float64))]
    address = _address(offered[0])
    cache.release(offered)
    del offered
    assert cache.total == MiB and cache.expire(time.monotonic() + 10 ** 6) == 0 and cache.total == MiB
    assert _address(cache.allocate((MiB,), np.dtype(np.uint8))) == address and cache.total == 0
    cache.release([cache.allocate((2 * MiB,), np.dtype(np.uint8))])
    assert cache.clear() == 2 * MiB and cache.total == 0 and cache.free == {} and cache.let_go == 2 * MiB


def test_released_past_the_capacity_a_buffer_is_still_lent_but_never_kept():
    cache = BufferCache(capacity=2 * MiB, minimum=MiB)
    big = [cache.allocate((3 * MiB,), np.dtype(np.uint8))]
    assert big[0].base is not None and big[0].base.dtype == np.uint8  # a view of a byte buffer, as below it
    cache.release(big)
    assert cache.total == 0 and cache.free == {}


def test_a_budget_hook_counts_the_idle_bytes_and_refuses_without_evicting():
    ledger = _Ledger(3 * MiB)
    cache = BufferCache(minimum=MiB, budget=ledger)
    cache.release([cache.allocate((2 * MiB,), np.dtype(np.uint8))])
    assert ledger.calls == [("take", 2 * MiB, False)] and ledger.used == 2 * MiB == cache.total
    cache.release([cache.allocate((2 * MiB,), np.dtype(np.uint8)), np.empty(2 * MiB, np.uint8)[:]])
    # the first came from the pool (its bytes given back), then both offered: one fits, one is refused
    assert ledger.calls[1:] == [("give", 2 * MiB), ("take", 2 * MiB, False), ("take", 2 * MiB, False)]
    assert cache.total == ledger.used == 2 * MiB and list(cache.free) == [2 * MiB]
    assert cache.shrink(1) == 2 * MiB and cache.total == 0  # the budget counts what shrink frees itself
    assert ledger.used == 2 * MiB and ledger.calls[-1] == ("take", 2 * MiB, False)


def test_idle_seconds_let_go_of_the_oldest_buffers_of_each_size_and_give_their_bytes_back():
    ledger = _Ledger(64 * MiB)
    cache = BufferCache(minimum=MiB, budget=ledger, idle_seconds=5)
    offered = [np.empty(MiB, np.uint8)[:]]
    cache.release(offered)
    time.sleep(0.01)
    offered = [np.empty(MiB, np.uint8)[:], np.empty(2 * MiB, np.uint8)[:]]
    cache.release(offered)
    del offered
    first = cache.since[MiB][0]  # the older 1 MiB buffer, at the bottom of its stack
    assert cache.total == 4 * MiB and cache.expire(first + 5 - 1e-3) == 0  # none idle for 5 s yet
    assert cache.expire(first + 5 + 5e-3) == MiB and cache.total == 3 * MiB  # the first 1 MiB only
    assert sorted(cache.free) == [MiB, 2 * MiB] and len(cache.free[MiB]) == 1 == len(cache.since[MiB])
    assert cache.expire(time.monotonic() + 5) == 3 * MiB and cache.free == {} and cache.since == {}
    assert ledger.used == 0 and cache.let_go == 4 * MiB


def test_the_peers_pool_is_the_cache_with_its_budget_and_thirty_seconds():
    budget = Budget(8 * MiB)
    pool = BufferPool(minimum=MiB, budget=budget)
    assert isinstance(pool, BufferCache) and budget.pool is pool and not pool.recall
    assert (pool.capacity, pool.idle_seconds) == (1 << 30, POOL_IDLE_SECONDS) and BufferPool().budget is None
    pool.release([pool.allocate((4 * MiB,), np.dtype(np.uint8))])
    assert budget.used == 4 * MiB and budget.take(8 * MiB) and pool.total == 0  # the budget made room from the pool
