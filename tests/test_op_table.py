"""Tests generated from the op table: every row with example recipes (tests/recipes/, keyed by
the row's name) is checked on every local backend, so an added op needs only its recipes.

(a) the meta rule agrees with the shapes and dtypes the backend really returns;
(b) the numpy backend and every other (torch, jax) agree on values, within the dtype's tolerance;
(c) bad inputs raise ember's typed errors naming the op, never a raw backend exception.
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
from hypothesis import assume, given, reject
from hypothesis import strategies as st

import ember as em
from ember import dtypes as dt
from ember.array import bind
from ember.errors import DTypeError, EmberError, IndexingError, ShapeError
from ember.ops import OPS
from ember.ops.table import REQUIRED, fmt_shape

from .conftest import LOCAL_DEVICES, REMOTE_SCHEMES, given_data_per_device
from .generators import Drawer
from .recipes import BAD_EXAMPLES, EXAMPLES, bad_recipes

WITH_EXAMPLES = sorted(name for name in OPS if EXAMPLES.get(name))
# a row may list several bad recipes, one per refusal its rules make
BAD_CASES = [(name, k) for name in sorted(OPS) if BAD_EXAMPLES.get(name) for k in range(len(bad_recipes(name)))]
TESTED_BY_HAND = {"setitem": "tests/test_indexing.py compares x[key] = v with NumPy"}


def supported_dtypes(device):
    return em.__array_namespace_info__().dtypes(device=device).values()


def run(op, device, arrays, attrs, with_metas=False):
    """Upload the example's host arrays to ``device`` and apply the row through ``bind`` (and, with
    ``with_metas``, give the output metas its meta rule inferred beside the outputs).

    The one declared gap is a result dtype the device lacks (torch has no uint64 for prod(uint8)):
    such an example is discarded by its meta rule, before running; any other NotSupportedError fails.
    """
    inputs = tuple(em.asarray(a, device=device) for a in arrays)
    full = {**op.attrs, **attrs}
    assert REQUIRED not in full.values(), f"recipe of {op.name} leaves a required attribute out"
    _, out_metas = op.infer(tuple(x._meta for x in inputs), full)
    assume(all(m.dtype in supported_dtypes(device) for m in out_metas))
    out = bind(op, inputs, full, device=device)
    out = out if isinstance(out, tuple) else (out,)
    return (out, out_metas) if with_metas else out


def test_every_row_is_tested():
    for name, op in OPS.items():
        assert EXAMPLES.get(name) or name in TESTED_BY_HAND, f"op {name} has no example recipe"
        assert op.doc, f"op {name} has no doc"


def test_every_recipe_names_a_row():
    for recipes in (EXAMPLES, BAD_EXAMPLES):
        assert not recipes.keys() - OPS.keys(), "recipes for ops that are not in the table"
    assert not TESTED_BY_HAND.keys() - OPS.keys(), "ops tested by hand that are not in the table"
    assert not TESTED_BY_HAND.keys() & EXAMPLES.keys(), "ops both tested by hand and drawn from recipes"


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
def test_every_row_has_a_kernel_or_a_declared_gap(device_name):
    backend = em.device(device_name).engine.backend
    for name in OPS:
        assert name in backend.kernels or name in backend.gaps, f"{device_name} has no kernel for {name}"
    assert not set(backend.kernels) - set(OPS), "kernels for ops that are not in the table"


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
@pytest.mark.parametrize("name", WITH_EXAMPLES)
@given_data_per_device
def test_meta_rule_matches_backend(name, device_name, data):
    op, device = OPS[name], em.device(device_name)
    arrays, attrs = EXAMPLES[name](Drawer(data, supported_dtypes(device)))
    backend = device.engine.backend
    outs, inferred = run(op, device, arrays, attrs, with_metas=True)
    for out, meta in zip(outs, inferred, strict=True):
        native = device.engine.native(out._handle)
        # the rule's own shape, not the array's: an engine replaces a data-dependent row's shape by the real one
        shape = tuple(native.shape)
        fits = len(meta.shape) == len(shape) and all(m is None or m == n for m, n in zip(meta.shape, shape))
        assert fits, f"{name}: meta shape {meta.shape}, backend {shape}"
        assert None not in meta.shape or op.data_dependent, f"{name}: an unknown dimension in {meta.shape}"
        assert out.shape == shape, f"{name}: the array's shape {out.shape}, backend {shape}"
        assert backend.dtype_of(native) is meta.dtype is out.dtype, f"{name}: meta dtype {meta.dtype}, backend {native.dtype}"


def _tolerance(dtype):
    if dtype in (dt.float32, dt.complex64):
        return {"rtol": 2e-4, "atol": 1e-5}
    if dtype in (dt.float64, dt.complex128):
        return {"rtol": 1e-9, "atol": 1e-11}
    return {"rtol": 0, "atol": 0}


# the creation rows against NumPy's own functions: their canon rules pick dtypes and lengths that no backend checks
# (a backend runs what the canon rule decided)
NUMPY_CREATION = {
    "arange": lambda a, dtype: np.arange(a["start"], a["stop"], a["step"], dtype=dtype),
    "linspace": lambda a, dtype: np.linspace(a["start"], a["stop"], a["num"], endpoint=a["endpoint"], dtype=dtype),
    "eye": lambda a, dtype: np.eye(a["n_rows"], a["n_cols"], k=a["k"], dtype=dtype),
    "full": lambda a, dtype: np.full(a["shape"], a["fill_value"], dtype=dtype),
    "fftfreq": lambda a, dtype: np.fft.fftfreq(a["n"], a["d"]).astype(dtype or np.float64),
    "rfftfreq": lambda a, dtype: np.fft.rfftfreq(a["n"], a["d"]).astype(dtype or np.float64),
}


@pytest.mark.parametrize("name", sorted(NUMPY_CREATION))
@given(data=st.data())
def test_creation_rows_match_numpy(name, data):
    _, attrs = EXAMPLES[name](Drawer(data))
    attrs = {**OPS[name].attrs, **attrs}
    dtype = attrs["dtype"]
    expected = NUMPY_CREATION[name](attrs, None if dtype is None else dt.NUMPY[dtype])
    actual = em.asnumpy(bind(OPS[name], (), attrs))
    assert actual.dtype == expected.dtype, f"{name}{attrs}: {actual.dtype}, NumPy {expected.dtype}"
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6, err_msg=f"{name}{attrs}")


@pytest.mark.parametrize("device_name", LOCAL_DEVICES[1:])
@pytest.mark.parametrize("name", WITH_EXAMPLES)
@given_data_per_device
def test_numpy_and_other_backends_agree(name, device_name, data):
    op = OPS[name]
    numpy_device, other = em.device("numpy"), em.device(device_name)
    arrays, attrs = EXAMPLES[name](Drawer(data, supported_dtypes(other)))
    expected = run(op, numpy_device, arrays, attrs)
    actual = run(op, other, arrays, attrs)
    determined = range(len(expected)) if op.determined is None else op.determined
    for i in determined:
        e, a = em.asnumpy(expected[i]), em.asnumpy(actual[i])
        if i in op.unordered:  # the same values, in an order each backend picks
            e, a = np.sort(e, axis=-1), np.sort(a, axis=-1)
        assert a.shape == e.shape and a.dtype == e.dtype
        tolerance = _tolerance(expected[i].dtype)
        # rounding errors scale with the result's magnitude: pinv of a float32 matrix with entries near 256
        # differs by ~1e-5 where the exact value is 0, on any two correct backends
        finite = np.abs(e[np.isfinite(e)])
        tolerance["atol"] *= max(1.0, float(finite.max(initial=0)))
        np.testing.assert_allclose(a, e, equal_nan=True, **tolerance, err_msg=f"{name} output {i}")


def _names_the_offender(message: str, arrays, attrs, error, inputs=()) -> bool:
    """Whether a refusal's message names what it refuses: every input's shape for a shape error, an input's
    dtype (or the offending attribute) for a dtype error — and, where the row takes several arrays, which of
    them (by its name in the row, or "inputs" for all) —, the offending attribute — its name and its value — or
    the (first) array's shape for any other."""
    shapes = [fmt_shape(a.shape) for a in arrays]
    dtypes = [dt.FROM_NUMPY[a.dtype].name for a in arrays]

    def names_attribute(key, value):
        items = (value, *(value if isinstance(value, (tuple, list)) else ()))
        named = isinstance(error, IndexingError) or re.search(rf"\b{key}\b", message)  # an index names its parts
        return value is not None and named and any(text in message for item in items for text in (str(item), repr(item)))
    attribute = any(names_attribute(key, value) for key, value in attrs.items())
    first_shape = bool(shapes) and shapes[0] in message
    if isinstance(error, ShapeError):
        return all(shape in message for shape in shapes)
    if isinstance(error, DTypeError):
        which = len(inputs) < 2 or any(re.search(rf"\b{name.lstrip('*')}\b", message) for name in (*inputs, "inputs"))
        return attribute or (which and any(re.search(rf"\b{name}\b", message) for name in dtypes))
    return attribute or first_shape  # a missing attribute (axis=None where one is needed) is named by the array


