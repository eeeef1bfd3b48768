"""Autodiff: gradients generated from the op table against finite differences, numpy vs torch,
and the device semantics (inner, equality, no_grad, stops, remote, capture)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import Phase, assume, find, given, reject, settings
from hypothesis import strategies as st

import ember as em
from ember import dtypes as dt
from ember.array import bind
from ember.backends.numpy import EMBER
from ember.errors import DTypeError, EmberError, NotSupportedError
from ember.ops import NO_GRADIENT, OPS
from ember.ops.gradients import NotDifferentiable
from ember.ops.table import Meta

from .conftest import LOCAL_DEVICES, assert_takes_pytorchs_subgradient, given_data_per_device, torch_available
from .generators import Drawer
from .peers import Peer
from .recipes import EXAMPLES, branches

DIFFERENTIABLE = sorted(name for name, op in OPS.items()
                        if EXAMPLES.get(name) and callable(op.grad) and not isinstance(op.grad, NotDifferentiable) and op.inputs)
# each row once per branch of its rules that an attribute selects (every norm's ord), so each branch is reached
CASES = [pytest.param(name, pin, id=f"{name}-{'-'.join(f'{k}={v}' for k, v in pin.items())}" if pin else name)
         for name in DIFFERENTIABLE for pin in branches(name)]
FLOAT64_ONLY = (dt.float64, dt.int64, dt.bool_)


def test_every_row_has_a_gradient_rule_or_says_why_not():
    for name, op in OPS.items():
        assert op.grad is NO_GRADIENT or isinstance(op.grad, NotDifferentiable) or callable(op.grad), name


@pytest.mark.parametrize("name", [name for name, op in OPS.items()
                                  if op.family == "elementwise binary" and callable(op.grad) and name in DIFFERENTIABLE])
@pytest.mark.parametrize("side", [0, 1])
@pytest.mark.parametrize("device_name", LOCAL_DEVICES)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_python_scalar_operand_gives_the_gradient_a_zero_d_array_gives(name, side, device_name, dtype):
    """``2.0 ** x``, ``x - 1.5``: a rule meets a Python scalar where an array usually is, and takes no gradient for it;
    the gradient is the one a 0-d array of x's dtype on x's device gives, bit for bit."""
    function, device = getattr(em, name), em.autodiff(device_name)
    values = np.array([0.7, 1.3, 2.2], dtype=dtype)
    grads = []
    for scalar in (1.5, em.asarray(1.5, dtype=getattr(em, dtype), device=device_name)):
        x = em.asarray(values, device=device).requires_grad_()
        operands = (scalar, x) if side == 0 else (x, scalar)
        em.sum(function(*operands)).backward()
        grads.append(None if x.grad is None else em.asnumpy(x.grad))  # nextafter: none for x2
    if grads[1] is None:
        assert grads[0] is None
    else:
        assert grads[0].dtype == grads[1].dtype == dtype
        np.testing.assert_array_equal(grads[0], grads[1])


@pytest.mark.parametrize("name", [name for name, op in OPS.items() if isinstance(op.grad, NotDifferentiable)])
@given(data=st.data())
def test_backward_through_a_row_without_a_gradient_says_which_and_why(name, data):
    """``qr``, ``pinv`` and the cotangent rows of conv2d and max_pool2d (a second derivative): the backward pass
    stops with NotSupportedError naming the row and its reason, and the tape's arrays stay usable."""
    op = OPS[name]
    arrays, attrs = EXAMPLES[name](Drawer(data, (dt.float64,)))
    inputs = tuple(em.asarray(a, device=em.autodiff("numpy")) for a in arrays)
    for x in inputs:
        if x.dtype == em.float64:
            x.requires_grad_()
    out = bind(op, inputs, {**op.attrs, **attrs})
    first = out[0] if isinstance(out, tuple) else out
    with pytest.raises(NotSupportedError, match=rf"^backward: {name}: .*(not implemented|not supported)"):
        em.sum(first).backward()
    assert em.asnumpy(first).shape == first.shape


