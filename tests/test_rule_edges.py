"""Op rules at their edges: the values where a rule switches branch, which random examples rarely draw.

Each test names the rule and the edge. They were written where planted bugs (mutation testing, see
docs/testing.md) survived the generated tests: a dtype's exact limits, ties, zero-size axes, a
Python scalar where an array usually is, an axis other than the last.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

import ember as em
from ember.array import bind
from ember.errors import DTypeError, NotSupportedError, ShapeError
from ember.ops import OPS
from ember.ops.table import Meta, Op

from .conftest import assert_takes_pytorchs_subgradient, torch_available


@pytest.mark.parametrize(("start", "stop", "dtype"), [(0, 128, "int8"), (-128, 0, "int8"), (250, 256, "uint8")])
def test_arange_reaches_its_dtypes_limits_exactly(start, stop, dtype):
    """_arange_meta: values up to iinfo.max and down to iinfo.min fit; one step past them does not."""
    out = em.arange(start, stop, dtype=getattr(em, dtype))
    np.testing.assert_array_equal(em.asnumpy(out), np.arange(start, stop, dtype=dtype))
    with pytest.raises(DTypeError, match=r"^arange: values from"):
        em.arange(start - 1 if start < 0 else start, stop + 1 if start >= 0 else stop, dtype=getattr(em, dtype))


def test_arange_checks_its_last_value_not_its_step():
    """0, 100, 200 does not fit int8 although the step does."""
    with pytest.raises(DTypeError, match=r"^arange: values from 0 to 200 do not fit dtype int8"):
        em.arange(0, 300, 100, dtype=em.int8)


def test_pow_exponent_gradient_with_a_scalar_base_and_at_bases_without_a_real_log():
    """_pow_exponent_grad: 2.0 ** x takes the gradient 2**x · ln 2; at a base of 0 or below it is 0 (documented there;
    PyTorch gives NaN below 0, where a real power has no derivative in its exponent)."""
    x = em.asarray([0.5, 3.0], device=em.autodiff("numpy")).requires_grad_()
    em.sum(2.0 ** x).backward()
    np.testing.assert_allclose(em.asnumpy(x.grad), 2.0 ** np.array([0.5, 3.0]) * np.log(2.0), rtol=1e-12)
    y = em.asarray([2.0, 2.0, 2.0], device=em.autodiff("numpy")).requires_grad_()
    em.sum(em.asarray([-2.0, 0.0, 3.0]) ** y).backward()
    np.testing.assert_allclose(em.asnumpy(y.grad), [0.0, 0.0, 9.0 * np.log(3.0)], rtol=1e-12)


def test_where_gradient_with_python_scalar_branches():
    """_where_grad: a scalar branch takes no gradient; the array branch takes g where it was chosen."""
    condition = em.asarray([True, False, True])
    x = em.asarray([1.0, 2.0, 3.0], device=em.autodiff("numpy")).requires_grad_()
    em.sum(em.where(condition, x, 0.0) * 2.0).backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [2.0, 0.0, 2.0])
    y = em.asarray([1.0, 2.0, 3.0], device=em.autodiff("numpy")).requires_grad_()
    em.sum(em.where(condition, -1.0, y)).backward()
    np.testing.assert_array_equal(em.asnumpy(y.grad), [0.0, 1.0, 0.0])


def test_reductions_over_a_nonempty_axis_of_an_empty_array():
    """_arg_meta and _vector_norm_meta refuse an empty reduction only along the reduced axes."""
    x = np.zeros((0, 3))
    assert em.argmax(em.asarray(x), axis=1).shape == np.argmax(x, axis=1).shape == (0,)
    out = em.linalg.vector_norm(em.asarray(x), axis=1, ord=float("inf"))
    assert out.shape == (0,)
    with pytest.raises(ShapeError):
        em.argmax(em.asarray(x), axis=0)


def test_dropout_seeds_are_taken_modulo_two_to_the_63():
    """_dropout_mask_canon: a seed fits an int64 on the wire; s, s + 2**63 and s - 2**63 draw the same mask."""
    def mask(seed):
        return em.asnumpy(em.nn.dropout_mask((64,), 0.5, seed=seed))
    np.testing.assert_array_equal(mask(5), mask(5 + 2**63))
    np.testing.assert_array_equal(mask(2**63 - 1), mask(-1))
    assert not np.array_equal(mask(5), mask(6))


def test_matrix_power_gradient_at_n_zero_and_one():
    """_matrix_power_grad: x**0 = I does not depend on x (a zero gradient of x's shape); x**1 passes g through."""
    a = np.array([[2.0, 1.0], [0.5, 3.0]])
    for n, expected in ((0, np.zeros((2, 2))), (1, np.ones((2, 2)))):
        x = em.asarray(a, device=em.autodiff("numpy")).requires_grad_()
        em.sum(em.linalg.matrix_power(x, n)).backward()
        np.testing.assert_array_equal(em.asnumpy(x.grad), expected)


def test_matrix_power_of_an_integer_matrix_for_every_non_negative_n():
    """An integer matrix takes n >= 0 (n = 0 gives the identity of its dtype) and is refused below: a negative power
    inverts."""
    a = np.array([[2, -1], [3, 1]])
    for n in (0, 1, 2, 3):
        ours = em.linalg.matrix_power(em.asarray(a), n)
        assert ours.dtype == em.int64 and em.asnumpy(ours).tolist() == np.linalg.matrix_power(a, n).tolist()
    with pytest.raises(DTypeError, match="^matrix_power: "):
        em.linalg.matrix_power(em.asarray(a), -1)


def test_linear_refusals_name_the_shapes_they_expect():
    """_linear_meta's messages give the expected weight and bias shapes from the input's last axis and the weight's rows."""
    x = em.zeros((2, 3, 4))
    with pytest.raises(ShapeError, match=r"weight must be \(out, 4\) float64 for input \(2, 3, 4\), got \(5, 3\)"):
        em.nn.linear(x, em.zeros((5, 3)))
    with pytest.raises(ShapeError, match=r"bias must be \(5,\) float64 for input \(2, 3, 4\) and weight \(5, 4\), got \(4,\)"):
        em.nn.linear(x, em.zeros((5, 4)), em.zeros((4,)))


def test_the_rule_cache_tells_booleans_from_integers_inside_tuples():
    """A meta rule's result is cached by its attributes and their types: inside a tuple too, or axis=(False, True)
    would be served the cached result of the equal axis=(0, 1) instead of its refusal."""
    x = em.ones((2, 3))
    assert float(em.sum(x, axis=(0, 1))) == 6.0
    with pytest.raises(em.ArgumentError, match="^sum: axis must be an int, got False"):
        em.sum(x, axis=(False, True))
    nested = 0
    for _ in range(sys.getrecursionlimit() + 1000):  # deeper than Python recurses: a typed refusal, not a RecursionError
        nested = (nested,)
    # Python 3.13 writes so deep a tuple out (its repr counts against the C stack's limit, not the recursion limit):
    # there the refusal names it, as it names a shallow one
    refusal = (r"^sum: an attribute is nested too deeply$" if sys.version_info < (3, 13)
               else r"^sum: axis must be an int, got \(+0,\)(,\))*$")
    with pytest.raises(em.ArgumentError, match=refusal):
        em.sum(x, axis=nested)
    assert float(em.sum(x)) == 6.0


def test_attention_refuses_inputs_of_different_ranks_before_comparing_their_shapes():
    with pytest.raises(ShapeError, match=r"^scaled_dot_product_attention: q, k, v must be \(\.\.\., L, E\), \(\.\.\., S, E\), "
                                         r"\(\.\.\., S, Ev\), got \(2, 3\), \(1, 2, 3\), \(2, 3\)$"):
        em.nn.scaled_dot_product_attention(em.zeros((2, 3)), em.zeros((1, 2, 3)), em.zeros((2, 3)))


def test_layer_norm_refusal_lists_the_affine_shapes_it_got():
    with pytest.raises(ShapeError, match=r"^layer_norm: weight and bias must both be given, shaped \(3,\), got "
                                         r"\(3,\), \(2,\) \(input \(2, 3\)\)$"):
        em.nn.layer_norm(em.zeros((2, 3)), (3,), em.ones(3), em.zeros(2))


def test_window_refusals_name_the_side_and_the_shapes():
    """_out_size names the side that does not fit (height or width) and the shapes it had: the input's, and the
    weight's for a convolution (a pool has none)."""
    with pytest.raises(ShapeError, match=r"^max_pool2d: the height window does not fit input \(1, 1, 2, 5\): "
                                         r"size 2, kernel 3, padding 0, dilation 1$"):
        em.nn.max_pool2d(em.zeros((1, 1, 2, 5)), 3)
    with pytest.raises(ShapeError, match=r"^conv2d: the width window does not fit input \(1, 1, 5, 2\) and weight "
                                         r"\(1, 1, 3, 3\): size 2, kernel 3, padding 0, dilation 1$"):
        em.nn.conv2d(em.zeros((1, 1, 5, 2)), em.zeros((1, 1, 3, 3)))


@pytest.mark.parametrize("name", ["fft", "ifft", "rfft", "irfft", "hfft", "ihfft", "fftn", "ifftn", "rfftn", "irfftn"])
def test_transforms_take_numpys_default_lengths(name):
    """_one_axis/_many_axes fill in n and s before any backend sees them (irfft's 2(m - 1)), so backends agree with
    each other whatever the default: NumPy is the reference for it."""
    host = np.random.default_rng(0).standard_normal((3, 5))
    if name in ("irfft", "hfft", "irfftn", "ifft", "fft", "fftn", "ifftn"):
        host = host + 1j * np.random.default_rng(1).standard_normal((3, 5))
    ours, theirs = getattr(em.fft, name)(em.asarray(host)), getattr(np.fft, name)(host)
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(em.asnumpy(ours), theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
@pytest.mark.parametrize("name", ["fftn", "ifftn", "rfftn", "irfftn"])
def test_n_dimensional_transform_gradients_over_three_axes(name):
    """_fftn_grad, _rfftn_grad, _irfftn_grad: the leading axes' transforms undone over every axis but the last (with two
    axes "all but the last" is also "the first"), against torch.autograd."""
    import torch
    rng = np.random.default_rng(3)
    re, im = rng.standard_normal((2, 2, 3, 4))
    weights = rng.standard_normal(getattr(np.fft, name)(re + 1j * im if name != "rfftn" else re).shape)
    x, y = (em.asarray(v, device=em.autodiff("numpy")).requires_grad_() for v in (re, im))
    z = torch.tensor(re if name == "rfftn" else re + 1j * im, requires_grad=True)
    out = getattr(torch.fft, name)(z)
    torch.sum((out.real if out.is_complex() else out) * torch.tensor(weights)).backward()
    ours = getattr(em.fft, name)(x if name == "rfftn" else x + y * 1j)
    em.sum((em.real(ours) if ours.dtype in (em.complex64, em.complex128) else ours) * em.asarray(weights)).backward()
    grad = em.asnumpy(x.grad) + (0 if name == "rfftn" else 1j * em.asnumpy(y.grad))
    np.testing.assert_allclose(grad, z.grad.resolve_conj().numpy(), rtol=1e-10, atol=1e-12)


def test_stack_and_setitem_refusals_list_what_they_compare():
    for a, b, dims in (((2, 3), (2, 4, 5), r"3 \(dim 1\) != 4 \(dim 1\)"), ((2, 3, 4), (5, 6), r"4 \(dim 2\) != 5 \(dim 0\)"),
                       ((2, 3), (4,), r"3 \(dim 1\) != 4 \(dim 0\)")):
        shapes = rf"{re.escape(str(a))} and {re.escape(str(b))}"
        with pytest.raises(ShapeError, match=rf"^matmul: shapes {shapes} are not aligned \({dims}\)$"):
            em.matmul(em.zeros(a), em.zeros(b))
    with pytest.raises(ShapeError, match=r"^reshape: cannot reshape \(2, 3\) to \(-1, -1\): at most one -1 and no other "
                                         r"negative size$"):
        em.reshape(em.zeros((2, 3)), (-1, -1))
    with pytest.raises(ShapeError, match=r"^concat: cannot concatenate 0-d arrays, got shapes \(\), \(\)$"):
        em.concat([em.zeros(()), em.zeros(())])
    with pytest.raises(IndexError, match=r"^getitem: index arrays of shapes \(2,\), \(3,\) cannot be broadcast together "):
        em.zeros((4, 4))[em.asarray([0, 1]), em.asarray([0, 1, 2])]
    with pytest.raises(ShapeError, match=r"^stack: arrays must share one shape, got \(2,\), \(3,\)$"):
        em.stack([em.zeros(2), em.zeros(3)])
    # x[key] = value casts the value first; a record from a graph file or a client reaches the row as it is
    with pytest.raises(DTypeError, match=r"^setitem: value dtype int64 differs from the array's float64$"):
        bind(OPS["setitem"], (em.zeros(3), em.asarray([1, 2, 3])), {"key": ()})


def test_gradients_of_a_real_sign_and_of_a_dot_product():
    """_slogdet_grad: a real determinant's sign is piecewise constant (a zero gradient); _matmul_grad: the 1-d · 1-d
    branch, a dot product."""
    a = np.array([[2.0, 1.0], [0.5, -3.0]])
    x = em.asarray(a, device=em.autodiff("numpy")).requires_grad_()
    em.linalg.slogdet(x)[0].backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), np.zeros((2, 2)))
    u = em.asarray([1.0, 2.0, 3.0], device=em.autodiff("numpy")).requires_grad_()
    v = em.asarray([4.0, -5.0, 0.5], device=em.autodiff("numpy")).requires_grad_()
    (3.0 * (u @ v)).backward()
    np.testing.assert_array_equal(em.asnumpy(u.grad), [12.0, -15.0, 1.5])
    np.testing.assert_array_equal(em.asnumpy(v.grad), [3.0, 6.0, 9.0])