@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
@pytest.mark.parametrize(("name", "case"), BAD_CASES)
@given(data=st.data())
def test_bad_inputs_raise_typed_errors(name, case, device_name, data):
    op, device = OPS[name], em.device(device_name)
    arrays, attrs, expected = bad_recipes(name)[case](Drawer(data, supported_dtypes(device)))
    with pytest.raises(expected) as info:
        run(op, device, arrays, attrs)
    assert isinstance(info.value, EmberError), f"{name} raised a raw {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert message.startswith(f"{name}:"), f"the message does not name the op: {info.value}"
    named = _names_the_offender(message, arrays, attrs, info.value, op.inputs)
    assert named, f"the message does not name the offender: {message}"


@pytest.mark.parametrize("scheme", REMOTE_SCHEMES)
@pytest.mark.parametrize("name", WITH_EXAMPLES)
@given(data=st.data())
def test_remote_matches_local(name, scheme, peer, data):
    """The same rows on a compute peer (a real ``ember serve``): the meta rule matches what comes
    back, and the values equal local NumPy's exactly (the peer runs the same kernels)."""
    op = OPS[name]
    local, remote = em.device("numpy"), em.device(peer.url(scheme))
    arrays, attrs = EXAMPLES[name](Drawer(data, supported_dtypes(local)))
    expected = run(op, local, arrays, attrs)
    actual = run(op, remote, arrays, attrs)
    determined = range(len(expected)) if op.determined is None else op.determined
    for i, out in enumerate(actual):
        host = em.asnumpy(out)
        assert host.shape == out.shape and host.dtype.name == out.dtype.name, f"{name}: meta vs peer output {i}"
        if i in determined:
            np.testing.assert_array_equal(host, em.asnumpy(expected[i]), err_msg=f"{name} output {i}")