def _example(name, data, pin=None):
    op = OPS[name]
    drawer = Drawer(data, (dt.float64,), distinct=True)
    arrays, attrs = EXAMPLES[name](drawer)
    attrs = {**op.attrs, **attrs, **(pin or {})}
    if pin:  # the recipe drew for its own choice of the pinned values: keep the examples the pins allow
        try:
            op.infer(tuple(Meta(a.shape, EMBER[a.dtype]) for a in arrays), attrs)
        except EmberError:
            reject()
    wrt = [i for i, a in enumerate(arrays) if a.dtype == np.float64]
    assume(wrt)
    values = np.sort(np.concatenate([a.ravel() for a in arrays if a.dtype == np.float64]))
    # no ties or near-ties, within or across inputs: max and maximum have kinks there, which a finite difference
    # straddles (a symmetric input's mirrored entries are ties by design, and those rows have no such kinks)
    assume(op.symmetric_input or values.size < 2 or np.min(np.diff(values)) > 1e-3)
    moduli = np.sort(np.abs(values))  # nor of moduli: norms and abs-maxima have kinks where |a| = |b|
    assume(op.symmetric_input or moduli.size < 2 or np.min(np.diff(moduli)) > 1e-3)
    if op.symmetric_input:  # eigenvalues are not separately differentiable where two coincide (eigh, eigvalsh)
        for a in arrays:
            if a.ndim >= 2 and a.shape[-1] >= 2:
                eigenvalues = np.linalg.eigvalsh((a + np.swapaxes(a, -1, -2)) / 2)
                assume(np.min(np.diff(eigenvalues, axis=-1), initial=np.inf) > 1e-3)
    return op, arrays, attrs, wrt


def _loss_function(op, arrays, attrs, wrt, device):
    """sum(out_k · w_k) over the outputs fixed by the inputs (over |out_k|² where they are fixed only up to a unit
    factor per vector, like eigenvectors): a scalar with a rich gradient."""
    rng = np.random.default_rng(1)
    sample = bind(op, tuple(em.asarray(a) for a in arrays), attrs)
    outs = sample if isinstance(sample, tuple) else (sample,)
    determined = range(len(outs)) if op.determined is None else op.determined
    chosen = [k for k in (*determined, *op.unit_free) if outs[k].dtype in (em.float64, em.complex128)]
    weights = {k: em.asarray(rng.standard_normal(outs[k].shape), device=device) for k in chosen}
    imaginary = {k: em.asarray(rng.standard_normal(outs[k].shape), device=device) for k in chosen}
    fixed = {i: em.asarray(a, device=device) for i, a in enumerate(arrays) if i not in wrt}

    def loss(*variables):
        inputs = [fixed[i] if i in fixed else variables[wrt.index(i)] for i in range(len(arrays))]
        out = bind(op, tuple(inputs), attrs)
        out = out if isinstance(out, tuple) else (out,)
        total = em.zeros((), device=device)
        for k in chosen:  # a complex output counts by its real and imaginary parts
            if k in op.unordered:  # in an order each backend picks: a function of the values that ignores it
                total = total + em.sum(em.real(out[k]) ** 2 + em.real(out[k]) * em.imag(out[k]))
            elif k in op.unit_free:
                total = total + em.sum(em.real(out[k] * em.conj(out[k])) * weights[k])
            elif out[k].dtype == em.complex128:
                total = total + em.sum(em.real(out[k]) * weights[k]) + em.sum(em.imag(out[k]) * imaginary[k])
            else:
                total = total + em.sum(out[k] * weights[k])
        return total
    return loss, bool(chosen)


def _numeric_gradient(loss, hosts, step):
    grads = []
    for j, host in enumerate(hosts):
        g = np.zeros_like(host)
        for index in np.ndindex(host.shape):
            plus, minus = [h.copy() for h in hosts], [h.copy() for h in hosts]
            plus[j][index] += step
            minus[j][index] -= step
            g[index] = (float(loss(*map(em.asarray, plus))) - float(loss(*map(em.asarray, minus)))) / (2 * step)
        grads.append(g)
    return grads


def _gradients(loss, hosts):
    """ember's gradient of ``loss`` at ``hosts``, a central difference, and the absolute tolerance between them."""
    assume(sum(h.size for h in hosts) <= 48)
    coarse = _numeric_gradient(loss, hosts, 1e-5)
    fine = _numeric_gradient(loss, hosts, 1e-6)
    for c, f in zip(coarse, fine):  # a kink or a jump makes the estimate unstable: not a test point
        assume(np.all(np.isfinite(c)) and np.allclose(c, f, rtol=1e-4, atol=1e-6))
    analytic = em.grad(loss, argnums=tuple(range(len(hosts))))(*map(em.asarray, hosts))
    # a central difference's rounding error grows with the loss's magnitude (eps·|L|/h)
    terms = abs(float(em.sum(em.abs(loss(*map(em.asarray, hosts))))))
    return [em.asnumpy(a) for a in analytic], fine, 1e-6 + 1e-8 * terms