def test_setitem_gradients_with_a_scalar_a_broadcast_value_and_an_index_array():
    """_setitem_grad: what was overwritten gets no gradient; a broadcast value gets its cotangents summed; a Python
    scalar gets none; an index array selects like a slice."""
    weights = em.asarray([1.0, 5.0, 7.0, 11.0])
    x = em.asarray([1.0, 2.0, 3.0, 4.0], device=em.autodiff("numpy")).requires_grad_()
    v = em.asarray([10.0], device=em.autodiff("numpy")).requires_grad_()
    y = x * 1.0
    y[1:3] = v  # broadcast to two places
    y[0] = 5.0  # a scalar
    em.sum(y * weights).backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [0.0, 0.0, 0.0, 11.0])
    np.testing.assert_array_equal(em.asnumpy(v.grad), [12.0])
    x = em.asarray([1.0, 2.0, 3.0, 4.0], device=em.autodiff("numpy")).requires_grad_()
    v = em.asarray([10.0, 20.0], device=em.autodiff("numpy")).requires_grad_()
    y = x * 1.0
    y[em.asarray([3, 0])] = v
    em.sum(y * weights).backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [0.0, 5.0, 7.0, 0.0])
    np.testing.assert_array_equal(em.asnumpy(v.grad), [11.0, 1.0])


