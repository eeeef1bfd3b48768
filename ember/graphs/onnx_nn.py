"""ONNX lowerings of the ember.nn rows (see onnx.py): activations, losses, normalisation, convolution and
pooling with their gradient rows, attention."""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes as dt
from ..ops.nn import GELU_A, GELU_C
from ..ops.table import Meta
from .onnx_lowering import LOWERINGS, lowering, mean_of, reduce
from .onnx_math import erf64

# --- ember.nn ----------------------------------------------------------------------------------

@lowering("silu")
def _silu(b, xs, ins, outs):
    return b.node("Mul", [xs[0], b.node("Sigmoid", xs)])


def _gelu_core(b, x, dtype, approximate):
    """tanh(c (x + a x³)) for gelu's tanh form, erf(x / √2) for the exact one: both GELU rows' common part."""
    if approximate == "tanh":
        cube = b.node("Mul", [b.node("Mul", [x, x]), x])
        inner = b.node("Mul", [b.node("Add", [x, b.node("Mul", [cube, b.scalar(GELU_A, dtype)])]),
                               b.scalar(GELU_C, dtype)])
        return b.node("Tanh", [inner])
    scaled = b.node("Mul", [x, b.scalar(1 / math.sqrt(2), dtype)])
    return erf64(b, scaled) if dtype is dt.float64 else b.node("Erf", [scaled])


@lowering("gelu")
def _gelu(b, xs, ins, outs, approximate):
    x, dtype = xs[0], ins[0].dtype
    half = b.node("Mul", [x, b.scalar(0.5, dtype)])
    return b.node("Mul", [half, b.node("Add", [b.scalar(1, dtype), _gelu_core(b, x, dtype, approximate)])])


@lowering("gelu_grad")
def _gelu_grad(b, xs, ins, outs, approximate):
    """g · gelu'(x): g · 0.5 (1 + t + x (1 - t²) u') for tanh's form, g · (Φ(x) + x φ(x)) for the exact one."""
    (g, x), dtype = xs, outs[0].dtype
    mul, add = (lambda p, q: b.node("Mul", [p, q])), (lambda p, q: b.node("Add", [p, q]))
    c = lambda v: b.scalar(v, dtype)
    core, square = _gelu_core(b, x, dtype, approximate), mul(x, x)
    if approximate == "tanh":
        du = mul(add(mul(square, c(3 * GELU_A)), c(1)), c(GELU_C))
        slope = mul(add(add(mul(mul(b.node("Sub", [c(1), mul(core, core)]), du), x), core), c(1)), c(0.5))
    else:
        density = mul(b.node("Exp", [mul(square, c(-0.5))]), c(1 / math.sqrt(2 * math.pi)))
        slope = add(mul(add(core, c(1)), c(0.5)), mul(x, density))
    return mul(slope, g)


for _name, _type in (("softmax", "Softmax"), ("log_softmax", "LogSoftmax")):
    LOWERINGS[_name] = (lambda op_type: lambda b, xs, ins, outs, axis: (
        b.node(op_type, xs, axis=axis) if ins[0].ndim else _scalar_softmax(b, xs[0], op_type)))(_type)


def _scalar_softmax(b, x, op_type):
    out = b.node(op_type, [b.reshape(x, (1,))], axis=0)
    return b.reshape(out, ())


def _loss_reduce(b, x, meta, reduction):
    if reduction == "none":
        return x
    return reduce(b, "ReduceMean" if reduction == "mean" else "ReduceSum", x, tuple(range(meta.ndim)), False)


@lowering("cross_entropy")
def _cross_entropy(b, xs, ins, outs, reduction):
    logits, target = xs
    log_p = b.node("LogSoftmax", [logits], axis=1)
    picked = b.node("GatherElements", [log_p, b.node("Unsqueeze", [b.cast(target, ins[1].dtype, dt.int64), b.ints([1])])],
                    axis=1)
    losses = b.node("Neg", [b.reshape(picked, ins[1].shape)])
    return _loss_reduce(b, losses, Meta(ins[1].shape, ins[0].dtype), reduction)


@lowering("mse_loss")
def _mse_loss(b, xs, ins, outs, reduction):
    d = b.node("Sub", xs)
    return _loss_reduce(b, b.node("Mul", [d, d]), ins[0], reduction)


@lowering("linear")
def _linear(b, xs, ins, outs):
    out = b.node("MatMul", [xs[0], b.node("Transpose", [xs[1]], perm=[1, 0])])
    return b.node("Add", [out, xs[2]]) if len(xs) > 2 else out