def _hermitian(m):
    """The part of a gradient that a row reading one triangle of a Hermitian (symmetric) matrix sees."""
    return (m + np.conj(np.swapaxes(m, -1, -2))) / 2


def _assert_close(name, op, wrt, analytic, numeric, atol):
    for k, (a, n) in enumerate(zip(analytic, numeric)):
        if op.symmetric_input:
            a, n = _hermitian(a), _hermitian(n)
        np.testing.assert_allclose(a, n, rtol=1e-6, atol=atol, err_msg=f"{name}: d/d input {wrt[k]}")


@pytest.mark.parametrize(("name", "pin"), CASES)
@given(data=st.data())
def test_gradient_matches_finite_differences(name, pin, data):
    op, arrays, attrs, wrt = _example(name, data, pin)
    loss, differentiable = _loss_function(op, arrays, attrs, wrt, "numpy")
    assume(differentiable)
    _assert_close(name, op, wrt, *_gradients(loss, [arrays[i] for i in wrt]))


@st.composite
def _examples(draw, name):
    return EXAMPLES[name](Drawer(SimpleNamespace(draw=draw), (dt.float64,), distinct=True))


def _takes_complex(name) -> bool:
    """Whether the row's meta rule takes complex128 where its (first drawn) example has float64."""
    op = OPS[name]
    first = settings(database=None, derandomize=True, phases=[Phase.generate])
    arrays, attrs = find(_examples(name), lambda _: True, settings=first)
    metas = tuple(Meta(a.shape, dt.complex128 if a.dtype == np.float64 else EMBER[a.dtype]) for a in arrays)
    try:
        op.infer(metas, {**op.attrs, **attrs})
    except DTypeError:
        return False
    return True


COMPLEX = [name for name in DIFFERENTIABLE if _takes_complex(name)]
COMPLEX_CASES = [case for case in CASES if case.values[0] in COMPLEX]


def test_complex_rows_are_those_whose_meta_rules_take_complex():
    assert {"matmul", "tensordot", "vecdot", "fft", "irfftn", "inv", "cholesky", "sum", "prod", "exp", "abs"} <= set(COMPLEX)
    assert not {"maximum", "relu", "rfft", "sort", "std"} & set(COMPLEX)


@pytest.mark.parametrize(("name", "pin"), COMPLEX_CASES)
@pytest.mark.filterwarnings("ignore:Casting complex values to real:numpy.exceptions.ComplexWarning")  # astype to float64
@given(data=st.data())
def test_complex_gradient_matches_finite_differences(name, pin, data):
    """In PyTorch's convention (ember's too) a real loss L of complex z has the gradient dL/dRe z + i·dL/dIm z. ember
    differentiates real arrays, so each complex input is z = x + iy and (dL/dx, dL/dy) are read as that gradient;
    the loss is sum Re(conj(c)·out) with a complex cotangent c per output, perturbed along x and y."""
    op, arrays, attrs, wrt = _example(name, data, pin)
    drawer = Drawer(data, (dt.float64,), distinct=True)
    # imaginary parts in [-1, 1] and at least 1e-2 from 0: off the branch cuts and poles on the real axis (log,
    # sqrt, atanh, tan ...), and small enough to keep the recipes' matrices well conditioned (or Hermitian
    # positive definite, read from one triangle)
    imaginary = {i: drawer.array(arrays[i].shape, dt.float64, low=-1, high=1) for i in wrt}
    complex_arrays = [a + 1j * imaginary[i] if i in wrt else a for i, a in enumerate(arrays)]
    # no near-ties of complex moduli either
    moduli = np.sort(np.concatenate([np.abs(complex_arrays[i]).ravel() for i in wrt]))
    assume(op.symmetric_input or moduli.size < 2 or np.min(np.diff(moduli)) > 1e-3)
    loss, differentiable = _loss_function(op, complex_arrays, attrs, wrt, "numpy")
    assume(differentiable)
    hosts = [part for i in wrt for part in (arrays[i], imaginary[i])]
    analytic, numeric, atol = _gradients(lambda *parts: loss(*(x + y * 1j for x, y in zip(parts[::2], parts[1::2]))), hosts)
    pairs = [[re + 1j * im for re, im in zip(g[::2], g[1::2])] for g in (analytic, numeric)]
    _assert_close(name, op, wrt, *pairs, atol)


