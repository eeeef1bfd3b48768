"""Layer 8 — the ``ember`` command line.

    ember devices [PEER]           list the local devices (or a compute peer's)
    ember bench [SUITE ...]        run benchmarks, print one table of ratios
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from . import __version__


def _devices(args) -> int:
    from .backends import available_devices
    if args.peer:
        print(f"ember devices {args.peer}: listing a peer's devices needs the remote layer, which is not built yet",
              file=sys.stderr)
        return 2
    for name in available_devices():
        print(name)
    return 0


def _bench(args) -> int:
    from .benchmarks import SUITES
    suites = args.suites or list(SUITES)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        print(f"ember bench: unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 2
    reports = []
    for suite in suites:
        print(f"running {suite} …", file=sys.stderr, flush=True)
        report = importlib.import_module(f"ember.benchmarks.{suite}").run(quick=args.quick)
        reports.append(report)
        print(f"\n[{suite}]\n{report.table()}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in reports], f, indent=2)
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ember`` command."""
    top = argparse.ArgumentParser(prog="ember", description="ember: array computing on any device.")
    top.add_argument("--version", action="version", version=f"ember {__version__}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND")

    devices = commands.add_parser("devices", help="list the local devices, or a compute peer's",
                                  description="List device strings: numpy, torch:cpu, torch:cuda:N …")
    devices.add_argument("peer", nargs="?", help="a peer address such as ember://host:7878 (optional)")
    devices.set_defaults(run=_devices)

    bench = commands.add_parser("bench", help="run benchmarks and print ratios against baselines",
                                description="Run benchmarks (all when no suite is named); each compares ember "
                                            "with a baseline measured in the same run and prints medians and ratios.")
    bench.add_argument("suites", nargs="*", metavar="SUITE", help="suites to run (default: all)")
    bench.add_argument("--quick", action="store_true", help="fewer repeats: a fast, noisier run")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.set_defaults(run=_bench)
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ember`` console script."""
    args = parser().parse_args(argv)
    if not getattr(args, "run", None):
        parser().print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
