"""ember.nn against textbook definitions written here in plain NumPy and math (loops where that is
the definition), so a kernel that is wrong on every backend alike still fails."""

from __future__ import annotations

import math

import numpy as np
import pytest

import ember as em

from .conftest import LOCAL_DEVICES

pytestmark = pytest.mark.parametrize("device", LOCAL_DEVICES)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def on(device, *arrays):
    return tuple(None if a is None else em.asarray(a, device=device) for a in arrays)


def assert_close(actual, expected):
    actual = em.asnumpy(actual)
    assert actual.shape == np.shape(expected) and actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


def elementwise(f):
    return np.vectorize(f, otypes=[np.float64])


X = np.concatenate([np.random.default_rng(1).standard_normal(40) * 3, [0.0, -30.0, 30.0, 1e-8, -1e-8]]).reshape(5, 9)
SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
ACTIVATIONS = {
    "relu": ({}, elementwise(lambda v: v if v > 0 else 0.0)),
    "sigmoid": ({}, elementwise(lambda v: 1 / (1 + math.exp(-v)))),
    "silu": ({}, elementwise(lambda v: v / (1 + math.exp(-v)))),
    "gelu": ({}, elementwise(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))),  # default: exact, via erf
    "gelu-tanh": ({"approximate": "tanh"},
                  elementwise(lambda v: 0.5 * v * (1 + math.tanh(SQRT_2_OVER_PI * (v + 0.044715 * v ** 3))))),
}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activations(device, name):
    attrs, reference = ACTIVATIONS[name]
    assert_close(getattr(em.nn, name.split("-")[0])(*on(device, X), **attrs), reference(X))


GELU_SLOPES = {  # d/dv of the activations above, by hand: Φ(v) + v φ(v); the tanh form by the chain rule
    "none": elementwise(lambda v: 0.5 * (1 + math.erf(v / math.sqrt(2))) + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi)),
    "tanh": elementwise(lambda v: 0.5 * (1 + math.tanh(SQRT_2_OVER_PI * (v + 0.044715 * v ** 3)))
                        + 0.5 * v * (1 - math.tanh(SQRT_2_OVER_PI * (v + 0.044715 * v ** 3)) ** 2)
                        * SQRT_2_OVER_PI * (1 + 3 * 0.044715 * v ** 2)),
}


@pytest.mark.parametrize("approximate", GELU_SLOPES)
def test_gelu_grad(device, rng, approximate):
    """The cotangent row gelu's gradient runs on: g · gelu'(x)."""
    g = rng.standard_normal(X.shape)
    assert_close(em.nn.gelu_grad(*on(device, g, X), approximate=approximate), g * GELU_SLOPES[approximate](X))


def softmax_ref(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def log_softmax_ref(x, axis):
    m = x.max(axis=axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axis, keepdims=True))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_and_log_softmax(device, rng, axis):
    x = rng.standard_normal((3, 4, 5)) * 4 + 100  # the shift by the max matters: exp(100+) alone is far off
    (ex,) = on(device, x)
    assert_close(em.nn.softmax(ex, axis=axis), softmax_ref(x, axis))
    assert_close(em.nn.log_softmax(ex, axis=axis), log_softmax_ref(x, axis))
    np.testing.assert_allclose(em.asnumpy(em.nn.softmax(ex, axis=axis)).sum(axis=axis), 1.0, rtol=1e-14)


REDUCE = {"mean": np.mean, "sum": np.sum, "none": lambda v: v}


@pytest.mark.parametrize("n, c", [(5, 3), (4, 7)])
@pytest.mark.parametrize("reduction", REDUCE)
def test_cross_entropy(device, rng, n, c, reduction):
    """(N, C) logits, (N,) class indices: -log softmax(logits[i])[target[i]], over the class axis."""
    logits, target = rng.standard_normal((n, c)) * 3, rng.integers(0, c, n)
    per_row = np.array([math.log(math.fsum(math.exp(v) for v in row)) - row[t] for row, t in zip(logits, target)])
    assert_close(em.nn.cross_entropy(*on(device, logits, target), reduction=reduction), REDUCE[reduction](per_row))
    if reduction == "mean":
        assert_close(em.nn.cross_entropy(*on(device, logits, target)), per_row.mean())  # the default
    # the gradient: softmax minus the one-hot target, per row, over N for the mean
    x = em.asarray(logits, device=em.autodiff(device)).requires_grad_()
    em.sum(em.nn.cross_entropy(x, em.asarray(target, device=x.device), reduction=reduction)).backward()
    assert_close(x.grad, (softmax_ref(logits, 1) - np.eye(c)[target]) / (n if reduction == "mean" else 1))