def test_repeat_gradient_over_the_flattened_array():
    """_repeat_grad with axis=None: the input is flattened, each element repeated, the cotangents summed back."""
    x = em.asarray([[1.0, 2.0], [3.0, 4.0]], device=em.autodiff("numpy")).requires_grad_()
    em.sum(em.repeat(x, 2) * em.arange(8.0)).backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [[1.0, 5.0], [9.0, 13.0]])


def test_unstack_gradient_when_only_some_parts_are_used():
    """_unstack_grad: an unused part's cotangent is zero."""
    x = em.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], device=em.autodiff("numpy")).requires_grad_()
    parts = em.unstack(x, axis=0)
    em.sum(parts[1] * em.asarray([2.0, 3.0])).backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [[0.0, 0.0], [2.0, 3.0], [0.0, 0.0]])


def test_grad_of_grad_is_refused_not_silently_zero():
    """The inner grad would differentiate a detached copy, so the outer gradient would be zero: refused."""
    inner = em.grad(lambda x: em.sum(em.sin(x)))
    outer = em.grad(lambda x: em.sum(inner(x)))
    x = em.asarray([0.5, 1.0])
    with pytest.raises(NotSupportedError, match=r"^grad: higher-order gradients are not supported"):
        outer(x)
    np.testing.assert_allclose(em.asnumpy(inner(x)), np.cos([0.5, 1.0]))  # nothing is left behind


