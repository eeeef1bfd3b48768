"""Who may hold a connection of a compute peer before it is authenticated: its slots, sans-I/O.

An accepted connection costs the peer a thread, a file and some buffers until its handshake is
done, so the shells count them here (``server.py`` takes a slot as it admits a connection,
``connections.py`` moves or gives it back), in three pools:

- **handshakes** (``max_sessions`` of them): a connection from its accept until its handshake is
  done, or until its first frame shows it is another peer's fetch;
- **fetches** (``max(8, max_sessions // 4)``): other peers' connections whose first frame is a
  ``fetch``, while the peer waits for their grant — so fetches that present capabilities nobody
  granted wait beside the clients' handshakes, never in their slots;
- **refusals** (``max(4, max_sessions // 8)``): a connection that finds its pool full is still
  read for its first bytes, TLS and first frame, for a short while, so that it can be answered
  ``PeerBusy`` in the framing it speaks rather than reset. When these are taken too, the newest
  connection takes the place of the oldest: one that has waited longest without its first bytes
  is the likeliest to be a stranger holding it.

One address may hold at most a quarter of the handshake and fetch slots (:data:`SHARE`, at least
one): a stranger needs four addresses to take them all, and a host with many clients (a NAT, a
machine running a fleet) still has sixteen handshakes in flight of the default 64, each of which
lasts milliseconds. An IPv6 client counts by its /64, the block one host is usually given.
"""

from __future__ import annotations

from collections import Counter

SHARE = 4  # one address holds at most 1/SHARE of a pool


class Pool:
    """``size`` slots, at most ``share`` of them held by one address. ``holding`` says what a slot
    holds ("connection(s) in their handshake"), ``limit`` what sets the size ("--max-sessions 64"):
    both go into the reason a refused connection is given."""

    def __init__(self, size: int, holding: str, limit: str):
        self.size, self.holding, self.limit = size, holding, limit
        self.share = max(1, size // SHARE)
        self.held: Counter[str] = Counter()
        self.in_use = 0

    def take(self, key: str) -> str | None:
        """Take a slot for a connection from ``key``: None once taken, else why not (a PeerBusy reason)."""
        if self.in_use >= self.size:
            return (f"this peer is busy: {self.in_use} {self.holding} already, the most it takes at once "
                    f"({self.limit}); try again later")
        if self.held[key] >= self.share:
            return (f"this peer is busy for {key}: {self.held[key]} {self.holding} from that address already, the "
                    f"most one address may hold (a quarter of the {self.size} slots; {self.limit}); try again later")
        self.held[key] += 1
        self.in_use += 1
        return None

    def give_back(self, key: str) -> None:
        """Give back a slot :meth:`take` gave a connection from ``key``."""
        if self.held[key] <= 0:
            raise ValueError(f"no slot of {key!r} is held")
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]  # addresses are forgotten as their connections end
        self.in_use -= 1


class Reserve:
    """``size`` places for connections being refused; when all are taken, the newest connection
    takes the oldest one's (which the shell then closes)."""

    def __init__(self, size: int):
        self.size = size
        self.waiting: dict = {}  # insertion order: the oldest first

    def take(self, item):
        """Give ``item`` a place: the item it displaced (to close), or None."""
        displaced = None
        if len(self.waiting) >= self.size:
            displaced = next(iter(self.waiting))
            del self.waiting[displaced]
        self.waiting[item] = None
        return displaced

    def give_back(self, item) -> None:
        """``item`` is done; nothing if it was displaced already."""
        self.waiting.pop(item, None)


class Slots:
    """A peer's three pools (see the module's docstring) for a peer admitting ``max_sessions``
    sessions. Not thread-safe: the shell calls it under its lock."""

    def __init__(self, max_sessions: int):
        self.handshakes = Pool(max_sessions, "connection(s) in their handshake", f"--max-sessions {max_sessions}")
        fetches = max(8, max_sessions // 4)
        self.fetches = Pool(fetches, "fetch(es) of other peers waiting for their grant",
                            f"fetch slots are a quarter of --max-sessions {max_sessions}, at least 8")
        self.refusals = Reserve(max(4, max_sessions // 8))