@pytest.mark.parametrize("reduction", REDUCE)
def test_mse_loss(device, rng, reduction):
    x, y = rng.standard_normal((2, 3, 4))
    assert_close(em.nn.mse_loss(*on(device, x, y), reduction=reduction), REDUCE[reduction]((x - y) ** 2))


@pytest.mark.parametrize("bias", [False, True])
def test_linear(device, rng, bias):
    """out[..., o] = Σ_i x[..., i]·W[o, i] + b[o], with W shaped (out, in)."""
    x, w, b = rng.standard_normal((2, 3, 4)), rng.standard_normal((5, 4)), rng.standard_normal(5) if bias else None
    expected = np.stack([(x * w[o]).sum(-1) + (b[o] if bias else 0) for o in range(5)], axis=-1)
    assert_close(em.nn.linear(*on(device, x, w, b)), expected)


@pytest.mark.parametrize("normalized_shape, eps, affine", [((5,), 1e-5, False), ((4, 5), 0.1, True), ((5,), 1e-5, True)])
def test_layer_norm(device, rng, normalized_shape, eps, affine):
    """(x - mean) / sqrt(biased variance + eps) over the trailing axes, then · weight + bias."""
    x = rng.standard_normal((3, 4, 5)) * 2 + 1
    weight, bias = (rng.standard_normal(normalized_shape), rng.standard_normal(normalized_shape)) if affine else (None, None)
    rows = x.reshape(-1, math.prod(normalized_shape))
    expected = np.array([(r - r.mean()) / math.sqrt(((r - r.mean()) ** 2).mean() + eps) for r in rows]).reshape(x.shape)
    if affine:
        expected = expected * weight + bias
    ex, ew, eb = on(device, x, weight, bias)
    assert_close(em.nn.layer_norm(ex, normalized_shape, ew, eb, eps=eps), expected)


def test_embedding(device, rng):
    indices, weight = rng.integers(0, 6, (3, 4)), rng.standard_normal((6, 3))
    expected = np.empty(indices.shape + (3,))
    for idx in np.ndindex(indices.shape):
        expected[idx] = weight[indices[idx]]
    assert_close(em.nn.embedding(*on(device, indices, weight)), expected)


def pair(v):
    return (v, v) if isinstance(v, int) else v