@lowering("layer_norm")
def _layer_norm(b, xs, ins, outs, normalized_shape, eps):
    # statistics in float64, as ember's kernels (and torch) accumulate wider: a constant float32 row normalises to 0
    dtype, wide = ins[0].dtype, b.cast(xs[0], ins[0].dtype, dt.float64)
    meta = Meta(ins[0].shape, dt.float64)
    axes = tuple(range(ins[0].ndim - len(normalized_shape), ins[0].ndim))
    centred = b.node("Sub", [wide, mean_of(b, wide, meta, axes, True)])
    variance = mean_of(b, b.node("Mul", [centred, centred]), meta, axes, True)
    out = b.node("Div", [centred, b.node("Sqrt", [b.node("Add", [variance, b.scalar(eps, dt.float64)])])])
    out = b.cast(out, dt.float64, dtype)
    return b.node("Add", [b.node("Mul", [out, xs[1]]), xs[2]]) if len(xs) == 3 else out


def _pads(padding):
    return [padding[0], padding[1], padding[0], padding[1]]


def _window_positions(shape, kernel, stride, padding, dilation, groups, out_hw) -> np.ndarray:
    """For an NCHW input of ``shape`` padded by ``padding``: the flat (C·Hp·Wp) position each window element
    reads, as (groups, C/groups · kh · kw, OH · OW)."""
    _, c, h, w = shape
    hp, wp = h + 2 * padding[0], w + 2 * padding[1]
    channel = np.arange(c).reshape(groups, c // groups, 1, 1, 1, 1)
    i = np.arange(kernel[0]).reshape(1, 1, -1, 1, 1, 1)
    j = np.arange(kernel[1]).reshape(1, 1, 1, -1, 1, 1)
    oh = np.arange(out_hw[0]).reshape(1, 1, 1, 1, -1, 1)
    ow = np.arange(out_hw[1]).reshape(1, 1, 1, 1, 1, -1)
    positions = channel * hp * wp + (oh * stride[0] + i * dilation[0]) * wp + ow * stride[1] + j * dilation[1]
    return positions.reshape(groups, (c // groups) * kernel[0] * kernel[1], out_hw[0] * out_hw[1]).astype(np.int64)


def _windows(b, x, meta, kernel, stride, padding, dilation, groups, out_hw, fill=None):
    """The input's sliding windows as (N, groups, C/groups · kh · kw, OH · OW), by one Gather at positions
    ember computes: how convolution and pooling run where ONNX Runtime has no float64 kernel."""
    n, c, h, w = meta.shape
    hp, wp = h + 2 * padding[0], w + 2 * padding[1]
    pads = b.ints([0, 0, padding[0], padding[1], 0, 0, padding[0], padding[1]])
    padded = b.node("Pad", [x, pads] + ([] if fill is None else [b.scalar(fill, meta.dtype)]))
    flat = b.reshape(padded, (n, c * hp * wp))
    positions = _window_positions(meta.shape, kernel, stride, padding, dilation, groups, out_hw)
    return b.node("Gather", [flat, b.const(positions)], axis=1)


def _scatter_back(b, updates, positions, count, shape, padding, dtype):
    """Add ``updates`` (N, count) at ``positions`` (N, count) of each sample's padded C·Hp·Wp; cut the padding off."""
    n, c, h, w = shape
    hp, wp = h + 2 * padding[0], w + 2 * padding[1]
    rows = b.const(np.broadcast_to(np.arange(n, dtype=np.int64).reshape(n, 1, 1), (n, count, 1)).copy())
    indices = b.node("Concat", [rows, b.node("Unsqueeze", [positions, b.ints([2])])], axis=2)
    zeros = b.node("ConstantOfShape", [b.ints([n, c * hp * wp])],
                   value=b.onnx.numpy_helper.from_array(np.zeros(1, dt.NUMPY[dtype])))
    summed = b.reshape(b.node("ScatterND", [zeros, indices, updates], reduction="add"), (n, c, hp, wp))
    return b.node("Slice", [summed, b.ints([padding[0], padding[1]]), b.ints([padding[0] + h, padding[1] + w]), b.ints([2, 3])])


@lowering("conv2d_input_grad")
def _conv2d_input_grad(b, xs, ins, outs, shape, stride, padding, dilation, groups):
    """The adjoint of the window gather: each window element's share (weightᵀ @ g) added back where it was
    read (ScatterND with reduction="add"), then the padding cut off."""
    g, weight = xs
    n, c, h, w = shape
    o, _, kh, kw = ins[1].shape
    oh, ow = ins[0].shape[2:]
    positions = _window_positions(shape, (kh, kw), stride, padding, dilation, groups, (oh, ow)).reshape(-1)
    if n == 0 or positions.size == 0:
        return b.const(np.zeros(shape, dt.NUMPY[outs[0].dtype]))
    weights = b.node("Transpose", [b.reshape(weight, (groups, o // groups, -1))], perm=[0, 2, 1])
    shares = b.reshape(b.node("MatMul", [weights, b.reshape(g, (n, groups, o // groups, oh * ow))]), (n, positions.size))
    every = b.const(np.broadcast_to(positions, (n, positions.size)).copy())
    return _scatter_back(b, shares, every, positions.size, shape, padding, outs[0].dtype)


@lowering("max_pool2d_grad")
def _max_pool2d_grad(b, xs, ins, outs, kernel_size, stride, padding):
    """g routed to each window's first maximum (as ember's kernels), added back where it was read."""
    x, g = xs
    n, c, oh, ow = ins[1].shape
    if n * c * oh * ow == 0:
        return b.const(np.zeros(ins[0].shape, dt.NUMPY[outs[0].dtype]))
    windows = _windows(b, x, ins[0], kernel_size, stride, padding, (1, 1), c, (oh, ow), fill=-np.inf)  # (N, C, K, L)
    first = b.node("ArgMax", [windows], axis=2, keepdims=1, select_last_index=0)  # (N, C, 1, L)
    positions = _window_positions(ins[0].shape, kernel_size, stride, padding, (1, 1), c, (oh, ow))  # (C, K, L)
    everywhere = b.node("Expand", [b.const(positions), b.ints((n,) + positions.shape)])
    chosen = b.reshape(b.node("GatherElements", [everywhere, first], axis=2), (n, c * oh * ow))
    return _scatter_back(b, b.reshape(g, (n, c * oh * ow)), chosen, c * oh * ow, ins[0].shape, padding, outs[0].dtype)


@lowering("conv2d_weight_grad")
def _conv2d_weight_grad(b, xs, ins, outs, shape, stride, padding, dilation, groups):
    """Σ over the batch of g @ windowsᵀ, per group."""
    x, g = xs
    n, o, oh, ow = ins[1].shape
    if n == 0 or oh * ow == 0:
        return b.const(np.zeros(shape, dt.NUMPY[outs[0].dtype]))
    columns = _windows(b, x, ins[0], shape[2:], stride, padding, dilation, groups, (oh, ow))
    per_sample = b.node("MatMul", [b.reshape(g, (n, groups, o // groups, oh * ow)),
                                   b.node("Transpose", [columns], perm=[0, 1, 3, 2])])
    return b.reshape(reduce(b, "ReduceSum", per_sample, (0,), False), shape)


@lowering("conv2d")
def _conv2d(b, xs, ins, outs, stride, padding, dilation, groups):
    if ins[0].dtype is dt.float64:
        n, o, oh, ow = outs[0].shape
        columns = _windows(b, xs[0], ins[0], ins[1].shape[2:], stride, padding, dilation, groups, (oh, ow))
        weights = b.reshape(xs[1], (groups, o // groups, -1 if ins[1].shape[1] else 0))
        out = b.reshape(b.node("MatMul", [weights, columns]), (n, o, oh, ow))
        return b.node("Add", [out, b.reshape(xs[2], (1, o, 1, 1))]) if len(xs) > 2 else out
    return b.node("Conv", xs, strides=list(stride), pads=_pads(padding), dilations=list(dilation), group=groups,
                  kernel_shape=list(ins[1].shape[2:]))


@lowering("max_pool2d")
def _max_pool(b, xs, ins, outs, kernel_size, stride, padding):
    return b.node("MaxPool", xs, kernel_shape=list(kernel_size), strides=list(stride), pads=_pads(padding))


@lowering("avg_pool2d")
def _avg_pool(b, xs, ins, outs, kernel_size, stride, padding):
    if ins[0].dtype is dt.float64:
        n, c, oh, ow = outs[0].shape
        columns = _windows(b, xs[0], ins[0], kernel_size, stride, padding, (1, 1), c, (oh, ow))
        total = reduce(b, "ReduceSum", columns, (2,), False)
        window = b.scalar(kernel_size[0] * kernel_size[1], dt.float64)
        return b.reshape(b.node("Div", [total, window]), (n, c, oh, ow))
    return b.node("AveragePool", xs, kernel_shape=list(kernel_size), strides=list(stride), pads=_pads(padding),
                  count_include_pad=1)


@lowering("scaled_dot_product_attention")
def _attention(b, xs, ins, outs, is_causal, scale):
    q, k, v = xs[:3]
    dtype, length, keys = ins[0].dtype, ins[0].shape[-2], ins[1].shape[-2]
    scale = 1 / math.sqrt(ins[0].shape[-1]) if scale is None else scale
    perm = list(range(ins[1].ndim - 2)) + [ins[1].ndim - 1, ins[1].ndim - 2]
    scores = b.node("Mul", [b.node("MatMul", [q, b.node("Transpose", [k], perm=perm)]), b.scalar(scale, dtype)])
    if len(xs) > 3:
        scores = b.node("Add", [scores, xs[3]])
    if is_causal:
        keep = b.const(np.tril(np.ones((length, keys), dtype=bool)))
        scores = b.node("Where", [keep, scores, b.scalar(-np.inf, dtype)])
    return b.node("MatMul", [b.node("Softmax", [scores], axis=-1), v])
