"""The array object: operators, in-place operators, scalars, conversions, devices and DLPack."""

from __future__ import annotations

import numpy as np
import pytest

import ember as em

from .conftest import LOCAL_DEVICES, torch_available

needs_torch = pytest.mark.skipif(not torch_available(), reason="torch is not installed")


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_operators_match_numpy(device_name):
    a_host = np.array([[1.5, -2.0], [3.0, 4.25]])
    b_host = np.array([0.5, 3.0])
    a, b = em.asarray(a_host, device=device_name), em.asarray(b_host, device=device_name)
    cases = {
        "+": (a + b, a_host + b_host), "-": (a - b, a_host - b_host), "*": (a * b, a_host * b_host),
        "/": (a / b, a_host / b_host), "//": (a // b, a_host // b_host), "%": (a % b, a_host % b_host),
        "**": (a ** 2, a_host ** 2), "@": (a @ a, a_host @ a_host), "neg": (-a, -a_host), "abs": (abs(a), abs(a_host)),
        "r+": (1 + a, 1 + a_host), "r-": (1 - a, 1 - a_host), "r/": (1 / a, 1 / a_host), "r**": (2 ** a, 2 ** a_host),
        "<": (a < b, a_host < b_host), "==": (a == 3.0, a_host == 3.0), "!=": (a != b, a_host != b_host),
    }
    for name, (result, expected) in cases.items():
        assert result.device == em.device(device_name)
        np.testing.assert_allclose(em.asnumpy(result), expected, err_msg=name)
        assert result.dtype == em.bool or result.dtype == em.float64, name
    ints = em.asarray([5, 3], device=device_name)
    np.testing.assert_array_equal(em.asnumpy(ints & 1), [1, 1])
    np.testing.assert_array_equal(em.asnumpy(ints << 2), [20, 12])
    np.testing.assert_array_equal(em.asnumpy(~ints), [-6, -4])


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_python_scalars_follow_the_standard(device_name):
    f32 = em.ones(3, dtype=em.float32, device=device_name)
    i8 = em.ones(3, dtype=em.int8, device=device_name)
    assert (f32 * 2.5).dtype == em.float32        # a scalar never widens an array of its kind
    assert (i8 + 3).dtype == em.int8
    assert (i8 * 0.5).dtype == em.float64         # a float scalar lifts an int array (NumPy's rule)
    assert (f32 * 1j).dtype == em.complex64
    assert em.sqrt(em.arange(4, device=device_name)).dtype == em.float64
    assert (em.arange(4, device=device_name) / 2).dtype == em.float64
    with pytest.raises(OverflowError, match="1000 out of bounds for int8"):
        i8 + 1000
    with pytest.raises(TypeError, match="bitwise_and"):
        f32 & 1


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_scalar_literals_kept_converted_give_the_results_of_python_scalars(device_name, monkeypatch):
    from ember.engines import local
    host = np.array([1.5, -2.0, 0.0], dtype=np.float32)
    x = em.asarray(host, device=device_name)
    engine = x.device.engine
    engine._literals.clear()
    for scalar in (1.0001, 1.0001, 3, -0.0, 0.0, -0.0, float("nan"), float("inf"), 1e300, 2 ** 40):
        for result, expected in ((x * scalar, host * scalar), (scalar - x, scalar - host), (x / scalar, host / scalar)):
            got = em.asnumpy(result)
            assert got.dtype == np.float32
            # bit for bit, the sign of a zero included (0.0 and -0.0 are one key in a dict)
            np.testing.assert_array_equal(np.signbit(got), np.signbit(expected), err_msg=repr(scalar))
            np.testing.assert_array_equal(got, expected, err_msg=repr(scalar))
    kept = {value for value, _ in engine._literals}
    assert kept == {1.0001, 3, float("inf"), 1e300, 2 ** 40}  # never a zero or a NaN
    if device_name == "numpy":  # NumPy's kernels take a 0-d array: read-only, since every call shares it
        literal = engine.literal(1.0001, em.float32)
        assert literal is engine.literal(1.0001, em.float32) and literal.dtype == np.float32
        assert not literal.flags.writeable
        assert engine.literal(1e300, em.float32) == 1e300  # float32 cannot hold it: the kernel judges, as before
    monkeypatch.setattr(local, "LITERALS_KEPT", len(engine._literals) + 2)
    for step in range(10):  # a loop's changing scalars: kept up to the bound, right beyond it
        np.testing.assert_array_equal(em.asnumpy(x + (step + 0.5)), host + np.float32(step + 0.5))
    assert len(engine._literals) == local.LITERALS_KEPT
    assert x.__mul__(object()) is NotImplemented and x.__mul__(np.float32(2)) is NotImplemented
    with pytest.raises(TypeError, match="unsupported operand"):
        x * object()


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_in_place_operators_keep_identity_dtype_and_shape(device_name):
    x = em.asarray([1.0, 2.0], device=device_name)
    alias = x
    x += 1
    x *= em.asarray([2.0, 3.0], device=device_name)
    assert x is alias
    np.testing.assert_array_equal(em.asnumpy(x), [4.0, 9.0])
    i = em.asarray([1, 2], device=device_name)
    with pytest.raises(TypeError, match="in-place operations keep the dtype"):
        i /= 2
    with pytest.raises(ValueError, match="in-place operations keep the shape"):
        x += em.ones((2, 2), device=device_name)
    np.testing.assert_array_equal(em.asnumpy(x), [4.0, 9.0])  # nothing changed by the failures


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_conversions(device_name):
    x = em.asarray([[2.5]], device=device_name)
    assert float(x) == 2.5 and int(em.asarray(7, device=device_name)) == 7 and bool(x > 1)
    assert complex(x) == 2.5 + 0j
    assert [0, 1, 2][em.asarray(2, device=device_name)] == 2  # __index__
    with pytest.raises(TypeError, match="only arrays of one element"):
        float(em.ones(3, device=device_name))
    with pytest.raises(TypeError, match="only integer arrays"):
        [0, 1][em.asarray(1.0, device=device_name)]
    assert len(em.ones((4, 2), device=device_name)) == 4
    assert [float(v) for v in em.asarray([1.0, 2.0], device=device_name)] == [1.0, 2.0]
    np.testing.assert_array_equal(np.asarray(em.asarray([1, 2], device=device_name)), [1, 2])
    assert "ember.Array(" in repr(x) and device_name in repr(x)


@needs_torch
def test_mixing_devices_names_both():
    a, b = em.ones(2, device="numpy"), em.ones(2, device="torch:cpu")
    with pytest.raises(ValueError, match="add: arrays are on different devices, numpy and torch:cpu"):
        a + b
    with pytest.raises(em.DeviceError):
        em.matmul(a, b)
    np.testing.assert_array_equal(em.asnumpy(a + b.to_device("numpy")), [2.0, 2.0])
    np.testing.assert_array_equal(em.asnumpy(b + 1.5), [2.5, 2.5])  # Python scalars mix with any device


def test_to_device_of_the_same_hardware_but_another_kind_moves():
    """Devices compare by hardware, but ``to_device`` lands on the very device asked for: an
    array moved onto an autodiff device is tracked there, not returned untracked."""
    x = em.asarray([1.0, 2.0])
    assert x.to_device(x.device) is x and x.to_device("numpy") is x
    tracked = em.autodiff("numpy")
    y = x.to_device(tracked)
    assert y.device is tracked and y.device == x.device
    y.requires_grad_()
    em.sum(y * y).backward()
    np.testing.assert_array_equal(em.asnumpy(y.grad), [2.0, 4.0])
    assert x.device is em.device("numpy") and not x.requires_grad


@needs_torch
def test_dlpack_round_trips():
    import torch
    host = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = em.from_dlpack(host)                                  # numpy -> ember(numpy), zero-copy
    assert x.device == em.device("numpy") and np.shares_memory(em.asnumpy(x), host)
    t = torch.from_dlpack(x)                                  # ember(numpy) -> torch
    assert t.shape == (2, 3) and float(t.sum()) == 15.0
    y = em.from_dlpack(torch.arange(4.0), device="torch:cpu")  # torch -> ember(torch)
    assert y.device == em.device("torch:cpu") and y.dtype == em.float32
    back = np.from_dlpack(y)                                  # ember(torch) -> numpy
    np.testing.assert_array_equal(back, [0.0, 1.0, 2.0, 3.0])
    z = em.from_dlpack(torch.ones(2, dtype=torch.int64))      # torch -> ember(numpy)
    assert z.device == em.device("numpy") and z.dtype == em.int64
    assert x.__dlpack_device__()[0] == 1                      # kDLCPU
    w = em.asarray(torch.tensor([1.5, 2.5]))                  # asarray takes DLPack objects too
    np.testing.assert_array_equal(em.asnumpy(w), [1.5, 2.5])


@needs_torch
def test_to_device_moves_between_backends():
    x = em.asarray([1, 2, 3], dtype=em.int16)
    t = x.to_device("torch:cpu")
    assert t.device == em.device("torch:cpu") and t.dtype == em.int16 and t.shape == (3,)
    back = em.asarray(t * 2, device="numpy")
    np.testing.assert_array_equal(em.asnumpy(back), [2, 4, 6])
    with pytest.raises(NotImplementedError, match="uint32"):
        em.ones(2, dtype=em.uint32, device="torch:cpu")


@needs_torch
@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_torch_holds_wide_unsigned_arrays_without_computing_on_them(dtype):
    """PyTorch stores uint16/32/64 but has no arithmetic on them: torch:cpu takes such an array (a move, DLPack),
    casts it with astype and gives it back, and refuses any op on it by name before a kernel fails."""
    kind = getattr(em, dtype)
    values = [0, 7, np.iinfo(dtype).max]
    x = em.asarray(np.array(values, dtype=dtype))
    for t in (x.to_device("torch:cpu"), em.from_dlpack(x, device="torch:cpu")):
        assert t.device == em.device("torch:cpu") and t.dtype == kind
        assert em.asnumpy(t).tolist() == values and em.asnumpy(t).dtype == dtype
        assert em.asnumpy(em.astype(t, em.float64)).tolist() == [float(v) for v in values]
        assert em.astype(em.astype(t, em.int8), kind).dtype == kind  # astype both ways
        with pytest.raises(em.NotSupportedError, match=f"^add: torch:cpu computes nothing on {dtype}; convert it first"):
            t + t
        with pytest.raises(em.NotSupportedError, match=f"^sum: torch:cpu computes nothing on {dtype}"):
            em.sum(t)
        assert em.asnumpy(x).tolist() == values  # the source is untouched
    assert kind not in em.__array_namespace_info__().dtypes(device=em.device("torch:cpu")).values()


def test_devices_parse_and_compare():
    assert em.device("numpy") is em.device("numpy") and str(em.device("numpy")) == "numpy"
    assert em.device("torch") == em.device("torch:cpu") and em.device("torch:cuda") == em.device("torch:cuda:0")
    remote = em.device("ember://secret@gpu-box:7878/1")
    assert str(remote) == "ember://gpu-box:7878/1" and "secret" not in repr(remote)
    assert remote == em.device("ws://gpu-box:7878/1")  # one peer's device, whichever transport
    for bad in ("nump", "torch:tpu", "ember://host:7878/x", "http://host/0"):
        with pytest.raises(em.DeviceError):
            em.device(bad)
    local = em.device("numpy")  # a local engine sits in a slot once made: one engine, and no other name made up
    assert local.engine is local.engine is local._engine and local.literal == local.engine.literal
    with pytest.raises(AttributeError, match="'LocalDevice' object has no attribute 'engin'"):
        _ = local.engin


def test_default_device_follows_the_environment(monkeypatch):
    monkeypatch.setenv("EMBER_DEVICE", "numpy")
    assert em.ones(1).device == em.device("numpy")
    if torch_available():
        monkeypatch.setenv("EMBER_DEVICE", "torch:cpu")
        assert em.ones(1).device == em.device("torch:cpu")
        assert em.__array_namespace_info__().default_device() == em.device("torch:cpu")


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_the_2025_12_additions(device_name):
    """What the standard's 2025.12 revision added beyond new rows: scalar operands of isin and searchsorted,
    broadcast_shapes, tuples from broadcast_arrays, meshgrid and devices(), and the version itself."""
    x = em.asarray([1, 3, 5, 7], device=device_name)
    assert em.asnumpy(em.isin(x, 5)).tolist() == [False, False, True, False]
    assert bool(em.isin(3, x)) and not bool(em.isin(4, x)) and em.isin(4, x).shape == ()
    assert em.asnumpy(em.isin(x, 5, invert=True)).tolist() == [True, True, False, True]
    assert int(em.searchsorted(x, 4)) == 2 and int(em.searchsorted(x, 5, side="right")) == 3
    assert em.searchsorted(x, 4.5).dtype == em.int64
    assert em.broadcast_shapes((2, 1), (3,), ()) == (2, 3) and em.broadcast_shapes() == ()
    with pytest.raises(em.ShapeError, match=r"broadcast_shapes: shapes \(2,\) and \(3,\)"):
        em.broadcast_shapes((2,), (3,))
    assert type(em.broadcast_arrays(x, em.asarray(1, device=device_name))) is tuple
    assert type(em.meshgrid(x, x)) is tuple and type(em.__array_namespace_info__().devices()) is tuple
    assert em.expand_dims(x, axis=(0, -1)).shape == (1, 4, 1)
    assert em.permute_dims(em.ones((2, 3), device=device_name), (-1, 0)).shape == (3, 2)
    assert x.__array_namespace__() is em and x.__array_namespace__(api_version="2025.12") is em
    assert em.__array_api_version__ == "2025.12"