def _ties():
    import torch
    return [  # (ember's function, PyTorch's, a point with ties)
        (lambda x: em.linalg.vector_norm(x, ord=float("inf")), lambda t: torch.linalg.vector_norm(t, ord=float("inf")),
         [1.0, -1.0, 0.5]),
        (lambda x: em.linalg.vector_norm(x, ord=0.5), lambda t: torch.linalg.vector_norm(t, ord=0.5), [0.0, 0.0, 0.0]),
        (lambda x: em.linalg.matrix_norm(em.reshape(x, (2, 2)), ord=1),
         lambda t: torch.linalg.matrix_norm(t.reshape(2, 2), ord=1), [1.0, 2.0, 3.0, 2.0]),
        (lambda x: em.linalg.matrix_norm(em.reshape(x, (2, 2)), ord=float("inf")),
         lambda t: torch.linalg.matrix_norm(t.reshape(2, 2), ord=float("inf")), [1.0, 3.0, 2.0, 2.0]),
        (lambda x: em.max(x), lambda t: torch.amax(t), [1.0, 3.0, 2.0, 3.0]),
        (lambda x: em.max(em.reshape(x, (2, 2)), axis=0), lambda t: torch.amax(t.reshape(2, 2), dim=0), [1.0, 3.0, 1.0, 2.0]),
        (lambda x: em.nn.gelu(x), lambda t: torch.nn.functional.gelu(t), [0.0, 1.0, -1.0]),
        (lambda x: em.max(em.reshape(x, (2, 3)), axis=1, keepdims=True),
         lambda t: torch.amax(t.reshape(2, 3), dim=1, keepdim=True), [3.0, 1.0, 3.0, 2.0, 2.0, 0.0]),
        # a stable sort keeps tied elements in order, and their cotangents with them (200 values: NumPy's default
        # sort is stable only for short arrays)
        (lambda x: em.sort(x) * em.arange(200.0), lambda t: torch.sort(t, stable=True).values * torch.arange(
            200.0, dtype=torch.float64), np.random.default_rng(0).integers(0, 3, 200).astype(float).tolist()),
    ]


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
@pytest.mark.parametrize("case", range(9), ids=["norm inf ties", "norm 0.5 at zero", "matrix norm 1 ties",
                                                 "matrix norm inf ties", "max ties", "max ties on an axis", "gelu at 0",
                                                 "max ties kept dims", "stable sort ties"])
