import os

# a client waits for a silent peer up to EMBER_TIMEOUT (600 s by default); in tests a hang should fail in a minute
os.environ.setdefault("EMBER_TIMEOUT", "60")
# a Ray cluster the tests start runs on 127.0.0.1 only, its node address included (Ray's own switch
# for one-machine clusters, read when ray is imported); off by default on Linux
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

settings.register_profile("ember", max_examples=int(os.environ.get("EMBER_EXAMPLES", "25")), deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])
settings.load_profile("ember")


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


LOCAL_DEVICES = ["numpy"] + (["torch:cpu"] if torch_available() else [])


@pytest.fixture(scope="session")
def peer():
    """One numpy compute peer shared by the session's remote tests."""
    from .peers import Peer
    with Peer("--device", "numpy") as running:
        yield running


REMOTE_SCHEMES = ["ember", "ws"]