@pytest.mark.parametrize("name", DIFFERENTIABLE)
@given(data=st.data())
def test_a_gradient_has_its_inputs_shape_and_dtype(name, data):
    """Like PyTorch's: a float32 input gets a float32 gradient, whatever dtypes the rule computed in between."""
    op = OPS[name]
    arrays, attrs = EXAMPLES[name](Drawer(data, (dt.float32, dt.int64, dt.bool_)))
    wrt = [i for i, a in enumerate(arrays) if a.dtype == np.float32]
    assume(wrt)
    attrs = {**op.attrs, **attrs}
    device = em.autodiff("numpy")
    inputs = [em.asarray(a, device=device) for a in arrays]
    for i in wrt:
        inputs[i].requires_grad_()
    out = bind(op, tuple(inputs), attrs)
    outs = out if isinstance(out, tuple) else (out,)
    determined = range(len(outs)) if op.determined is None else op.determined
    floating = [em.real(outs[k]) if dt.isdtype(outs[k].dtype, "complex floating") else outs[k]
                for k in determined if dt.isdtype(outs[k].dtype, ("real floating", "complex floating"))]
    assume(floating)
    sum(em.sum(o) for o in floating).backward()
    for i in wrt:
        grad = inputs[i].grad
        assert grad is None or (grad.shape, grad.dtype) == (inputs[i].shape, em.float32), f"{name}: d/d input {i}"


@pytest.mark.parametrize("device_name", LOCAL_DEVICES[1:])
@pytest.mark.parametrize("name", DIFFERENTIABLE)
@given_data_per_device
def test_numpy_and_other_backends_gradients_agree(name, device_name, data):
    op, arrays, attrs, wrt = _example(name, data)
    results = []
    for device in ("numpy", device_name):
        loss, differentiable = _loss_function(op, arrays, attrs, wrt, device)
        assume(differentiable)
        grads = em.grad(loss, argnums=tuple(range(len(wrt))))(*(em.asarray(arrays[i], device=device) for i in wrt))
        results.append([em.asnumpy(g) for g in grads])
    for a, b in zip(*results):
        np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-9, equal_nan=True, err_msg=name)


def test_autodiff_device_semantics():
    d = em.device("numpy")
    a = em.autodiff(d)
    assert a.inner() is d and a == d and em.autodiff(d) is a and d.autodiff() is a
    assert str(a) == "autodiff(numpy)"
    with pytest.raises(em.DeviceError, match="already tracks gradients"):
        em.autodiff(a)
    with pytest.raises(em.DeviceError, match="do not track gradients"):
        em.ones(2).requires_grad_()
    x = em.asarray([1.0, 2.0], device=a).requires_grad_()
    plain = em.asarray([3.0, 4.0])                       # untracked arrays mix in as constants
    y = em.sum(x * plain)
    y.backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [3.0, 4.0])
    em.sum(x * x).backward()                             # gradients accumulate, like PyTorch
    np.testing.assert_array_equal(em.asnumpy(x.grad), [5.0, 8.0])
    with em.no_grad():
        z = x * 2
        x -= 0.5 * x.grad                                # a parameter update keeps x a leaf
    assert not z.requires_grad and x.requires_grad and x.grad is not None
    np.testing.assert_array_equal(em.asnumpy(x), [-1.5, -2.0])
    x.grad = None
    assert x.grad is None
    with pytest.raises(em.EmberError, match="in-place update"):
        x += 1
    assert not x.detach().requires_grad