def test_gradients_at_ties_take_pytorchs_subgradient(case):
    """Ties share the gradient evenly (PyTorch's amax); a zero vector and gelu at 0 take PyTorch's values."""
    assert_takes_pytorchs_subgradient(*_ties()[case])


def test_the_rule_cache_serves_repeats_without_running_the_rule_and_keys_types_inside_tuples():
    """Op.infer runs a rule once per (metas, attributes and their types): a cache that silently stopped caching
    (a key that fails to build, a lookup that raises) would still give right answers, only slowly."""
    calls = []
    probe = Op("probe", ("x",), {"axis": 0}, lambda x, axis: calls.append(axis) or Meta(x.shape, x.dtype), family="utility")
    metas = (Meta((2, 3), em.float64),)
    for axis in (0, 0, (0, 1), (0, 1), (False, True), 1.0, 1):
        probe.infer(metas, {"axis": axis})
    assert calls == [0, (0, 1), (False, True), 1.0, 1]
    probe.infer(metas, {"axis": 0})
    assert len(calls) == 5


def test_the_rule_cache_keeps_short_keys_only_and_stays_within_its_bound(monkeypatch):
    from ember.ops import table
    probe = Op("probe", ("x",), {"axis": 0}, lambda x, axis: Meta(x.shape, x.dtype), family="utility")
    for ndim, cached in ((64, True), (65, False)):
        probe.infer((Meta((1,) * ndim, em.float64),), {"axis": 0})
        assert any(key[0][0].shape == (1,) * ndim for key in probe.cache) is cached
    for length, cached in ((64, True), (65, False)):
        probe.infer((Meta((2,), em.float64),), {"axis": (0,) * length})
        assert any(key[1] == ((0,) * length,) for key in probe.cache) is cached
    # the bound counts every row's cache together: filling this one empties the others too
    em.sin(em.ones(3))
    assert table.OPS["sin"].cache
    monkeypatch.setattr(table, "META_CACHE_ENTRIES", 3)
    for n in range(1, 8):
        probe.infer((Meta((n,), em.float64),), {"axis": 0})
        assert 1 <= table.cached_entries() <= 3
    assert not table.OPS["sin"].cache