def conv2d_ref(x, w, b, stride, padding, dilation, groups):
    """Cross-correlation, one output element at a time; out-of-range taps read zero padding."""
    (n, _, h, wd), (o, cg, kh, kw) = x.shape, w.shape
    (sh, sw), (ph, pw), (dh, dw) = pair(stride), pair(padding), pair(dilation)
    out = np.zeros((n, o, (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1))
    for bi, oc, i, j in np.ndindex(out.shape):
        first = oc // (o // groups) * cg  # the group's first input channel
        for ci, ki, kj in np.ndindex(cg, kh, kw):
            r, s = i * sh - ph + ki * dh, j * sw - pw + kj * dw
            if 0 <= r < h and 0 <= s < wd:
                out[bi, oc, i, j] += x[bi, first + ci, r, s] * w[oc, ci, ki, kj]
        out[bi, oc, i, j] += 0 if b is None else b[oc]
    return out


CONVS = [  # (x shape, weight shape, bias, stride, padding, dilation, groups)
    ((2, 3, 6, 5), (4, 3, 3, 3), False, 1, 0, 1, 1),
    ((1, 4, 7, 6), (6, 2, 3, 2), True, 2, 1, 1, 2),
    ((2, 4, 8, 7), (4, 1, 2, 3), True, (1, 2), (2, 1), (2, 1), 4),
]


@pytest.mark.parametrize("xs, ws, bias, stride, padding, dilation, groups", CONVS)
def test_conv2d(device, rng, xs, ws, bias, stride, padding, dilation, groups):
    x, w, b = rng.standard_normal(xs), rng.standard_normal(ws), rng.standard_normal(ws[0]) if bias else None
    out = em.nn.conv2d(*on(device, x, w, b), stride=stride, padding=padding, dilation=dilation, groups=groups)
    assert_close(out, conv2d_ref(x, w, b, stride, padding, dilation, groups))


def pool_ref(x, kernel, stride, padding, reduce):
    """Each window's in-range values reduced; avg divides by the full window (padding counts as zeros)."""
    (kh, kw), (ph, pw) = pair(kernel), pair(padding)
    sh, sw = pair(kernel if stride is None else stride)
    n, c, h, w = x.shape
    out = np.empty((n, c, (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1))
    for bi, ci, i, j in np.ndindex(out.shape):
        taps = [x[bi, ci, r, s] for r in range(i * sh - ph, i * sh - ph + kh) for s in range(j * sw - pw, j * sw - pw + kw)
                if 0 <= r < h and 0 <= s < w]
        out[bi, ci, i, j] = max(taps) if reduce == "max" else sum(taps) / (kh * kw)
    return out


@pytest.mark.parametrize("kernel, stride, padding", [(2, None, 0), (3, 2, 1), ((2, 3), (1, 2), (1, 0))])
@pytest.mark.parametrize("reduce", ["max", "avg"])
def test_pool2d(device, rng, kernel, stride, padding, reduce):
    x = rng.standard_normal((2, 3, 7, 6)) - 3  # mostly negative: a max that let zero padding win would show
    out = getattr(em.nn, f"{reduce}_pool2d")(*on(device, x), kernel, stride, padding)
    assert_close(out, pool_ref(x, kernel, stride, padding, reduce))


def attention_ref(q, k, v, mask, causal, scale):
    """For each query i: weights ∝ exp(q_i·k_j·scale + mask_ij) over keys j (j ≤ i if causal); out_i = Σ_j w_ij v_j."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = np.empty(q.shape[:-1] + v.shape[-1:])
    for idx in np.ndindex(q.shape[:-1]):
        *batch, i = idx
        keys = range(i + 1) if causal else range(k.shape[-2])
        scores = np.array([q[idx] @ k[(*batch, j)] * scale + (0 if mask is None else mask[i, j]) for j in keys])
        weights = np.exp(scores - scores.max())
        out[idx] = sum(wj * v[(*batch, j)] for wj, j in zip(weights / weights.sum(), keys))
    return out


@pytest.mark.parametrize("source, masked, causal, scale", [(6, False, False, None), (6, True, False, 0.5),
                                                            (4, False, True, None), (4, False, True, 0.3)])
def test_scaled_dot_product_attention(device, rng, source, masked, causal, scale):
    q, k, v = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, source, 5)), rng.standard_normal((2, 3, source, 7))
    mask = rng.uniform(-3, 0, (4, source)) if masked else None
    out = em.nn.scaled_dot_product_attention(*on(device, q, k, v, mask), is_causal=causal, scale=scale)
    assert_close(out, attention_ref(q, k, v, mask, causal, scale))


@pytest.mark.parametrize("p", [0.25, 0.6])
def test_dropout(device, rng, p):
    """Kept elements are x / (1 - p), the rest zero, kept with frequency 1 - p; the seeded mask is the same on every device."""
    x = rng.uniform(0.5, 2, (100, 100)) * rng.choice([-1, 1], (100, 100))  # no zeros: a zero output means dropped
    (ex,) = on(device, x)
    mask = em.asnumpy(em.nn.dropout_mask(x.shape, p, seed=7, device=device))
    out = em.asnumpy(em.nn.dropout(ex, p, seed=7))
    np.testing.assert_array_equal(mask, em.asnumpy(em.nn.dropout_mask(x.shape, p, seed=7, device="numpy")))
    np.testing.assert_array_equal(out != 0, mask)
    np.testing.assert_allclose(out[mask], x[mask] / (1 - p), rtol=1e-15, atol=0)
    assert abs(mask.mean() - (1 - p)) < 0.02
    assert (mask != em.asnumpy(em.nn.dropout_mask(x.shape, p, seed=8, device=device))).any()
    for same in (em.nn.dropout(ex, p, seed=7, training=False), em.nn.dropout(ex, 0.0, seed=7)):
        np.testing.assert_array_equal(em.asnumpy(same), x)
