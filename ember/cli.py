"""Layer 8 — the ``ember`` command line.

    ember serve --device D --listen HOST:PORT [--token-file F | --tokens-file F] [--tls-cert F --tls-key F]
                [--max-sessions N] [--idle-timeout S] [--handshake-timeout S] [--insecure]
                [--tls-ca F] [--transfer-ttl S] [--fetch-from ADDRS] [--resume-window S]
                                   host D's backend as a compute peer
    ember demo                     the whole job in one command: peer, remote, training, capture
    ember devices [PEER]           list the local devices (or a compute peer's, or with ray://auto
                                   the peers ember.ray.launch runs on a Ray cluster)
    ember bench [SUITE ...]        run benchmarks, print one table of ratios (--runs N: their spread)
    ember top PEER [--once]        a compute peer's sessions and throughput, refreshed (its /status.json)
    ember graph FILE [--render OUT] [--onnx OUT] [--json OUT]
                                   summarise a saved graph (.ember, or an ONNX model); convert or draw it
    ember graph verify FILE --on D1,D2[,…] [--inputs X.npz]
                                   replay it on each device; name the first op whose outputs diverge
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading

from . import __version__


def _devices(args) -> int:
    from .backends import available_devices
    from .errors import EmberError
    if not args.peer:
        for name in available_devices():
            print(name)
        return 0
    if args.peer.startswith("ray://"):
        return _fleet(args.peer)
    from .devices import device, redact_secrets
    try:
        peer = device(args.peer.rstrip("/") + ("/0" if args.peer.count("/") == 2 else ""))
        info = peer.engine.info
    except EmberError as error:  # its message names the device without its token; this makes sure
        print(f"ember devices: {redact_secrets(str(error), args.peer, os.environ.get('EMBER_TOKEN'))}", file=sys.stderr)
        return 1
    base = str(peer).rsplit("/", 1)[0]
    for index, name in enumerate(info.get("devices", ())):
        print(f"{base}/{index}    {name}")
    return 0


def _fleet(address: str) -> int:
    """``ember devices ray://auto`` (or a Ray Client address ray://HEAD:10001): the peers that
    ``ember.ray.launch`` runs on that Ray cluster, one line a device, never a token."""
    from .ray import peers
    target = "auto" if address.rstrip("/") in ("ray:", "ray://auto") else address
    try:
        found = peers(target)
    except (ImportError, ConnectionError, RuntimeError, ValueError) as error:
        print(f"ember devices: {error}", file=sys.stderr)
        return 1
    for peer in found:
        for index, name in enumerate(peer.devices):
            print(f"{peer.url}/{index}    {name}    {peer.name} (node {peer.node}, pid {peer.pid})")
    if not found:
        print(f"ember devices: no ember peers on the Ray cluster at {address}", file=sys.stderr)
    return 0


def _serve(args) -> int:
    import logging
    from dataclasses import replace

    from .errors import ArgumentError, EmberError
    from .remote.access import MAKE_A_TOKEN, MIN_TOKEN_CHARACTERS, TokenFile, exposed
    from .remote.process import keep_freed_memory
    from .remote.server import PEER_LIMITS, Server
    keep_freed_memory()  # this process is the peer's alone
    token = authorize = None
    shortest = 0 if args.insecure else MIN_TOKEN_CHARACTERS  # a short token falls to guessing, however slow
    try:
        for path in filter(None, (args.token_file, args.tokens_file)):
            risk = exposed(path)
            if risk:
                print(f"ember serve: warning: {risk}", file=sys.stderr)
        if args.token_file:
            try:
                with open(args.token_file) as f:
                    token = f.read().strip()
            except OSError as error:
                raise ArgumentError(f"cannot read the token file: {error}") from None
            if not token:
                raise ArgumentError(f"the token file {args.token_file} is empty")
            if len(token) < shortest:
                raise ArgumentError(f"the token in {args.token_file} has {len(token)} characters, and a token needs "
                                    f"{shortest} or more: make one with {MAKE_A_TOKEN} (--insecure accepts it)")
        if args.tokens_file:
            authorize = TokenFile.load(args.tokens_file, min_token_characters=shortest)
        limits = PEER_LIMITS
        if args.max_tensor_bytes:
            limits = replace(limits, max_tensor_bytes=args.max_tensor_bytes)
        if args.max_session_bytes:
            limits = replace(limits, max_session_bytes=args.max_session_bytes)
        for name in ("max_session_tensors", "max_session_graphs", "max_graph_ops"):
            value = getattr(args, name)
            if value is not None:
                if value < 1:
                    raise ArgumentError(f"--{name.replace('_', '-')} is a whole number ≥ 1, got {value}")
                limits = replace(limits, **{name: value})
        server = Server(args.device, args.listen, token=token, authorize=authorize, insecure=args.insecure,
                        limits=limits, tls_cert=args.tls_cert, tls_key=args.tls_key, max_sessions=args.max_sessions,
                        idle_timeout=args.idle_timeout, handshake_timeout=args.handshake_timeout,
                        max_memory=args.max_memory, tls_ca=args.tls_ca, transfer_ttl=args.transfer_ttl,
                        fetch_from=args.fetch_from, resume_window=args.resume_window)
        server.start()
    except (EmberError, OSError) as error:
        print(f"ember serve: {error}", file=sys.stderr)
        return 2
    # one line a session opened, closed or refused, naming the client (never its token)
    logging.basicConfig(level=logging.INFO, format="ember serve: %(message)s")
    logging.getLogger("websockets").setLevel(logging.WARNING)  # not a line per connection of its own
    import signal
    signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    if os.environ.get("EMBER_STOP_WITH_PARENT"):  # spawned by PeerProcess: stop once its stdin closes
        threading.Thread(target=lambda: (sys.stdin.read(), server.request_stop()), daemon=True).start()
    names = ", ".join(str(d) for d in server.devices)
    guards = " and ".join(what for what, on in (("TLS", server.tls), ("a token", token),
                                                ("a tokens file", authorize)) if on)
    tcp, ws = ("embers", "wss") if server.tls else ("ember", "ws")
    print(f"ember serve: hosting {names} ({server.backend_name}); listening on {server.address}"
          f"{' with ' + guards if guards else ''} — {tcp}://{server.address}/0 or {ws}://{server.address}/0", flush=True)
    server.serve_forever()
    return 0


def _bench(args) -> int:
    from .benchmarks import SUITES
    suites = args.suites or list(SUITES)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        print(f"ember bench: unknown suite {unknown[0]!r}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 2
    if args.runs < 1:
        print(f"ember bench: --runs must be 1 or more, got {args.runs}", file=sys.stderr)
        return 2
    if args.runs > 1:
        return _bench_runs(args, suites)
    from .benchmarks.timing import combined_table
    reports = []
    for suite in suites:
        print(f"running {suite} …", file=sys.stderr, flush=True)
        report = importlib.import_module(f"ember.benchmarks.{suite}").run(quick=args.quick)
        reports.append(report)
        if len(suites) > 1:
            print(f"  {suite}: done", file=sys.stderr, flush=True)
    print(combined_table(reports), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in reports], f, indent=2)
    return 0


def _top(args) -> int:
    from .remote.top import run
    if args.token:  # argv is for every user of this machine to read (ps, /proc)
        print("ember top: warning: --token shows the token to anyone who lists this machine's processes; "
              "set EMBER_TOKEN instead", file=sys.stderr)
    return run(args.peer, token=args.token, interval=args.interval, once=args.once, tls_ca=args.tls_ca)


def _demo(args) -> int:
    from .demo import run
    return run(local=args.device, peer_device=args.peer_device, steps=args.steps, size=args.size, out=args.out)


def _graph(args) -> int:
    import numpy as np

    from .errors import EmberError
    from .graphs import load_graph, load_onnx
    verifying = args.file == "verify"
    path = args.verify_file if verifying else args.file
    if path is None or (args.verify_file and not verifying):
        print("ember graph: give one FILE, or `verify FILE --on DEVICES`", file=sys.stderr)
        return 2
    try:
        graph = load_onnx(path) if path.endswith(".onnx") else load_graph(path)
        if verifying:
            devices = [d for d in (args.on or "").split(",") if d]
            inputs = dict(np.load(args.inputs)) if args.inputs else None
            report = graph.verify(devices, inputs=inputs)
            print(report)
            return 0 if report.ok else 1
        print(graph)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(graph.to_json(), f, indent=1)
            print(f"wrote {args.json}")
        for out, write in ((args.render, graph.render), (args.onnx, graph.to_onnx)):
            if out:
                print(f"wrote {write(out)}")
    except (EmberError, OSError, ValueError, KeyError) as error:
        print(f"ember graph: {error}", file=sys.stderr)
        return 2
    return 0


def parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ember`` command."""
    from .remote.resume import RESUME_WINDOW
    from .remote.server import HANDSHAKE_SECONDS, IDLE_SECONDS, MAX_SESSIONS
    from .remote.transfers import TTL
    top = argparse.ArgumentParser(prog="ember", description="ember: array computing on any device.")
    top.add_argument("--version", action="version", version=f"ember {__version__}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser("demo", help="the whole job in one command (a few seconds)",
                               description="Start a compute peer on 127.0.0.1 in a child process and show: one "
                                           "computation on a local and a remote device, an MLP trained on the peer, a "
                                           "training step captured, saved, rendered and replayed with em.jit, the refusal "
                                           "to serve a capture device, and what it all cost. The peer stops on exit.")
    demo.add_argument("--device", default="numpy", help="the local device to compare with (default numpy)")
    demo.add_argument("--peer-device", default="numpy", help="what the peer hosts (default numpy)")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--size", type=int, default=200, help="matrix size of the first computation (default 200)")
    demo.add_argument("--out", help="keep the saved and rendered graph in this directory (default: a temporary one)")
    demo.set_defaults(run=_demo)

    serve = commands.add_parser("serve", help="host a local backend as a compute peer",
                                description="Host every device of a local backend for remote clients "
                                            "(ember://HOST:PORT/N over TCP, ws://HOST:PORT/N over WebSocket, one port; "
                                            "embers:// and wss:// with --tls-cert and --tls-key). A non-loopback address "
                                            "needs TLS and a token unless --insecure. Blocks until Ctrl-C.")
    serve.add_argument("--device", default="numpy",
                       help="the backend to host: numpy, torch:cpu, torch:cuda, jax:cpu, jax:gpu (default numpy)")
    serve.add_argument("--listen", default="127.0.0.1:7878", help="HOST:PORT to listen on (port 0 picks a free one)")
    access = serve.add_mutually_exclusive_group()
    access.add_argument("--token-file", metavar="FILE", help="a file holding the token clients must present")
    access.add_argument("--tokens-file", metavar="FILE",
                        help="a file naming clients, one a line: NAME TOKEN [DEVICE ...] (all devices when none is "
                             "listed; # starts a comment line); logs name each client")
    serve.add_argument("--tls-cert", metavar="FILE", help="serve only TLS (embers://, wss://) with this certificate chain (PEM)")
    serve.add_argument("--tls-key", metavar="FILE", help="the private key of --tls-cert (PEM)")
    serve.add_argument("--insecure", action="store_true",
                       help="allow a non-loopback address without TLS or a token, and tokens under "
                            "16 characters")
    serve.add_argument("--max-tensor-bytes", type=int, metavar="BYTES", help="refuse tensors larger than this (default 4 GiB)")
    serve.add_argument("--max-session-bytes", type=int, metavar="BYTES",
                       help="the bytes one session may hold: its tensors and what it registers (default: a quarter "
                            "of the memory budget)")
    serve.add_argument("--max-session-tensors", type=int, metavar="N",
                       help="the tensor ids one session may hold at once, failed ones included (default 1,048,576)")
    serve.add_argument("--max-session-graphs", type=int, metavar="N",
                       help="the graphs one session may keep registered (default 4,096)")
    serve.add_argument("--max-graph-ops", type=int, metavar="N",
                       help="the ops (and inputs, and outputs) of one graph, refused before it is compiled "
                            "(default 65,536)")
    serve.add_argument("--max-memory", type=int, metavar="BYTES",
                       help="the bytes all sessions may hold together, the buffer pool included (default: 3/4 of RAM)")
    serve.add_argument("--max-sessions", type=int, default=MAX_SESSIONS, metavar="N",
                       help=f"serve at most N sessions at once, refusing more (default {MAX_SESSIONS})")
    serve.add_argument("--idle-timeout", type=float, default=IDLE_SECONDS, metavar="SECONDS",
                       help=f"close a session that sends nothing for this long (default {IDLE_SECONDS}; 0: never)")
    serve.add_argument("--handshake-timeout", type=float, default=HANDSHAKE_SECONDS, metavar="SECONDS",
                       help=f"a connection's TLS, WebSocket upgrade and init frame must all arrive within this "
                            f"(default {HANDSHAKE_SECONDS})")
    serve.add_argument("--tls-ca", metavar="FILE",
                       help="fetching a tensor from a TLS peer (x.to_device between peers), trust the CA certificates "
                            "in FILE (PEM; default: EMBER_TLS_CA, else the system's store)")
    serve.add_argument("--transfer-ttl", type=float, default=TTL, metavar="SECONDS",
                       help=f"a transfer capability this peer grants expires after this long (default {TTL:g})")
    serve.add_argument("--fetch-from", default="", metavar="ADDRS",
                       help="the peers this peer may fetch tensors from (x.to_device between peers): addresses, networks "
                            "or host names, each with or without :PORT, comma-separated (127.0.0.1,10.0.0.0/8,gpu-box:7878; "
                            "default none: moves only between this peer's own sessions)")
    serve.add_argument("--resume-window", type=float, default=RESUME_WINDOW, metavar="SECONDS",
                       help=f"a session whose connection is lost is kept this long for its client to resume it, its "
                            f"tensors counted in the memory budget as before (default {RESUME_WINDOW:g}; 0: a lost "
                            f"connection ends the session)")
    serve.set_defaults(run=_serve)

    devices = commands.add_parser("devices", help="list the local devices, or a compute peer's",
                                  description="List device strings: numpy, torch:cpu, torch:cuda:N, jax:cpu …")
    devices.add_argument("peer", nargs="?", help="a peer address such as ember://host:7878, or ray://auto for the peers "
                                                 "ember.ray.launch runs on a Ray cluster (RAY_ADDRESS, else this "
                                                 "machine's; ray://HEAD:10001 through Ray Client) (optional)")
    devices.set_defaults(run=_devices)

    watch = commands.add_parser("top", help="watch a compute peer's sessions and throughput",
                              description="Show a compute peer's sessions, memory and throughput (read from its "
                                          "/status.json), refreshed until Ctrl-C.")
    watch.add_argument("peer", help="the peer: ember://host:port (ws://; embers:// or wss:// read it over HTTPS); "
                                    "the token in EMBER_TOKEN")
    watch.add_argument("--token", help="the token the peer asks for (default: EMBER_TOKEN, else from the address; "
                                       "in argv others on this machine can read it: prefer EMBER_TOKEN)")
    watch.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="seconds between refreshes (default 2)")
    watch.add_argument("--once", action="store_true", help="print the status once and exit")
    watch.add_argument("--tls-ca", metavar="FILE", help="the CA certificates a TLS peer is checked against (PEM)")
    watch.set_defaults(run=_top)

    bench = commands.add_parser("bench", help="run benchmarks and print ratios against baselines",
                                description="Run benchmarks (all when no suite is named); each compares ember "
                                            "with a baseline measured in the same run and prints medians and ratios.")
    bench.add_argument("suites", nargs="*", metavar="SUITE", help="suites to run (default: all)")
    bench.add_argument("--quick", action="store_true", help="fewer repeats: a fast, noisier run")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON (with --runs: a list of the runs)")
    bench.add_argument("--runs", type=int, default=1, metavar="N",
                       help="run the suites N times, each in a fresh process, and print each row's median, range "
                            "and how many runs met its target (default 1: one table of one run)")
    bench.set_defaults(run=_bench)

    graph = commands.add_parser("graph", help="summarise, convert, draw or verify a saved graph",
                                description="Print a saved graph's summary (a .ember file from CapturedGraph.save, or "
                                            "an .onnx model); write it as ONNX, JSON or a drawing. `ember graph verify "
                                            "FILE --on numpy,torch:cpu,ember://HOST:PORT/0` replays it on each device "
                                            "and names the first op whose outputs diverge (exit status 1).")
    graph.add_argument("file", metavar="FILE", help="the graph file (or `verify`, then the file)")
    graph.add_argument("verify_file", nargs="?", metavar="FILE", help=argparse.SUPPRESS)
    graph.add_argument("--render", metavar="OUT", help="draw it: OUT.svg (needs Graphviz) or OUT.dot")
    graph.add_argument("--onnx", metavar="OUT", help="write it as an ONNX model (needs ember[onnx])")
    graph.add_argument("--json", metavar="OUT", help="write its readable JSON view")
    graph.add_argument("--on", metavar="DEVICES", help="verify: comma-separated devices, the first the reference")
    graph.add_argument("--inputs", metavar="NPZ", help="verify: input arrays by name (default: seeded random ones)")
    graph.set_defaults(run=_graph)
    return top


def _bench_runs(args, suites: list[str]) -> int:
    """``ember bench --runs N``: the suites run N times, each time in a fresh process (as a user
    runs them, nothing warm from the run before), then one table of each row's spread."""
    import subprocess
    import tempfile
    import time

    from .benchmarks.timing import spread_table
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.runs):
            path = os.path.join(folder, f"run{i}.json")
            command = [sys.executable, "-c", "import sys; from ember.cli import main; sys.exit(main(sys.argv[1:]))",
                       "bench", *suites, "--json", path, *(["--quick"] if args.quick else [])]
            print(f"run {i + 1} of {args.runs} …", file=sys.stderr, flush=True)
            started = time.monotonic()
            done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                print(f"ember bench: run {i + 1} failed (exit {done.returncode}):\n{done.stderr.strip()}", file=sys.stderr)
                return 1
            with open(path) as f:
                runs.append(json.load(f))
            print(f"  run {i + 1}: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    print(spread_table(runs), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ember`` console script."""
    args = parser().parse_args(argv)
    if not getattr(args, "run", None):
        parser().print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
