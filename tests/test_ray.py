"""Fleets on Ray: ``ember.ray.launch`` starts real peers as actors of a real local Ray cluster (on
127.0.0.1: conftest keeps Ray on loopback), the devices it returns compute, move arrays peer to
peer and lose their arrays with their actor; ``ember devices ray://auto`` lists a fleet without
its tokens; ``shutdown`` leaves no peer behind. Skipped only where Ray is not installed."""

from __future__ import annotations

import importlib.util
import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ember as em
import ember.ray as fleets

from .test_remote import nothing_listens

DEADLINE = 30  # seconds for a killed actor's process to end


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    context = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    assert context.address_info["node_ip_address"] == "127.0.0.1"  # the peers listen on their node's address
    yield context.address_info["gcs_address"]
    fleets.shutdown()
    ray.shutdown()


@pytest.fixture
def fleet(cluster):
    devices = fleets.launch(2)
    yield devices
    fleets.shutdown()


def _actor(peer: fleets.Peer):
    import ray
    return ray.get_actor(peer.name, namespace=fleets.NAMESPACE)


def _ended(pid: int) -> bool:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _port(peer: fleets.Peer) -> int:
    return int(peer.url.rsplit(":", 1)[1])


def test_each_peer_computes_and_an_array_moves_peer_to_peer(fleet):
    a, b = fleet
    assert [str(d).startswith("ember://127.0.0.1:") and str(d).endswith("/0") for d in (a, b)] == [True, True]
    assert a != b and a.token and b.token and a.token != b.token  # a token each, attached: the user passes none
    assert a.token not in str(a) and a.token not in repr(fleet)
    x = em.asarray(np.arange(6.0).reshape(2, 3), device=a)
    np.testing.assert_allclose(em.asnumpy(em.sum(x * x, axis=1)), [5.0, 50.0])
    np.testing.assert_allclose(em.asnumpy(em.ones(3, device=b) * 7), [7.0, 7.0, 7.0])
    before = em.stats(a)["bytes_down"]
    y = (x * 2).to_device(b) + 1  # the direct transfer: b fetches from a
    assert y.device == b
    np.testing.assert_allclose(em.asnumpy(y), np.arange(6.0).reshape(2, 3) * 2 + 1)
    assert em.stats(a)["bytes_down"] == before  # not one byte of x came back through the client
    listed = fleets.peers()
    assert [p.devices for p in listed] == [("numpy",), ("numpy",)]
    assert sorted(f"{p.url}/0" for p in listed) == sorted(str(d) for d in fleet)


def test_the_cli_lists_the_fleet_and_no_token(fleet, cluster):
    run = subprocess.run([sys.executable, "-m", "ember.cli", "devices", "ray://auto"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RAY_ADDRESS": cluster})
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2
    for d in fleet:
        assert any(line.startswith(f"{d}    numpy    ember-") for line in lines), run.stdout
        assert d.token not in run.stdout + run.stderr


def test_a_killed_actor_fails_its_arrays_at_the_read_and_the_other_peer_computes(fleet):
    import ray
    a, b = fleet
    x = em.asarray(np.arange(4.0), device=a) + 1  # pending: it leaves at the read
    y = em.asarray(np.arange(4.0), device=b)
    (victim,) = [p for p in fleets.peers() if str(a).startswith(p.url)]
    ray.kill(_actor(victim))
    assert _ended(victim.pid) and nothing_listens(_port(victim))
    with pytest.raises(em.ConnectionLost):
        em.asnumpy(x)
    np.testing.assert_allclose(em.asnumpy(y * 2), [0.0, 2.0, 4.0, 6.0])
    assert [f"{p.url}/0" for p in fleets.peers()] == [str(b)]


def test_shutdown_leaves_no_peer_behind(cluster):
    devices = fleets.launch(2)
    x = em.ones(3, device=devices[0])
    em.sync(devices[0])
    running = fleets.peers()
    assert len(running) == 2
    fleets.shutdown()
    assert fleets.peers() == []  # no ember actor left on the cluster
    assert all(_ended(p.pid) for p in running) and all(nothing_listens(_port(p)) for p in running)
    with pytest.raises(em.ConnectionLost):
        em.asnumpy(x)
    fleets.shutdown()  # nothing left to stop: a no-op


def test_the_peers_end_with_the_program_that_launched_them(cluster):
    script = ("import sys, ember.ray\n"
              "ember.ray.launch(1)  # RAY_ADDRESS: it joins the test's cluster\n"
              "print(ember.ray.peers()[0].pid, flush=True)\n"
              "sys.stdin.read()\n")
    driver = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "RAY_ADDRESS": cluster})
    try:
        assert select.select([driver.stdout], [], [], 120)[0], "the driver did not launch its peer in 2 minutes"
        pid = int(driver.stdout.readline())
    finally:
        driver.kill()  # as a crash would: no shutdown() runs
        driver.wait(30)
        driver.stdout.close()
        driver.stdin.close()
    assert _ended(pid)
    assert fleets.peers() == []


def test_tls_fleet_moves_between_peers_that_trust_the_ca(cluster, pki):  # noqa: F811
    a, b = fleets.launch(2, tls_cert=pki.local.cert, tls_key=pki.local.key, tls_ca=pki.ca)
    try:
        assert str(a).startswith("embers://127.0.0.1:") and str(b).startswith("embers://127.0.0.1:")
        x = em.asarray(np.arange(3.0), device=a)
        np.testing.assert_allclose(em.asnumpy(x.to_device(b) * 2), [0.0, 2.0, 4.0])  # b checks a's certificate
    finally:
        fleets.shutdown()


def test_launch_refuses_what_it_cannot_serve_and_leaves_nothing(cluster):
    with pytest.raises(em.HostDeviceError, match=r"ember.ray.launch: peer 0 on node 127.0.0.1: cannot host .* capture"):
        fleets.launch(1, device="capture")
    with pytest.raises(em.ArgumentError, match=r"placed 0 of 1 peers within 1 s, each asking for .*'num_gpus': 1"):
        fleets.launch(1, resources={"num_gpus": 1}, timeout=1)
    with pytest.raises(em.ArgumentError, match="token= is not an option"):
        fleets.launch(1, token="mine")
    with pytest.raises(em.ArgumentError, match="a whole number ≥ 1"):
        fleets.launch(0)
    assert fleets.peers() == []


def test_import_ember_leaves_ray_out_and_a_missing_ray_says_what_to_install():
    script = ("import sys, ember, ember.cli, ember.ray\n"
              "print('ray' in sys.modules)\n"
              "sys.modules['ray'] = None  # as if Ray were not installed\n"
              "try:\n    ember.ray.launch(1)\nexcept ImportError as error:\n    print(error)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines() == ["False", "ember.ray needs Ray, which is not installed: pip install 'ember[ray]'"], \
        run.stderr


def test_the_data_parallel_example_trains_on_a_ray_fleet(cluster, capsys):
    """examples/data_parallel.py --ray 2: the batch split over two Ray-launched peers, gradients all-reduced peer to
    peer, on the single-device loss curve; the fleet stops at the end."""
    spec = importlib.util.spec_from_file_location("data_parallel", Path(__file__).parent.parent / "examples" / "data_parallel.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--ray", "2", "--steps", "5", "--log-every", "1", "--check"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("data parallel over 2 peers: ember://127.0.0.1:") and "@" not in printed  # no token shown
    difference = float(printed.rsplit("largest difference from one device: ", 1)[1])
    assert difference < 1e-6 and printed.count("loss ") == 5
    assert fleets.peers() == []