ELEMENTWISE = sorted(name for name, op in OPS.items() if op.family.startswith("elementwise"))


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_functions_take_the_standards_positional_parameters(name):
    """The standard's names, positional-only: ``f(x, /)`` and ``f(x1, x2, /)``."""
    parameters = inspect.signature(getattr(em, name)).parameters.values()
    expected = ["x"] if len(OPS[name].inputs) == 1 else ["x1", "x2"]
    assert [p.name for p in parameters if p.kind is p.POSITIONAL_ONLY] == expected, name


def _standard_functions():
    """(ember's function, array-api-strict's) for every function both namespaces define."""
    import array_api_strict as xps

    pairs = []
    for ours, theirs in ((em, xps), (em.linalg, xps.linalg), (em.fft, xps.fft)):
        for name in sorted(dir(theirs)):
            reference, function = getattr(theirs, name), getattr(ours, name, None)
            if not name.startswith("_") and inspect.isfunction(reference) and callable(function):
                pairs.append(pytest.param(function, reference, id=f"{ours.__name__}.{name}"))
    assert len(pairs) > 150, "array-api-strict's namespace was not read"
    return pairs


@pytest.mark.parametrize(("function", "reference"), _standard_functions())
def test_functions_take_the_standards_parameters(function, reference):
    """Every function of the standard takes its parameters by the standard's names (checked against array-api-strict's
    signatures): the positional ones in order, those it makes positional-only positional here too (ember's ``eye``
    also takes ``n_cols`` by keyword, as NumPy does), and the same keyword-only ones."""
    ours, theirs = (list(inspect.signature(f).parameters.values()) for f in (function, reference))
    kinds = inspect.Parameter
    positional = (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD, kinds.VAR_POSITIONAL)
    assert [p.name for p in ours if p.kind in positional] == [p.name for p in theirs if p.kind in positional]
    assert {p.name for p in ours if p.kind is kinds.KEYWORD_ONLY} == {p.name for p in theirs if p.kind is kinds.KEYWORD_ONLY}
    by_keyword = {p.name for p in theirs if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    assert all(p.kind is not kinds.POSITIONAL_ONLY for p in ours if p.name in by_keyword)


def test_rows_name_their_inputs_as_the_standard_does():
    """One array input is ``x`` and any number of them ``*arrays``, as in the standard (whose functions then show
    them: see the test above)."""
    for op in OPS.values():
        assert len(op.inputs) != 1 or op.inputs in (("x",), ("*arrays",)), op.name


# the rows whose functions take integer and bool arrays as float64, as NumPy's do (sqrt, mean, linalg.inv …); written
# out, not read from the rows' flags, so a row that loses its flag fails here instead of leaving the tests below
LIFTING = {
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "copysign", "cos", "cosh", "divide", "exp", "expm1",
    "hypot", "log", "log10", "log1p", "log2", "logaddexp", "nextafter", "reciprocal", "sin", "sinh", "sqrt", "tan", "tanh",
    "mean", "std", "var",
    "fft", "fftn", "hfft", "ifft", "ifftn", "ihfft", "irfft", "irfftn", "rfft", "rfftn",
    "cholesky", "det", "eig", "eigh", "eigvals", "eigvalsh", "inv", "matrix_norm", "pinv", "qr", "slogdet", "solve", "svd",
    "svdvals", "vector_norm",
    "gelu", "log_softmax", "relu", "sigmoid", "silu", "softmax",
}


def test_the_rows_that_lift_are_those_listed():
    assert {name for name, op in OPS.items() if op.lift} == LIFTING


MATRIX_ROWS = sorted(name for name, op in OPS.items()
                     if op.family == "linalg" and op.inputs == ("x",) and op.lift and REQUIRED not in op.attrs.values())


@pytest.mark.parametrize("name", MATRIX_ROWS)
@given(data=st.data())
def test_only_rows_marked_symmetric_read_just_one_triangle(name, data):
    """``Op.symmetric_input`` (cholesky, eigh, eigvalsh: a Hermitian matrix read from one triangle) tells the gradient
    tests to draw symmetric inputs: a row with it ignores a change in one of the triangles, a row without it in neither."""
    op, attrs = OPS[name], {}  # the defaults: the Frobenius norm sees every entry
    n = data.draw(st.integers(2, 4))
    a = np.random.default_rng(n).standard_normal((n, n))
    x = a @ a.T + n * np.eye(n)  # dense, symmetric and positive definite: every row's input
    upper = np.triu(np.ones((n, n)), 1) * 0.25
    try:
        outs = [run(op, em.device("numpy"), (a,), attrs) for a in (x, x + upper, x + upper.T)]
    except EmberError:  # a singular matrix, say
        reject()
    unchanged = [all(np.array_equal(em.asnumpy(a), em.asnumpy(b)) for a, b in zip(outs[0], other)) for other in outs[1:]]
    assert any(unchanged) == op.symmetric_input, name


def _namespace_function(name):
    return next(f for module in (em, em.linalg, em.fft, em.nn) if callable(f := getattr(module, name, None)))


@pytest.mark.parametrize("name", sorted(LIFTING - set(ELEMENTWISE)))
@given(data=st.data())
def test_every_row_that_lifts_takes_integer_arrays_as_the_default_float(name, data):
    """``linalg.inv(int matrix)``, ``mean(int array)``, ``nn.relu(int array)``: the example's arrays rounded to
    integers give what the same values as float64 give (the namespace casts; the rows refuse integers)."""
    arrays, attrs = EXAMPLES[name](Drawer(data, supported_dtypes(em.device("numpy"))))
    assume(all(a.dtype.kind == "f" for a in arrays))
    ints = [np.round(a * 3).astype(np.int64) for a in arrays]
    function = _namespace_function(name)
    outcomes = []
    for inputs in (ints, [i.astype(np.float64) for i in ints]):
        try:
            out = function(*(em.asarray(i) for i in inputs), **attrs)
            outs = out if isinstance(out, tuple) else (out,)
            outcomes.append([(o.dtype, em.asnumpy(o)) for o in outs])
        except EmberError as error:  # a singular matrix, say: the same refusal both ways
            outcomes.append(type(error))
    lifted, expected = outcomes
    if isinstance(expected, type):
        assert lifted is expected, name
        return
    assert not isinstance(lifted, type), f"{name} refused integer inputs: {lifted.__name__}"
    for (dtype, value), (expected_dtype, expected_value) in zip(lifted, expected):
        assert dtype == expected_dtype and dtype.kind != dt.SIGNED, name
        np.testing.assert_array_equal(value, expected_value)


@pytest.mark.parametrize("name", sorted(LIFTING & set(ELEMENTWISE)))
def test_rows_that_lift_take_integer_arrays_as_the_default_float(name):
    """``sin(int array)`` is ``sin`` of the same values as float64 (the namespace casts; the row itself refuses them)."""
    op, function = OPS[name], getattr(em, name)
    ints = [em.asarray([1, 2, 3]) for _ in op.inputs]
    floats = [em.asarray([1.0, 2.0, 3.0]) for _ in op.inputs]
    lifted, expected = function(*ints), function(*floats)
    assert lifted.dtype == expected.dtype == em.float64, name
    np.testing.assert_array_equal(em.asnumpy(lifted), em.asnumpy(expected))
