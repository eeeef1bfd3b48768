"""Train the spirals MLP data parallel: the batch split across compute peers, gradients all-reduced peer to peer.

    python examples/data_parallel.py --peers 3                      # starts 3 local peers for the run
    python examples/data_parallel.py --peers 2 --peer-device torch:cpu
    python examples/data_parallel.py --urls ember://gpu-a:7878/0 ember://gpu-b:7878/0
    python examples/data_parallel.py --ray 4 --peer-device torch:cuda  # a fleet launched on a Ray cluster
    python examples/data_parallel.py --peers 3 --steps 20 --check   # and compare with one device

Each peer holds a replica of the parameters and its rows of the batch; each step every replica
computes the gradient of its shard's (weighted) loss, ``ember.distributed.all_reduce`` sums them
peer to peer, and every replica takes the same Adam step (ember.spirals.train_data_parallel).
Prints the loss every --log-every steps; with --check, also trains on one numpy device and prints
the largest difference between the two loss curves (exit status 1 above --tolerance).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import numpy as np

import ember as em
from ember.remote.spawn import PeerProcess
from ember.spirals import train, train_data_parallel


def main(argv=None) -> int:
    """Start the peers (unless --urls), train, print the loss curve, stop the peers; 0 unless --check fails."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2, help="how many local peers to start (ignored with --urls)")
    parser.add_argument("--urls", nargs="+", metavar="URL", help="device strings of running peers, instead of starting them")
    parser.add_argument("--ray", type=int, metavar="N", help="launch N peers as actors on a Ray cluster (ember.ray.launch) "
                        "instead of starting them here; they stop at the end")
    parser.add_argument("--peer-device", default="numpy", help="the device the started peers host (numpy, torch:cpu …)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--check", action="store_true", help="also train on one numpy device and compare the losses")
    parser.add_argument("--tolerance", type=float, default=1e-6, help="the largest loss difference --check accepts")
    args = parser.parse_args(argv)
    if args.urls is None and args.peers < 1:
        parser.error("--peers must be at least 1")
    if args.ray is not None and (args.urls or args.ray < 1):
        parser.error("--ray takes a number of peers ≥ 1, and no --urls")

    def on_step(i, loss):
        if i % args.log_every == 0 or i == args.steps - 1:
            print(f"step {i:5d}  loss {loss:.12f}", flush=True)

    with contextlib.ExitStack() as stack:  # every started peer stops on the way out, whatever happens
        if args.urls:
            urls = args.urls
        elif args.ray is not None:
            import ember.ray
            stack.callback(ember.ray.shutdown)
            urls = ember.ray.launch(args.ray, device=args.peer_device)  # devices that carry their peers' tokens
        else:
            # loopback peers that fetch from each other (the all-reduce's moves)
            urls = [stack.enter_context(PeerProcess("--device", args.peer_device, "--fetch-from", "127.0.0.1")).url()
                    for _ in range(args.peers)]
        print(f"data parallel over {len(urls)} peers: {', '.join(map(str, urls))}", flush=True)
        result = train_data_parallel(urls, steps=args.steps, lr=args.lr, dtype=np.dtype(args.dtype), on_step=on_step)
        print(f"{result['seconds_per_step'] * 1e3:.2f} ms per step")
        for device in result["devices"]:
            device.engine.close()
    if not args.check:
        return 0
    single = train(em.device("numpy"), steps=args.steps, lr=args.lr, dtype=np.dtype(args.dtype))["losses"]
    difference = float(np.max(np.abs(np.asarray(result["losses"]) - np.asarray(single))))
    print(f"largest difference from one device: {difference:.3g}")
    return 0 if difference <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
