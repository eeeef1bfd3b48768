#!/usr/bin/env python3
"""Mutation testing of ember, one group of modules at a time (mutmut 3).

Each group names the modules it mutates and the tests that should catch a bug there, so a
mutant runs a few test files, not the whole suite. A group runs in a throwaway copy of the
checkout (mutmut writes mutants/ beside the sources), and the summary lists killed, survived,
timed-out and untested mutants per module, then every survivor. docs/testing.md records the
figures and a reason for each survivor.

    pip install -e '.[test,torch,mutation]'
    python tools/mutation.py                    # every group
    python tools/mutation.py optim wire         # some groups
    python tools/mutation.py --checkout DIR     # another checkout (an older commit, say)
    python tools/mutation.py --modules ember/optim.py --tests tests/test_optim.py   # ad hoc
    python tools/mutation.py session --json s.json && python tools/mutation.py --recheck s.json --only BufferCache
    python tools/mutation.py op-rules --names 'ember.ops.nn.x__gelu*'   # only some functions' mutants
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUPS = {  # name -> (modules mutated, tests that judge them)
    "optim": (["ember/optim.py"], ["tests/test_optim.py", "tests/test_train.py"]),
    "autodiff": (["ember/autodiff.py", "ember/engines/autodiff.py"],
                 ["tests/test_autodiff_api.py", "tests/test_autodiff.py", "tests/test_array.py", "tests/test_optim.py"]),
    "graphs": ([f"ember/graphs/{name}.py" for name in ("scope", "graph", "files", "jit", "verify")],
               ["tests/test_capture.py", "tests/test_graph_files.py", "tests/test_graph_views.py", "tests/test_jit.py",
                "tests/test_verify.py", "tests/test_graph_cli.py", "tests/test_readme.py"]),
    # ONNX export and import, judged by their own tests (each row exported, run by onnxruntime, compared)
    "onnx": (["ember/graphs/onnx*.py"], ["tests/test_onnx.py", "tests/test_onnx_import.py"]),
    "wire": (["ember/wire/protocol.py", "ember/wire/messages.py"],
             ["tests/test_frames.py", "tests/test_tcp.py", "tests/test_websocket.py", "tests/test_messages.py",
              "tests/test_session.py", "tests/test_remote.py", "tests/test_graph_files.py"]),
    "websocket": (["ember/wire/websocket.py"], ["tests/test_websocket.py", "tests/test_tcp.py", "tests/test_remote.py",
                                              "tests/test_connections.py", "tests/test_tls.py"]),
    "session": ([f"ember/remote/{name}.py" for name in ("session", "tensors", "uploads", "graphs", "moves", "host",
                                                         "memory")] + ["ember/backends/buffers.py"],
                ["tests/test_session.py", "tests/test_tensors.py", "tests/test_uploads.py", "tests/test_graphs.py",
                 "tests/test_memory.py", "tests/test_accounting.py", "tests/test_buffers.py", "tests/test_fuzz.py",
                 "tests/test_connections.py", "tests/test_remote.py", "tests/test_transfers.py",
                 "tests/test_distributed.py",  # peer to peer
                 "tests/test_status.py"]),  # the peer's counters, its access rule
    "op-table": (["ember/ops/table.py", "ember/ops/records.py", "ember/ops/gradients.py"],
                 ["tests/test_op_table.py", "tests/test_autodiff.py", "tests/test_autodiff_api.py", "tests/test_graph_files.py",
                  "tests/test_session.py", "tests/test_memory.py",
                  # the table's helpers (require, normalize_axis, as_shape …) are the rules' words: the rules' own tests
                  "tests/test_rule_edges.py", "tests/test_errors.py", "tests/test_dtypes.py", "tests/test_indexing.py"]),
    # the plans behind em.jit and a peer's runs of ops: slots let go, in-place steps, split runs, refilled outputs
    "engines": (["ember/engines/local.py", "ember/engines/plans.py", "ember/remote/runs.py"],
                ["tests/test_jit.py", "tests/test_array.py", "tests/test_session.py", "tests/test_errors.py",
                 "tests/test_memory.py"]),
    # the client's half of a peer: its protocol (the op log, runs, drops, requests), its shell (waits, the quiet
    # watch, moves between sessions) and the TCP shell both ends use
    "client": (["ember/wire/client.py", "ember/wire/runs.py", "ember/engines/remote.py", "ember/engines/watch.py",
                "ember/engines/sessions.py", "ember/wire/tcp.py"],
               ["tests/test_client_protocol.py", "tests/test_remote.py", "tests/test_tcp.py", "tests/test_websocket.py",
                "tests/test_tls.py",
                "tests/test_transfers.py", "tests/test_connections.py", "tests/test_capture.py", "tests/test_distributed.py"]),
    # grants and fetches between peers without I/O (capabilities single-use, bound to a session, expiring)
    "transfers": (["ember/remote/transfers.py"], ["tests/test_transfers.py", "tests/test_session.py",
                                                 "tests/test_distributed.py"]),
    # who may open a session (authorizers, tokens files) and the HTTP status paths: the parts of the peer's shell that
    # also run in this process (server.py and connections.py run in `ember serve` children: docs/testing.md plants
    # them by hand)
    "access": (["ember/remote/access.py", "ember/remote/http.py", "ember/remote/status.py"],
               ["tests/test_status.py", "tests/test_connections.py", "tests/test_tls.py"]),
    # the rows' own rules (meta, canon, gradient, scratch), judged by the tests generated from the table
    "op-rules": ([f"ember/ops/{name}.py" for name in ("creation", "elementwise", "fft", "indexing", "linalg",
                                                       "linear_algebra", "manipulation", "nn", "reductions")],
                 ["tests/test_op_table.py", "tests/test_autodiff.py", "tests/test_errors.py", "tests/test_nn_reference.py",
                  "tests/test_indexing.py", "tests/test_dtypes.py", "tests/test_memory.py",  # budget: the scratch rules
                  "tests/test_rule_edges.py", "tests/test_autodiff_api.py",
                  "tests/test_graph_views.py"]),  # graph summaries count flops by a row's family
}
LEFT_OUT = [
    "--deselect=tests/test_train.py::test_the_example_reaches_95_percent",  # a 400-step subprocess: slow
]
# the buffer cache decides by sys.getrefcount, which mutmut's trampolines raise, so its tests cannot pass under
# mutmut: they are left out of mutmut runs and judge the cache's survivors in --recheck, on plain patched source
TRAMPOLINE_SHY = ["tests/test_buffers.py",  # every test there (a node id prefix)
                  "tests/test_session.py::test_buffer_pool_reuses_only_unshared_buffers",
                  "tests/test_session.py::test_buffer_pool_keeps_buffers_from_its_minimum_up_to_its_capacity",
                  "tests/test_session.py::test_buffer_pool_keeps_only_views_of_one_dimensional_byte_buffers",
                  "tests/test_session.py::test_a_dropped_tensor_gives_its_buffer_back_once_nothing_shares_it",
                  "tests/test_memory.py::test_idle_pool_buffers_count_against_the_budget_and_give_way_first",
                  "tests/test_memory.py::test_the_budget_holds_exactly_its_limit_and_a_pool_gives_way_largest_first_only_as_needed",
                  "tests/test_memory.py::test_a_released_buffer_is_kept_only_if_the_budget_has_room_without_evicting",
                  "tests/test_memory.py::test_a_pool_gives_up_no_more_than_the_shortfall",
                  "tests/test_transfers.py::test_a_fetched_tensor_is_received_into_the_destinations_buffer_pool_and_its_"
                  "buffer_serves_the_next"]
LEFT_OUT += [f"--deselect={test}" for test in TRAMPOLINE_SHY]
LEFT_BEHIND = shutil.ignore_patterns(".git", ".venv", "venv", "mutants", "build", "dist", "*.egg-info", "__pycache__",
                                     ".hypothesis")
# functions the garbage collector calls (weakref.finalize callbacks, __del__), by file. mutmut's trampoline sets a
# ContextVar, and on CPython 3.10 and 3.11 a collection can start inside another ContextVar update, whose mapping the
# callback's update then frees under it (a segfault in hamt_node_bitmap_assoc; from 3.12 a collection waits for the
# eval loop). Each is left whole in the throwaway copy (`# pragma: no mutate block` on its `def` line: no mutants, no
# trampoline); its own tests judge it as it is
GC_CALLBACKS = {"ember/engines/local.py": ["    def take(self, key) -> tuple | None:"],  # KeptOutputs.take
                "ember/engines/remote.py": ["    def __del__(self):"]}  # RemoteHandle.__del__
RECHECK_SECONDS = 900  # a plain test run of a mutant that takes longer hangs
STATUS = re.compile(r"^\s*(ember\.[\w.]+?)\.x[_ǁ]\S*__mutmut_\d+: (.+)$")  # module, status


def _config(modules: list[str], tests: list[str]) -> str:
    listed = ", ".join(json.dumps(m) for m in modules)
    selection = ", ".join(json.dumps(t) for t in tests + LEFT_OUT)
    return (f"[tool.mutmut]\nsource_paths = [\"ember/\"]\nonly_mutate = [{listed}]\n"
            f"also_copy = [\"benchmarks/\", \"examples/\", \"README.md\", \"setup.py\"]\n"
            f"pytest_add_cli_args_test_selection = [{selection}]\ntimeout_multiplier = 2.0\ntimeout_constant = 5.0\n")


def _leave_gc_callbacks(work: Path) -> None:
    """Mark each of GC_CALLBACKS in the copy ``work`` for mutmut to leave alone."""
    for name, lines in GC_CALLBACKS.items():
        path = work / name
        source = path.read_text().split("\n")
        for line in lines:
            if source.count(line) != 1:
                raise SystemExit(f"{name}: the garbage collector's callback {line.strip()!r} is not there once: "
                                 "update GC_CALLBACKS")
            source[source.index(line)] = line + "  # pragma: no mutate block"
        path.write_text("\n".join(source))


def run_group(checkout: Path, modules: list[str], tests: list[str], children: int, names: list[str] = ()) -> dict:
    """Mutate ``modules`` of ``checkout`` judged by ``tests``; {module: Counter of statuses}, survivors.
    With ``names`` (fnmatch patterns of mutant names), only those mutants are judged and counted."""
    with tempfile.TemporaryDirectory(prefix="ember-mutation-") as scratch:
        work = Path(scratch) / "checkout"
        shutil.copytree(checkout, work, ignore=LEFT_BEHIND)
        pyproject = (work / "pyproject.toml").read_text()
        pyproject = re.sub(r"\n\[tool\.mutmut\]\n.*?(?=\n\[|\Z)", "\n", pyproject, flags=re.S)
        (work / "pyproject.toml").write_text(pyproject + "\n" + _config(modules, tests))
        _leave_gc_callbacks(work)
        mutmut = [sys.executable, "-m", "mutmut"]
        # fewer hypothesis examples per generated test: a mutant reruns its tests, and a bug in a rule or
        # a codec shows on the first examples (the test suite's own runs keep 25)
        # and nothing that cannot fork: mutmut forks a child per mutant from a parent whose torch has started
        # libgomp's thread team and whose JAX has started XLA's threads, and a forked child then waits forever
        # for threads it does not have (a hang that mutmut reports as a timeout, counted as caught). So torch
        # gets one OpenMP thread and the jax device's tests are left out; --recheck runs them, without a fork.
        env = {"EMBER_EXAMPLES": "5", **os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
               "PYTEST_ADDOPTS": " ".join(filter(None, [os.environ.get("PYTEST_ADDOPTS"), "-k 'not jax'"]))}
        ran = subprocess.run([*mutmut, "run", "--max-children", str(children), *names], cwd=work, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        listing = subprocess.run([*mutmut, "results", "--all", "true"], cwd=work, env=env,
                                 capture_output=True, text=True).stdout
        if ran.returncode != 0 and (not listing.strip() or all(STATUS.match(line) is None or "not checked" in line
                                                               for line in listing.splitlines())):
            output = "\n".join(line for line in ran.stdout.replace("\r", "\n").splitlines() if "Running" not in line)
            raise SystemExit(f"mutmut failed:\n{output[-3000:]}")
        counts: dict = collections.defaultdict(collections.Counter)
        # name -> diff; a timeout counts as caught, but on a loaded machine a surviving mutant can time out too,
        # so --recheck judges timeouts again as well
        kept = {"survived": {}, "no tests": {}, "timeout": {}}
        for line in listing.splitlines():
            match = STATUS.match(line)
            if match and names and not any(fnmatch.fnmatch(line.strip().rsplit(":", 1)[0], n) for n in names):
                continue
            if match:
                status = match.group(2).strip()
                counts[match.group(1)][status] += 1
                if status in kept:
                    name = line.strip().rsplit(":", 1)[0]
                    kept[status][name] = subprocess.run([*mutmut, "show", name], cwd=work, env=env,
                                                        capture_output=True, text=True).stdout
    return {"counts": {m: dict(c) for m, c in counts.items()}, "survivors": kept["survived"],
            "untested": kept["no tests"], "timeouts": kept["timeout"]}


def apply_hunk(source: str, hunk: list[str]) -> str | None:
    """``source`` with one hunk of ``mutmut show``'s diff applied, or None if its lines are not found
    exactly once. mutmut shows a method dedented as if it were a function, but leaves continuation
    lines as they were, so lines are matched without their indentation and each new line takes the
    indentation of the source line it replaces (plus any change the diff makes to it)."""
    old = [line[1:] for line in hunk if not line.startswith("+")]
    lines = source.split("\n")
    key = [line.strip() for line in old]
    starts = [i for i in range(len(lines) - len(old) + 1) if [x.strip() for x in lines[i:i + len(old)]] == key]
    if len(starts) != 1:
        return None
    start, at, shift, out = starts[0], starts[0], 0, []

    def indent(text: str) -> int:
        return len(text) - len(text.lstrip())
    for line in hunk:
        text = line[1:]
        if line.startswith("+"):
            out.append(" " * max(indent(text) + shift, 0) + text.lstrip() if text.strip() else "")
            continue
        shift = indent(lines[at]) - indent(text)  # how far the source line sits from the line as shown
        if not line.startswith("-"):
            out.append(lines[at])
        at += 1
    return "\n".join(lines[:start] + out + lines[at:])


def recheck(checkout: Path, survivors: dict, tests: list[str], seconds: float = None) -> dict:
    """Judge survivors again without mutmut: patch each one's diff (as ``mutmut show`` prints it)
    into a plain copy of the checkout and run ``tests``; {mutant: killed | survived | not applied}."""
    verdicts = {}
    with tempfile.TemporaryDirectory(prefix="ember-recheck-") as scratch:
        work = Path(scratch) / "checkout"
        shutil.copytree(checkout, work, ignore=LEFT_BEHIND)
        env = {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}
        found = subprocess.run([sys.executable, "-c", "import ember; print(ember.__file__)"], cwd=work, env=env,
                               capture_output=True, text=True).stdout
        if not found.startswith(str(work)):  # an installed ember would be judged instead of the patched one
            raise SystemExit(f"recheck: the tests would import {found.strip()}, not the patched copy")
        for name, diff in survivors.items():
            lines = diff.splitlines()
            if not any(line.startswith("--- ") for line in lines):  # mutmut could not show it
                verdicts[name] = "not applied"
                print(f"{verdicts[name]:<12}{name}", flush=True)
                continue
            path = work / next(line[4:] for line in lines if line.startswith("--- "))
            hunk = lines[next(i for i, line in enumerate(lines) if line.startswith("@@")) + 1:]
            source = path.read_text()
            patched = apply_hunk(source, hunk)
            if patched is None:
                verdicts[name] = "not applied"
                print(f"{verdicts[name]:<12}{name}", flush=True)
                continue
            path.write_text(patched)
            try:
                ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                                     cwd=work, env=env, capture_output=True, text=True, timeout=seconds or RECHECK_SECONDS)
                verdicts[name] = "survived" if ran.returncode == 0 else "killed"
                # the test that caught it, so a kill can be checked (a test that fails under load is no kill)
                caught_by = next((line.split()[1] for line in ran.stdout.splitlines() if line.startswith("FAILED ")), "")
            except subprocess.TimeoutExpired:  # a hang the tests would also hit: caught
                verdicts[name], caught_by = "timeout", ""
            finally:
                path.write_text(source)
            print(f"{verdicts[name]:<12}{name}  {caught_by}", flush=True)  # as it goes: a recheck takes a while
    return verdicts


def kill_rate(counts: dict) -> float:
    """Killed (a failing test or a timeout) over mutants that some test ran."""
    caught = counts.get("killed", 0) + counts.get("timeout", 0)
    judged = caught + counts.get("survived", 0)
    return caught / judged if judged else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", metavar="GROUP", help=f"groups to run (default: all): {', '.join(GROUPS)}")
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--modules", nargs="+", help="mutate these files or globs instead of a group's")
    parser.add_argument("--tests", nargs="+", help="with --modules: the test files that judge them")
    parser.add_argument("--children", type=int, default=os.cpu_count() or 2, help="mutants judged at once")
    parser.add_argument("--json", metavar="FILE", help="also write the figures and survivors (with --recheck: the "
                        "verdicts) as JSON")
    parser.add_argument("--recheck", metavar="FILE", help="judge the survivors, untested and timed-out mutants in FILE (a --json "
                        "report) again without mutmut, by the tests that cannot run under it (or --tests); --only picks some")
    parser.add_argument("--names", nargs="+", default=[], metavar="PATTERN",
                        help="judge only the mutants whose names match these fnmatch patterns (the functions changed "
                             "since a group's last run, say: 'ember.ops.nn.x__gelu*')")
    parser.add_argument("--only", metavar="TEXT", default="", help="with --recheck: survivors whose name contains TEXT")
    parser.add_argument("--seconds", type=float, help=f"with --recheck: a test run longer than this is a hang, caught as a "
                        f"timeout (default {RECHECK_SECONDS}; several times the tests' own time)")
    args = parser.parse_args(argv)
    if args.recheck:
        report = json.loads(Path(args.recheck).read_text())
        survivors = {name: diff for group in report.values()
                     for name, diff in [*group["survivors"].items(), *group.get("untested", {}).items(),
                                        *group.get("timeouts", {}).items()] if args.only in name}
        names = sorted(survivors)
        shares = [{name: survivors[name] for name in names[k::args.children]} for k in range(args.children)]
        tests = args.tests or TRAMPOLINE_SHY
        with concurrent.futures.ThreadPoolExecutor(args.children) as pool:  # a copy of the checkout each
            judged = pool.map(lambda share: recheck(args.checkout, share, tests, args.seconds), shares)
            verdicts = {name: verdict for share in judged for name, verdict in share.items()}
        print(collections.Counter(verdicts.values()))
        if args.json:
            Path(args.json).write_text(json.dumps(verdicts, indent=1))
        return 0
    if args.modules:
        jobs = {"ad hoc": (args.modules, args.tests or ["tests/"])}
    else:
        unknown = [g for g in args.groups if g not in GROUPS]
        if unknown:
            parser.error(f"unknown group {unknown[0]!r}; choose from {', '.join(GROUPS)}")
        jobs = {g: GROUPS[g] for g in args.groups or GROUPS}
    report = {}
    for name, (modules, tests) in jobs.items():
        start = time.monotonic()
        print(f"mutating {name}: {', '.join(modules)} (judged by {', '.join(tests)}) …", file=sys.stderr, flush=True)
        report[name] = run_group(args.checkout, modules, tests, args.children, args.names)
        report[name]["seconds"] = round(time.monotonic() - start)
    print(f"{'module':<32}{'mutants':>8}{'killed':>8}{'timeout':>8}{'survived':>9}{'untested':>9}{'kill rate':>10}")
    for result in report.values():
        for module, counts in sorted(result["counts"].items()):
            total = sum(counts.values())
            print(f"{module:<32}{total:>8}{counts.get('killed', 0):>8}{counts.get('timeout', 0):>8}"
                  f"{counts.get('survived', 0):>9}{counts.get('no tests', 0):>9}{kill_rate(counts):>10.1%}")
    for result in report.values():
        for survivor in result["survivors"]:
            print(f"survived  {survivor}")
    if args.json:  # with each survivor's diff
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
