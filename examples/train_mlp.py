"""Train an MLP on two spirals (generated in code) with ember's autodiff and Adam.

    python examples/train_mlp.py                              # numpy
    python examples/train_mlp.py --device torch:cpu
    python examples/train_mlp.py --device ember://127.0.0.1:7878/0 --jit
    python examples/train_mlp.py --device peer                # starts a local peer for the run

Prints the loss every --log-every steps and the final accuracy; exits 1 below --min-accuracy.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import ember as em
from ember.remote.spawn import PeerProcess
from ember.spirals import train


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="numpy", help="numpy, torch:cpu, ember://HOST:PORT/0, ws://…, or 'peer'")
    parser.add_argument("--jit", action="store_true", help="capture the training step once and replay it")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--min-accuracy", type=float, default=0.95)
    args = parser.parse_args(argv)

    def on_step(i, loss):
        if i % args.log_every == 0 or i == args.steps - 1:
            print(f"step {i:5d}  loss {loss:.6f}", flush=True)

    def run(device):
        result = train(device, steps=args.steps, use_jit=args.jit, lr=args.lr, dtype=np.dtype(args.dtype), on_step=on_step)
        print(f"accuracy {result['accuracy']:.4f} on {em.device(device)}{' (jit)' if args.jit else ''}; "
              f"{result['seconds_per_step'] * 1e3:.2f} ms per step")
        return result

    if args.device == "peer":
        with PeerProcess() as peer:
            result = run(peer.url())
    else:
        result = run(args.device)
    return 0 if result["accuracy"] >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
