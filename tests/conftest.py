import os

# a client waits for a silent peer up to EMBER_TIMEOUT (600 s by default); in tests a hang should fail in a minute
os.environ.setdefault("EMBER_TIMEOUT", "60")
# a client dials a lost peer again for EMBER_RESUME seconds (300 by default); in tests a peer that is gone is found
# gone in two (the resume tests set their own)
os.environ.setdefault("EMBER_RESUME", "2")
# a Ray cluster the tests start runs on 127.0.0.1 only, its node address included (Ray's own switch
# for one-machine clusters, read when ray is imported); off by default on Linux
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import functools  # noqa: E402
import inspect  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

settings.register_profile("ember", max_examples=int(os.environ.get("EMBER_EXAMPLES", "25")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])
settings.load_profile("ember")

# hypothesis's pytest plugin (6.170) gives each parametrized call of a test new settings whose parent is the settings
# the previous call left on the function, so a test with a thousand parametrizations (the bad-input cases times three
# devices) reads its database through a chain a thousand settings deep, one Python frame a link: beyond Python's
# default recursion limit of 1000, which CI (CI=1: hypothesis's ci profile) reached
sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def assert_takes_pytorchs_subgradient(ember_function, torch_function, point) -> None:
    """d sum(f(x)) / dx at ``point`` by ember's autodiff equals PyTorch's (float64, rtol 1e-12): the reference where
    finite differences cannot judge (kinks, ties, 0/0)."""
    import numpy as np
    import torch

    import ember as em
    x = em.asarray(point, device=em.autodiff("numpy")).requires_grad_()
    t = torch.tensor(point, dtype=torch.float64, requires_grad=True)
    em.sum(ember_function(x)).backward()
    torch.sum(torch_function(t)).backward()
    np.testing.assert_allclose(em.asnumpy(x.grad), t.grad.numpy(), rtol=1e-12, atol=1e-15)


def jax_available() -> bool:
    try:
        import jax  # noqa: F401
    except ImportError:
        return False
    return True


LOCAL_DEVICES = ["numpy"] + (["torch:cpu"] if torch_available() else []) + (["jax:cpu"] if jax_available() else [])


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A throwaway CA and certificates for 127.0.0.1 (tests/pki.py), shared by the session's TLS peers."""
    from .pki import make_pki
    return make_pki(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def peer():
    """One numpy compute peer shared by the session's remote tests."""
    from .peers import Peer
    with Peer("--device", "numpy") as running:
        yield running


REMOTE_SCHEMES = ["ember", "ws"]


def too_large(size: int, limit: int) -> str:
    """How websockets words a message past its size limit: from 14 on, then 13 (pyproject allows 13)."""
    return rf"(frame with {size} bytes exceeds limit of {limit} bytes|over size limit \({size} > {limit} bytes\))"


# JAX compiles each op anew for each shape and dtype it meets (~40 ms each): a jax device draws fewer examples
JAX_EXAMPLES = int(os.environ.get("EMBER_JAX_EXAMPLES", "2"))


def given_data_per_device(test):
    """``@given(data=st.data())`` for a test parametrized by ``device_name``, drawing JAX_EXAMPLES
    examples on a jax device and the profile's count elsewhere."""
    @functools.wraps(test)
    def run(*args, device_name, **kwargs):
        def example(data):
            test(*args, device_name=device_name, data=data, **kwargs)
        example.__qualname__ = f"{test.__qualname__}[{device_name}]"  # its own entry in hypothesis's database
        check = given(data=st.data())(example)
        if device_name.startswith("jax"):
            check = settings(max_examples=JAX_EXAMPLES)(check)
        check()
    signature = inspect.signature(test)
    run.__signature__ = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "data"])
    return run
