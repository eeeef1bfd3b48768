"""NumPy kernels of the nn rows: vectorised, with sliding windows + tensordot for convolution (linear,
layer_norm and embedding are the generic table's)."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..ops.nn import GELU_A, GELU_C
from .generic import attention

_erf = np.frompyfunc(math.erf, 1, 1)


def _sigmoid(x):
    e = np.exp(-np.abs(x))  # stable on both sides
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


def _gelu(x, approximate):
    if approximate == "tanh":  # 0.5 x (1 + tanh(c (x + a x³))), in one buffer: the same roundings, one allocation
        t = np.multiply(x, x, out=np.empty_like(x))
        t *= x
        t *= GELU_A
        t += x
        t *= GELU_C
        np.tanh(t, out=t)
        t += 1
        t *= x
        t *= 0.5  # exact: halving (0.5 x first, as written above, rounds the same)
        return t
    return (0.5 * x * (1 + np.asarray(_erf(x / math.sqrt(2)), dtype=x.dtype))).astype(x.dtype, copy=False)


def _gelu_grad(g, x, approximate):
    """g · gelu'(x) in two buffers, the result's and one more: the table's rule written out of ops would make
    about 17 passes, and each fresh buffer of a few hundred KiB costs about as much as a pass in page faults."""
    if approximate == "tanh":
        # gelu' = 0.5 (1 + t) + 0.5 x u' (1 - t²), t = tanh(u), u = c (x + a x³), u' = c (1 + 3 a x²). With
        # W = (1 - t) / 2 = 1 / (1 + e^(2u)) that is (1 - W)(1 + 2 x u' W): W, then 1 - W, in one buffer
        out = np.multiply(x, x, out=np.empty_like(x))
        w = np.multiply(out, GELU_A, out=np.empty_like(x))
        w += 1
        w *= x
        w *= 2 * GELU_C
        with np.errstate(over="ignore"):  # e^(2u) = inf: W = 0, as tanh(u) = 1
            np.exp(w, out=w)
        w += 1
        np.divide(1, w, out=w)  # twice as fast as np.reciprocal here (SIMD division)
        out *= 3 * GELU_A
        out += 1
        out *= 2 * GELU_C
        out *= x
        out *= w
        out += 1
        np.subtract(1, w, out=w)
        out *= w
        out *= g
        return out
    cdf = 0.5 * (1 + np.asarray(_erf(x / math.sqrt(2)), dtype=x.dtype))  # Φ(x) + x φ(x)
    return (g * (cdf + x * np.exp(-0.5 * (x * x)) / math.sqrt(2 * math.pi))).astype(x.dtype, copy=False)


def _log_softmax(x, axis):
    shifted = x - np.max(x, axis=axis, keepdims=True) if x.size else x
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _softmax(x, axis):
    return np.exp(_log_softmax(x, axis))


def _reduce(values, reduction):
    if reduction == "mean":
        return np.asarray(values.mean() if values.size else np.nan, dtype=values.dtype)
    if reduction == "sum":
        return np.asarray(values.sum(), dtype=values.dtype)
    return values


def _cross_entropy(logits, target, reduction):
    log_p = _log_softmax(logits, -1)
    picked = -np.take_along_axis(log_p, target[:, None].astype(np.int64), axis=1)[:, 0]
    return _reduce(picked, reduction)


GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants
_MIX1, _MIX2 = np.uint64(MIX1), np.uint64(MIX2)


def uniform_hash(size: int, seed: int) -> np.ndarray:
    """splitmix64 of (seed, element index) → uniform [0, 1) float64 (the torch kernel matches bit for bit)."""
    z = np.arange(size, dtype=np.uint64) + np.uint64(seed * GOLDEN % (1 << 64))
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _dropout_mask(shape, p, seed):
    return uniform_hash(math.prod(shape), seed).reshape(shape) >= p


def _windows(x, kernel, stride, padding, dilation, fill=0.0):
    """(N, C, OH, OW, KH, KW) views of the padded input."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    if ph or pw:
        x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=fill)
    span = ((kh - 1) * dh + 1, (kw - 1) * dw + 1)
    view = sliding_window_view(x, span, axis=(2, 3))
    return view[:, :, ::sh, ::sw, ::dh, ::dw]