def test_gradient_through_non_differentiable_ops_says_so():
    x = em.asarray([3.0, 1.0, 2.0], device=em.autodiff("numpy")).requires_grad_()
    i = em.argmax(x)
    with pytest.raises(em.EmberError, match="it comes from argmax, which has no gradient"):
        i.backward()
    with pytest.raises(em.EmberError, match="backward: this array does not require grad"):
        em.sum(em.asarray([1.0], device=em.autodiff("numpy"))).backward()
    with pytest.raises(NotImplementedError, match="qr: gradients are not implemented"):
        em.sum(em.linalg.qr(em.reshape(x, (3, 1)))[1]).backward()
    for output in (0, 2):  # U alone, Vh alone
        message = r"^backward: svd: gradients through U and Vh are not supported; use svdvals for S$"
        with pytest.raises(NotImplementedError, match=message):
            em.sum(em.linalg.svd(em.reshape(x, (3, 1)))[output]).backward()
    with pytest.raises(em.EmberError, match="pass a gradient for a non-scalar output"):
        (x * 2).backward()


def test_functional_grad_and_value_and_grad():
    def loss(w, data):
        x, y = data
        prediction = x @ w["weight"] + w["bias"]
        return em.mean((prediction - y) ** 2), prediction

    rng = np.random.default_rng(0)
    w = {"weight": em.asarray(rng.standard_normal((3, 1))), "bias": em.zeros(1)}
    data = (em.asarray(rng.standard_normal((8, 3))), em.asarray(rng.standard_normal((8, 1))))
    (value, prediction), grads = em.value_and_grad(loss, has_aux=True)(w, data)
    assert set(grads) == {"weight", "bias"} and grads["weight"].shape == (3, 1) and value.shape == ()
    residual = em.asnumpy(prediction) - em.asnumpy(data[1])
    np.testing.assert_allclose(em.asnumpy(grads["bias"]), [2 * residual.mean()], rtol=1e-12)
    assert em.grad(lambda v: em.sum(v * v))(em.ones(3)).device == em.device("numpy")


def test_backward_streams_to_a_peer_without_moving_gradient_bytes():
    with Peer() as peer:
        remote = em.device(peer.url())
        a = em.autodiff(remote)
        w = em.asarray(np.linspace(-1, 1, 1000), device=a).requires_grad_()
        em.sync(remote)
        before = em.stats(remote)
        loss = em.sum(em.tanh(w) ** 2)
        loss.backward()
        after = em.stats(remote)
        assert after["round_trips"] == before["round_trips"]        # nothing waited
        assert after["bytes_down"] == before["bytes_down"]          # no gradient bytes came back
        expected = 2 * np.tanh(np.linspace(-1, 1, 1000)) * (1 - np.tanh(np.linspace(-1, 1, 1000)) ** 2)
        np.testing.assert_allclose(em.asnumpy(w.grad), expected, rtol=1e-12)
        assert em.stats(remote)["round_trips"] == after["round_trips"] + 1


def test_a_training_step_with_its_backward_pass_captures_into_one_graph():
    def loss(w, x, y):
        return em.mean((em.tanh(x @ w) - y) ** 2)

    @em.jit
    def step(w, x, y):
        value, g = em.value_and_grad(loss)(w, x, y)
        return value, w - 0.1 * g

    rng = np.random.default_rng(0)
    w, x, y = (em.asarray(rng.standard_normal(s)) for s in ((4, 2), (16, 4), (16, 2)))
    value, new_w = step(w, x, y)
    eager_value, eager_g = em.value_and_grad(loss)(w, x, y)
    np.testing.assert_allclose(em.asnumpy(new_w), em.asnumpy(w - 0.1 * eager_g), rtol=1e-12)
    graph, _ = next(iter(step.graphs.values()))
    assert graph.op_counts()["tanh"] == 1 and graph.op_counts()["matmul"] == 2  # forward, and backward for w
    with Peer() as peer:
        remote = em.device(peer.url())
        r_value, r_w = step(*(t.to_device(remote) for t in (w, x, y)))
        np.testing.assert_allclose(em.asnumpy(r_w), em.asnumpy(new_w), rtol=1e-12)
        if torch_available():
            t_value, t_w = step(*(t.to_device("torch:cpu") for t in (w, x, y)))
            np.testing.assert_allclose(em.asnumpy(t_w), em.asnumpy(new_w), rtol=1e-12)


def test_setitem_gradient():
    x = em.asarray([1.0, 2.0, 3.0], device=em.autodiff("numpy")).requires_grad_()
    v = em.asarray([10.0], device=em.autodiff("numpy")).requires_grad_()
    y = x * 1.0
    y[1:2] = v * 2
    em.sum(y * em.asarray([1.0, 5.0, 7.0])).backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [1.0, 0.0, 7.0])
    np.testing.assert_array_equal(em.asnumpy(v.grad), [10.0])


