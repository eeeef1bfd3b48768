"""A pytest plugin that counts the tests needing a live peer: a test does when a peer process
(``ember.remote.spawn.PeerProcess``) or an in-process ``ember.Server`` starts during its call or
during the setup of a fixture it uses (a module- or session-scoped fixture counts for every test
that uses it, wherever it was first set up).

    PYTHONPATH=tools python -m pytest -q -p peer_census [FILES]

prints, at the end, how many of the tests run needed a peer process, how many an in-process
server only, and how many neither, with the counts per test file (``--census FILE`` writes them
as JSON too).
"""
from __future__ import annotations

import collections
import json

import pytest

_context: list = []            # what is running now: a fixture's name, or None for a test's call
_fixtures: dict[int, set] = collections.defaultdict(set)  # id of a fixture's definition -> {"process", "server"}
_tests: dict[str, set] = collections.defaultdict(set)     # test id -> what its call started
_closures: dict[str, tuple] = {}  # test id -> ids of the definitions of the fixtures it uses


def _started(kind: str):
    def note(*args, **kwargs):
        if _context and _context[-1] is not None:
            _fixtures[_context[-1]].add(kind)
        elif _context:
            _tests[_current[0]].add(kind)
    return note


_current = [""]


def pytest_addoption(parser):
    parser.addoption("--census", default=None, help="write the peer census as JSON to this file")


def pytest_configure(config):
    import ember.remote.server as server
    import ember.remote.spawn as spawn

    for owner, name, kind in ((spawn.PeerProcess, "__init__", "process"), (server.Server, "start", "server")):
        original, note = getattr(owner, name), _started(kind)

        def wrapped(*args, _original=original, _note=note, **kwargs):
            _note()
            return _original(*args, **kwargs)
        setattr(owner, name, wrapped)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    _context.append(id(fixturedef))
    try:
        yield
    finally:
        _context.pop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current[0] = item.nodeid
    _closures[item.nodeid] = tuple(id(d) for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)
    _context.append(None)
    try:
        yield
    finally:
        _context.pop()


def pytest_terminal_summary(terminalreporter, config):
    per_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for nodeid, fixtures in _closures.items():
        kinds = set(_tests.get(nodeid, ()))
        for fixture in fixtures:
            kinds |= _fixtures.get(fixture, set())
        kind = "process" if "process" in kinds else "server" if kinds else "neither"
        per_file[nodeid.split("::")[0]][kind] += 1
        totals[kind] += 1
    write = terminalreporter.write_line
    write(f"peer census: {sum(totals.values())} tests; a peer process {totals['process']}, "
          f"an in-process server only {totals['server']}, neither {totals['neither']}")
    for path, counts in sorted(per_file.items(), key=lambda kv: -kv[1]["process"]):
        if counts["process"] or counts["server"]:
            write(f"  {path}: process {counts['process']}, server {counts['server']}, neither {counts['neither']}")
    if config.getoption("census"):
        with open(config.getoption("census"), "w") as f:
            json.dump({"totals": totals, "files": per_file}, f, indent=1)
