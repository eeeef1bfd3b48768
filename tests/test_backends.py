"""The generic kernel table and how each backend specialises it (backends/generic.py). Every row on
every device is tests/test_op_table.py's; here: what the specialising relies on."""

from __future__ import annotations

import numpy as np
import pytest

from ember.backends import generic
from ember.backends import numpy as numpy_backend


def test_an_elementwise_row_is_numpys_function_itself():
    """No Python frame between the engine and a ufunc, and ``into`` finds the ufunc's ``out``."""
    own = {"expm1", "tanh", "floor_divide"}  # NumPy's values fixed
    for name in set(generic.ELEMENTWISE) - own:
        assert numpy_backend.KERNELS[name] is getattr(np, name), name
    assert numpy_backend.KERNELS["acos"] is np.arccos and numpy_backend.KERNELS["pow"] is np.power
    assert numpy_backend.BACKEND.into("add") is np.add and numpy_backend.BACKEND.into("expm1") is None


def test_a_namespace_is_its_module_but_for_its_renames():
    xp = generic.Namespace(np, sort=sorted)
    assert xp.sort is sorted and xp.argsort is np.argsort and xp.linalg is np.linalg and xp.fft.fft is np.fft.fft


def test_a_row_whose_function_the_namespace_lacks_is_left_to_the_backend():
    xp = generic.Namespace(np)
    del xp.unique_values, xp.hypot
    table = generic.kernels(xp, {})
    assert "unique_values" not in table and "hypot" not in table and table["add"] is np.add


def test_jax_renames_are_the_functions_its_standard_names_wrap():
    jax = pytest.importorskip("jax")
    from ember.backends import jax as jax_backend
    x = np.linspace(-0.9, 0.9, 7)
    with jax.enable_x64(True):
        for name in ("acos", "acosh", "asin", "atan", "atanh", "bitwise_invert", "concat", "permute_dims"):
            assert getattr(jax_backend.XP, name) is not getattr(jax.numpy, name), name
        assert np.array_equal(jax_backend.XP.acos(x), jax.numpy.acos(x))


def test_torch_takes_numpys_axis_and_keepdims_where_the_generic_rows_pass_them():
    """The generic rows that run on torch's own functions pass ``axis=`` and ``keepdims=``: torch's argument parser
    reads them as ``dim=`` and ``keepdim=``. A torch that stopped would fail here first."""
    torch = pytest.importorskip("torch")
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(torch.stack([x, x], axis=1), torch.stack([x, x], dim=1))
    assert torch.equal(torch.fft.fft(x, n=None, axis=0, norm=None), torch.fft.fft(x, dim=0))
    assert torch.equal(torch.linalg.matrix_norm(x, keepdims=True, ord="fro"),
                       torch.linalg.matrix_norm(x, keepdim=True, ord="fro"))
