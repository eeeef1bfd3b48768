"""Walk ``em.add(a, b)`` on a peer and its read through ember's modules, client and peer alike.

A peer is served in this process (``ember.Server`` on a free loopback port, its threads traced),
``a`` and ``b`` are uploaded and one add + read runs untraced to warm up; then one more add and
its read run with a profiler on every thread. Each module of ``ember/`` that Python code enters
is a *room*; each call from one ember module into another is a *crossing* (calls into NumPy or
the standard library and back are not counted). Printed: the rooms in the order first entered,
per side (the client's threads, the peer's), the crossings between them, and the pairs of rooms
crossed both ways (one calls the other and is called back).

    python tools/walk.py            # this checkout
    PYTHONPATH=OLD python tools/walk.py   # another tree, to compare (OLD: its root)
"""
from __future__ import annotations

import collections
import os
import sys
import threading

import ember as em

ROOT = os.path.dirname(os.path.abspath(em.__file__))
recording = False
events: dict[str, list] = collections.defaultdict(list)  # thread name -> [(caller module, callee module)]


def module_of(filename: str) -> str | None:
    if not filename.startswith(ROOT + os.sep):
        return None
    name = filename[len(ROOT) + 1:].removesuffix(".py").replace(os.sep, ".")
    return name.removesuffix(".__init__")


def profile(frame, event, arg):
    if not recording or event != "call":
        return
    callee = module_of(frame.f_code.co_filename)
    if callee is None:
        return
    caller = frame.f_back
    while caller is not None and module_of(caller.f_code.co_filename) is None:
        caller = caller.f_back  # through a library frame (a callback from NumPy or threading) to ember's
    events[threading.current_thread().name].append((module_of(caller.f_code.co_filename) if caller else None,
                                                    callee))


def main() -> None:
    global recording
    threading.setprofile(profile)  # the peer's threads start after this
    server = em.Server("numpy", listen="127.0.0.1:0", insecure=True).start()
    try:
        device = em.device(f"ember://{server.address}/0")
        a = em.asarray([1.0, 2.0, 3.0], device=device)
        b = em.asarray([4.0, 5.0, 6.0], device=device)
        em.asnumpy(em.add(a, b))  # warm: the session, its imports and caches
        sys.setprofile(profile)
        recording = True
        value = em.asnumpy(em.add(a, b))
        recording = False
        sys.setprofile(None)
        assert value.tolist() == [5.0, 7.0, 9.0], value
    finally:
        recording = False
        server.stop()
    client_threads = {threading.main_thread().name, "ember-quiet-watch"}  # the caller's and the engine's
    sides = {"client": [e for t, es in events.items() if t in client_threads for e in es],
             "peer": [e for t, es in events.items() if t not in client_threads for e in es]}
    total_rooms, total_crossings = set(), 0
    for side, calls in sides.items():
        rooms = list(dict.fromkeys(callee for _, callee in calls))
        crossings = [(c, m) for c, m in calls if c is not None and c != m]
        total_rooms.update(rooms)
        total_crossings += len(crossings)
        both_ways = sorted({tuple(sorted(pair)) for pair in crossings if pair[::-1] in set(crossings)})
        print(f"{side}: {len(rooms)} rooms, {len(crossings)} crossings, {len(calls)} calls into ember, "
              f"{len(both_ways)} pairs of rooms crossed both ways ({', '.join('⇄'.join(p) for p in both_ways) or '-'})")
        print("  rooms:", " ".join(rooms))
        pairs = collections.Counter(crossings)
        print("  crossings:", ", ".join(f"{c}→{m} ×{n}" for (c, m), n in pairs.most_common()))
    print(f"both: {len(total_rooms)} rooms, {total_crossings} crossings")


if __name__ == "__main__":
    main()