def _conv2d(x, weight, *bias, stride, padding, dilation, groups):
    o, cg, kh, kw = weight.shape
    win = _windows(x, (kh, kw), stride, padding, dilation)
    parts = []
    og = o // groups
    for k in range(groups):
        part = np.tensordot(win[:, k * cg:(k + 1) * cg], weight[k * og:(k + 1) * og], axes=([1, 4, 5], [1, 2, 3]))
        parts.append(part)  # (N, OH, OW, og)
    out = np.concatenate(parts, axis=-1).transpose(0, 3, 1, 2)
    if bias:
        out = out + bias[0][None, :, None, None]
    return np.ascontiguousarray(out)


def _scatter_windows(cols, shape, kernel, stride, padding, dilation):
    """The adjoint of _windows: add (N, C, OH, OW, KH, KW) values back into an (N, C, H, W) input."""
    n, c, h, w = shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    oh, ow = cols.shape[2], cols.shape[3]
    out = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=cols.dtype)
    for i in range(kh):
        for j in range(kw):
            out[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw] += cols[:, :, :, :, i, j]
    return out[:, :, ph:ph + h, pw:pw + w]


def _conv2d_input_grad(g, weight, shape, stride, padding, dilation, groups):
    o, cg, kh, kw = weight.shape
    og = o // groups
    cols = []
    for k in range(groups):
        # (N, og, OH, OW) x (og, cg, KH, KW) -> (N, OH, OW, cg, KH, KW)
        cols.append(np.tensordot(g[:, k * og:(k + 1) * og], weight[k * og:(k + 1) * og], axes=([1], [0])))
    cols = np.concatenate(cols, axis=3).transpose(0, 3, 1, 2, 4, 5)
    return _scatter_windows(cols, shape, (kh, kw), stride, padding, dilation)


def _conv2d_weight_grad(x, g, shape, stride, padding, dilation, groups):
    o, cg, kh, kw = shape
    og = o // groups
    win = _windows(x, (kh, kw), stride, padding, dilation)
    parts = [np.tensordot(g[:, k * og:(k + 1) * og], win[:, k * cg:(k + 1) * cg], axes=([0, 2, 3], [0, 2, 3]))
             for k in range(groups)]
    return np.concatenate(parts, axis=0)


def _combine_windows(x, kernel_size, stride, padding, fill, combine):
    """Each window of the padded input combined into one value, a window position at a time, in
    place: a reduction over the window view instead (``.max(axis=(4, 5))``) took 2–30× as long
    and, in NumPy 2.2, held a copy of the windows besides."""
    win = _windows(x, kernel_size, stride, padding, (1, 1), fill=fill)
    out = np.array(win[..., 0, 0], order="C")
    for i in range(win.shape[4]):
        for j in range(win.shape[5]):
            if i or j:
                combine(out, win[..., i, j], out=out)
    return out


def _max_pool2d(x, kernel_size, stride, padding):
    return _combine_windows(x, kernel_size, stride, padding, -np.inf, np.maximum)


def _max_pool2d_grad(x, g, kernel_size, stride, padding):
    win = _windows(x, kernel_size, stride, padding, (1, 1), fill=-np.inf)
    n, c, oh, ow, kh, kw = win.shape
    first = win.reshape(n, c, oh, ow, kh * kw).argmax(axis=-1)  # the first maximum gets the gradient
    cols = np.zeros((n, c, oh, ow, kh * kw), dtype=g.dtype)
    np.put_along_axis(cols, first[..., None], g[..., None], axis=-1)
    return _scatter_windows(cols.reshape(n, c, oh, ow, kh, kw), x.shape, kernel_size, stride, padding, (1, 1))


def _avg_pool2d(x, kernel_size, stride, padding):
    out = _combine_windows(x, kernel_size, stride, padding, 0.0, np.add)
    out /= kernel_size[0] * kernel_size[1]
    return out


KERNELS = {
    "relu": lambda x: np.maximum(x, 0).astype(x.dtype, copy=False),
    "sigmoid": _sigmoid,
    "silu": lambda x: x * _sigmoid(x),
    "gelu": _gelu,
    "gelu_grad": _gelu_grad,
    "softmax": _softmax,
    "log_softmax": _log_softmax,
    "cross_entropy": _cross_entropy,
    "mse_loss": lambda x, y, reduction: _reduce((x - y) ** 2, reduction),
    "dropout_mask": _dropout_mask,
    "conv2d": _conv2d,
    "conv2d_input_grad": _conv2d_input_grad,
    "conv2d_weight_grad": _conv2d_weight_grad,
    "max_pool2d": _max_pool2d,
    "max_pool2d_grad": _max_pool2d_grad,
    "avg_pool2d": _avg_pool2d,
    "scaled_dot_product_attention": attention(np, _softmax),
}