def test_gradients_through_complex_intermediates():
    """Parseval: sum |fft(x)|² = n · sum x², so the gradient is 2n·x, whichever way it is written."""
    x = em.asarray(np.linspace(-1, 1, 8))
    expected = 2 * 8 * em.asnumpy(x)
    for loss in (lambda v: em.sum(em.abs(em.fft.fft(v)) ** 2),
                 lambda v: em.sum(em.real(em.fft.fft(v) * em.conj(em.fft.fft(v)))),
                 lambda v: em.sum(em.real(em.fft.fft(v)) ** 2 + em.imag(em.fft.fft(v)) ** 2),
                 lambda v: 8 * em.sum(em.abs(em.fft.ifft(v, norm="ortho") * em.sqrt(em.asarray(8.0))) ** 2) / 8):
        np.testing.assert_allclose(em.asnumpy(em.grad(loss)(x)), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
@pytest.mark.parametrize("f", [lambda m, z: m.sqrt(m.exp(z)), lambda m, z: z @ m.conj(z), lambda m, z: m.linalg.inv(z),
                               lambda m, z: m.fft.fft(z), lambda m, z: m.linalg.slogdet(z)[0], lambda m, z: m.prod(z)],
                         ids=["sqrt(exp z)", "z @ conj z", "inv", "fft", "slogdet sign", "prod"])
def test_complex_cotangents_follow_pytorchs_convention(f):
    """A complex output seeded with cotangent c gives what PyTorch's z.grad gives: the gradient of sum Re(conj(c)·out)."""
    import torch
    rng = np.random.default_rng(0)
    re, im = rng.standard_normal((2, 3, 3))
    x, y = (em.asarray(v, device=em.autodiff("numpy")).requires_grad_() for v in (re, im))
    z = torch.tensor(re + 1j * im, requires_grad=True)
    out = f(torch, z)
    c = rng.standard_normal(out.shape) + 1j * rng.standard_normal(out.shape)
    out.backward(torch.tensor(c))
    f(em, x + y * 1j).backward(em.asarray(c))
    np.testing.assert_allclose(em.asnumpy(x.grad) + 1j * em.asnumpy(y.grad), z.grad.resolve_conj().numpy(), rtol=1e-10)


def _kinks():
    import torch
    zero_base, zero_complex_base = np.array([0.0, 2.0, 3.0]), np.array([0j, 2, 3])
    return [  # (ember's function, PyTorch's, the point)
        (lambda x: em.std(x), lambda t: torch.std(t, correction=0), [2.0, 2.0, 2.0]),  # std 0: no direction
        (lambda x: em.std(x, correction=1), lambda t: torch.std(t, correction=1), [2.0, 2.0, 2.0]),
        (lambda x: em.linalg.vector_norm(x), lambda t: torch.linalg.vector_norm(t), [0.0, 0.0, 0.0]),  # the zero vector
        (lambda x: em.linalg.vector_norm(x, ord=3), lambda t: torch.linalg.vector_norm(t, ord=3), [0.0, 0.0, 0.0]),
        (lambda x: em.real(em.sign(x * (1 + 1j))), lambda t: torch.sgn(t * (1 + 1j)).real, [0.0, 1.0, -2.0]),  # sign at 0
        (lambda x: em.asarray(zero_base) ** x, lambda t: torch.tensor(zero_base) ** t, [1.5, 1.5, 0.5]),  # d/dy 0**y
        (lambda x: em.real(em.asarray(zero_complex_base) ** (x + 0j)),
         lambda t: (torch.tensor(zero_complex_base) ** (t + 0j)).real, [1.5, 1.5, 0.5]),
    ]


@pytest.mark.skipif(not torch_available(), reason="torch is not installed")
@pytest.mark.parametrize("case", range(7), ids=["std", "std correction", "norm 2", "norm 3", "complex sign", "pow exponent",
                                                 "complex pow exponent"])
def test_gradients_at_kinks_take_pytorchs_subgradient(case):
    """Where finite differences cannot judge (a kink, 0/0), ember takes the subgradient PyTorch takes."""
    assert_takes_pytorchs_subgradient(*_kinks()[case])