def test_the_tables_helpers_name_what_they_refuse():
    """require_ndim, as_shape, as_int and require_same_dtype: the words every rule's refusals are made of."""
    with pytest.raises(ShapeError, match=r"^det: input must have at least 2 dimensions, got shape \(3,\)$"):
        em.linalg.det(em.ones(3))
    with pytest.raises(ShapeError, match=r"^softmax: input must have at least 1 dimension, got shape \(\)$"):
        em.nn.softmax(em.asarray(1.0))
    with pytest.raises(ShapeError, match=r"^full: shape \(2, -1\) has a negative dimension$"):
        em.zeros((2, -1))
    with pytest.raises(em.ArgumentError, match=r"^full: shape must be an int or a sequence of ints, got 1\.5$"):
        em.zeros(1.5)
    with pytest.raises(em.ArgumentError, match=r"^full: shape must be an int, got 1\.5$"):
        em.zeros((2, 1.5))
    # a record (a graph file, a client) reaches the rule without the namespace's promotion: the second input differs
    with pytest.raises(DTypeError, match=r"^concat: inputs must share one dtype, got float64, float32, float64$"):
        bind(OPS["concat"], (em.ones(2), em.ones(2, dtype=em.float32), em.ones(2)), {"axis": 0})
    # NumPy's integers are ints to a rule (through __index__)
    assert em.reshape(em.ones(6), (np.int64(3), np.int64(2))).shape == (3, 2)


def test_broadcast_shapes_of_one_shape_and_of_unknown_lengths():
    from ember.ops.table import broadcast_shapes
    assert broadcast_shapes((2, 3)) == (2, 3) and broadcast_shapes((2, 3), (2, 3)) == (2, 3)
    # a mask's length, unknown before running, broadcasts to unknown against any length
    assert broadcast_shapes((None,), (3,)) == (None,) and broadcast_shapes((3,), (None,)) == (None,)
    assert broadcast_shapes((2, 1), (None, 4)) == (None, 4)


def test_define_refuses_a_second_row_of_one_name_and_an_unknown_family():
    from ember.ops.table import REQUIRED, define
    with pytest.raises(ValueError, match=r"^op 'add' defined twice$"):
        define(OPS["add"])
    with pytest.raises(ValueError, match=r"^op 'probe': unknown family 'gadgets'$"):
        define(Op("probe", ("x",), {}, lambda x: x, family="gadgets"))
    assert "probe" not in OPS
    assert repr(REQUIRED) == "<required>"  # how a required attribute shows in a row's signature and messages


def test_the_rule_cache_serves_repeats_of_an_op_without_attributes():
    calls = []
    probe = Op("probe", ("x",), {}, lambda x: calls.append(x) or Meta(x.shape, x.dtype), family="utility")
    metas = (Meta((2, 3), em.float64),)
    for _ in range(3):
        assert probe.infer(metas, {}) == ({}, metas)
    assert len(calls) == 1


def test_the_rows_whose_results_backends_may_give_differently_say_so():
    """Backends may scale an eigenvector by a unit, order eigenvalues as they like, or leave memory unset: the
    generated tests compare those outputs up to a unit, as sets, or not at all, as each row's flags say. The
    rows and their flags, listed by hand: a flag lost would weaken those comparisons without failing them."""
    flagged = {name: (op.determined, op.unit_free, op.unordered) for name, op in OPS.items()
               if op.determined is not None or op.unit_free or op.unordered}
    assert flagged == {"eig": ((0,), (1,), (0,)), "eigh": ((0,), (1,), ()), "eigvals": (None, (), (0,)),
                       "empty": ((), (), ()), "qr": ((), (), ()), "svd": ((1,), (), ())}


@pytest.mark.parametrize("axes, error, message", [
    ((0, 2), em.AxisError, "axes (0, 2) are not a permutation of the 2 axes of shape (2, 3)"),
    ((0, -3), em.AxisError, "axes (0, -3) are not a permutation of the 2 axes of shape (2, 3)"),
    ((0,), em.AxisError, "axes (0,) are not a permutation of the 2 axes of shape (2, 3)"),
    ((0, 1.5), em.ArgumentError, "axes must be an int, got 1.5"),
])
def test_permute_dims_refuses_axes_that_are_not_a_permutation(axes, error, message):
    with pytest.raises(error) as refused:
        em.permute_dims(em.ones((2, 3)), axes)
    assert str(refused.value) == f"permute_dims: {message}"
    assert em.permute_dims(em.ones((2, 3)), (-1, 0)).shape == (3, 2)
