"""Neural-network operations (``ember.nn``): activations, losses, linear, normalisation,
dropout masks, embeddings, convolution, pooling and attention — rows like any other, with meta
and gradient rules beside them and kernels in every backend (torch: torch.nn.functional)."""

from __future__ import annotations

import math

from .. import dtypes as dt
from ..errors import ArgumentError, ShapeError
from .gradients import NotDifferentiable, scatter_back, unbroadcast
from .table import (
    NO_GRADIENT,
    REQUIRED,
    Meta,
    Op,
    as_int,
    as_shape,
    broadcasts_to,
    define,
    fmt_shape,
    normalize_axis,
    require,
    require_ndim,
)

FLOAT = "real floating"


def _activation(name, doc, attrs=None, *, grad, canon=None):
    def meta(x, **_):
        require(x.dtype, FLOAT)
        return Meta(x.shape, x.dtype)

    define(Op(name, ("x",), attrs or {}, meta, canon, family="nn", lift=True, grad=grad, doc=doc))


def _sigmoid(xp, x):
    return 1 / (1 + xp.exp(-x))


_activation("relu", "max(x, 0).", grad=lambda xp, g, out, x: (xp.where(x > 0, g, 0.0),))
_activation("sigmoid", "1 / (1 + exp(-x)), computed stably.", grad=lambda xp, g, out, x: (g * out * (1 - out),))
_activation("silu", "x · sigmoid(x).",
            grad=lambda xp, g, out, x: (g * (_sigmoid(xp, x) * (1 + x * (1 - _sigmoid(xp, x)))),))

# GELU's gradient is its own row, gelu_grad(g, x) = g · gelu'(x): written out of the table's ops it is about 17
# elementwise passes and a second tanh, where a kernel (torch's gelu_backward, NumPy's in two buffers) makes a few
_GELU_APPROXIMATIONS = ("none", "tanh")
_SQRT_2PI = math.sqrt(2 * math.pi)
GELU_C, GELU_A = math.sqrt(2 / math.pi), 0.044715  # tanh's form: 0.5 x (1 + tanh(c (x + a x³)))


def _gelu_canon(*metas, approximate):
    if approximate not in _GELU_APPROXIMATIONS:
        raise ArgumentError(f"approximate must be one of {_GELU_APPROXIMATIONS}, got {approximate!r}")
    return None


_activation("gelu", "x · Φ(x), or its tanh approximation with approximate='tanh'.", attrs={"approximate": "none"},
            canon=_gelu_canon, grad=lambda xp, g, out, x, approximate: (xp.nn.gelu_grad(g, x, approximate=approximate),))


def _gelu_grad_meta(g, x, approximate):
    require(g.dtype, FLOAT, "g")  # and so x: the namespace gave both one dtype
    if g.shape != x.shape:
        raise ShapeError(f"g {fmt_shape(g.shape)} must have the shape of x {fmt_shape(x.shape)}")
    return Meta(x.shape, g.dtype)


def _gelu_second_derivative(xp, x, approximate):
    if approximate == "tanh":  # (1 - t²)(u' - x t u'² + 3 c a x²), t = tanh(u), u = c (x + a x³)
        t = xp.tanh(GELU_C * (x + GELU_A * (x * x * x)))
        du = GELU_C * (1 + 3 * GELU_A * (x * x))
        return (1 - t * t) * (du - x * t * (du * du) + 3 * GELU_C * GELU_A * (x * x))
    return xp.exp(-0.5 * (x * x)) / _SQRT_2PI * (2 - x * x)  # φ(x) (2 - x²)


def _gelu_grad_grad(xp, gg, out, g, x, approximate):
    return (xp.nn.gelu_grad(gg, x, approximate=approximate), gg * g * _gelu_second_derivative(xp, x, approximate))


define(Op("gelu_grad", ("g", "x"), {"approximate": "none"}, _gelu_grad_meta, _gelu_canon, family="nn",
          promote_inputs=True, grad=_gelu_grad_grad,
          doc="The cotangent of gelu's input for output cotangent g: g · gelu'(x), in gelu's approximation."))


def _axis_meta(x, axis):
    require(x.dtype, FLOAT)
    require_ndim(x, 1)
    normalize_axis(axis, x.ndim)
    return Meta(x.shape, x.dtype)


def _softmax_grad(xp, g, out, x, axis):
    return (out * (g - xp.sum(g * out, axis=axis, keepdims=True)),)


def _log_softmax_grad(xp, g, out, x, axis):
    return (g - xp.exp(out) * xp.sum(g, axis=axis, keepdims=True),)


for _name, _grad, _doc in (("softmax", _softmax_grad, "exp(x) / sum(exp(x)) along axis, computed stably."),
                           ("log_softmax", _log_softmax_grad, "x - logsumexp(x) along axis, computed stably.")):
    define(Op(_name, ("x",), {"axis": -1}, _axis_meta, lambda x, axis: {"axis": normalize_axis(axis, max(x.ndim, 1))},
              family="nn", positional=("axis",), lift=True, grad=_grad, doc=_doc))

_REDUCTIONS = ("mean", "sum", "none")


def _reduced(shape, reduction):
    if reduction not in _REDUCTIONS:
        raise ArgumentError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return () if reduction != "none" else shape


def _cross_entropy_meta(logits, target, reduction):
    require(logits.dtype, FLOAT, "logits")
    require(target.dtype, "integral", "target")
    if logits.ndim != 2 or target.shape != logits.shape[:1]:
        raise ShapeError(f"logits must be (N, C) and target (N,), got {fmt_shape(logits.shape)} and {fmt_shape(target.shape)}")
    return Meta(_reduced(target.shape, reduction), logits.dtype)


def _cross_entropy_grad(xp, g, out, logits, target, reduction):
    p = xp.nn.softmax(logits, axis=-1)
    onehot = xp.astype(target[:, None] == xp.arange(logits.shape[1], device=logits.device)[None, :], logits.dtype)
    scale = g[:, None] if reduction == "none" else g / (logits.shape[0] if reduction == "mean" else 1)
    return ((p - onehot) * scale, None)


define(Op("cross_entropy", ("logits", "target"), {"reduction": "mean"}, _cross_entropy_meta, family="nn",
          grad=_cross_entropy_grad, doc="Cross-entropy of (N, C) logits against (N,) class indices."))


def _mse_meta(x, y, reduction):
    require(x.dtype, FLOAT)
    if x.shape != y.shape or x.dtype is not y.dtype:
        raise ShapeError(f"inputs must share shape and dtype, got {fmt_shape(x.shape)} {x.dtype} "
                         f"and {fmt_shape(y.shape)} {y.dtype}")
    return Meta(_reduced(x.shape, reduction), x.dtype)


def _mse_grad(xp, g, out, x, y, reduction):
    scale = g if reduction == "none" else g / (math.prod(x.shape) if reduction == "mean" else 1)
    d = 2 * (x - y) * scale
    return (d, -d)


define(Op("mse_loss", ("x", "y"), {"reduction": "mean"}, _mse_meta, family="nn", promote_inputs=True, grad=_mse_grad,
          doc="Mean (or sum, or elementwise) squared error."))


def _linear_meta(x, weight, *bias):
    require(x.dtype, FLOAT)
    require_ndim(x, 1)
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1] or weight.dtype is not x.dtype:
        raise ShapeError(f"weight must be (out, {x.shape[-1]}) {x.dtype} for input {fmt_shape(x.shape)}, "
                         f"got {fmt_shape(weight.shape)} {weight.dtype}")
    if bias and (bias[0].shape != weight.shape[:1] or bias[0].dtype is not x.dtype):
        raise ShapeError(f"bias must be ({weight.shape[0]},) {x.dtype} for input {fmt_shape(x.shape)} and weight "
                         f"{fmt_shape(weight.shape)}, got {fmt_shape(bias[0].shape)} {bias[0].dtype}")
    return Meta(x.shape[:-1] + weight.shape[:1], x.dtype)


def _linear_grad(xp, g, out, x, weight, *bias):
    gx = g @ weight
    gw = xp.tensordot(g, x, axes=(tuple(range(g.ndim - 1)), tuple(range(x.ndim - 1))))
    gb = (xp.sum(g, axis=tuple(range(g.ndim - 1))),) if bias else ()
    return (gx, gw) + gb


define(Op("linear", ("x", "weight", "*bias"), {}, _linear_meta, family="nn", promote_inputs=True, grad=_linear_grad,
          flops=lambda ins, outs, attrs: 2 * math.prod(outs[0].shape) * ins[0].shape[-1],
          doc="x @ weight.T + bias (weight is (out, in), as in PyTorch)."))


def _layer_norm_canon(x, *affine, normalized_shape, eps):
    return {"normalized_shape": as_shape(normalized_shape)}


def _layer_norm_meta(x, *affine, normalized_shape, eps):
    require(x.dtype, FLOAT)
    k = len(normalized_shape)
    if not k or x.shape[x.ndim - k:] != normalized_shape:
        raise ShapeError(f"normalized_shape {fmt_shape(normalized_shape)} must end the input's shape {fmt_shape(x.shape)}")
    if len(affine) not in (0, 2) or any(a.shape != normalized_shape for a in affine):
        raise ShapeError(f"weight and bias must both be given, shaped {fmt_shape(normalized_shape)}, got "
                         f"{', '.join(fmt_shape(a.shape) for a in affine)} (input {fmt_shape(x.shape)})")
    return Meta(x.shape, x.dtype)


def layer_norm_cotangents(xp, g, x, mean, inv, weight, axes: int, affine: bool):
    """Layer norm's cotangents over ``x``'s last ``axes`` axes from its statistics (``mean`` and ``inv``,
    1/σ, kept as the reductions left them): ``gx``, then, with ``affine``, those of the weight (None:
    a scale of 1) and the bias. The row's rule and ember.torch's ``native_layer_norm_backward``,
    which PyTorch hands the statistics, share it."""
    normalized = tuple(range(x.ndim - axes, x.ndim))
    xhat = (x - mean) * inv
    gy = g * weight if weight is not None else g
    gx = inv * (gy - xp.mean(gy, axis=normalized, keepdims=True) - xhat * xp.mean(gy * xhat, axis=normalized, keepdims=True))
    if not affine:
        return (gx,)
    lead = tuple(range(x.ndim - axes))
    return (gx, xp.sum(g * xhat, axis=lead), xp.sum(g, axis=lead))


def _layer_norm_grad(xp, g, out, x, *affine, normalized_shape, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = xp.mean(x, axis=axes, keepdims=True)
    centred = x - mean
    inv = 1 / xp.sqrt(xp.mean(centred * centred, axis=axes, keepdims=True) + eps)
    return layer_norm_cotangents(xp, g, x, mean, inv, affine[0] if affine else None, len(axes), bool(affine))


define(Op("layer_norm", ("x", "*affine"), {"normalized_shape": REQUIRED, "eps": 1e-5}, _layer_norm_meta, _layer_norm_canon,
          family="nn", promote_inputs=True, grad=_layer_norm_grad,
          doc="Normalise the trailing normalized_shape axes to zero mean and unit variance, then scale and shift."))


def _dropout_mask_canon(shape, p, seed):
    seed = as_int(seed, "seed")
    if not 0 <= p < 1:
        raise ArgumentError(f"p must be in [0, 1), got {p}")
    return {"shape": as_shape(shape), "seed": seed % (1 << 63)}


define(Op("dropout_mask", (), {"shape": REQUIRED, "p": 0.5, "seed": REQUIRED}, lambda shape, p, seed: Meta(shape, dt.bool_),
          _dropout_mask_canon, family="nn", grad=NO_GRADIENT,
          doc="A boolean keep-mask with P(keep) = 1 - p, a pure function of (shape, p, seed): the same "
              "on every backend and device (a counter-based hash, not a global random state)."))


def _embedding_meta(indices, weight):
    require(indices.dtype, "integral", "indices")
    require(weight.dtype, FLOAT, "weight")
    if weight.ndim != 2:
        raise ShapeError(f"weight must be (num_embeddings, dim), got {fmt_shape(weight.shape)} "
                         f"(indices {fmt_shape(indices.shape)})")
    return Meta(indices.shape + weight.shape[1:], weight.dtype)


def _embedding_grad(xp, g, out, indices, weight):
    flat = xp.reshape(indices, (-1,))
    return (None, scatter_back(xp, g, weight, lambda positions: xp.reshape(xp.take(positions, flat, axis=0), out.shape)))


define(Op("embedding", ("indices", "weight"), {}, _embedding_meta, family="nn", grad=_embedding_grad,
          doc="Rows of weight picked by integer indices."))


# --- convolution and pooling (NCHW) ------------------------------------------------------------------------
# conv2d_input_grad, conv2d_weight_grad and max_pool2d_grad are the cotangent rows of conv2d and max_pool2d

def _second_order(name):
    return NotDifferentiable(f"{name}: second-order gradients are not supported")


def _pair(value, what):
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    try:
        a, b = value
        return (as_int(a, what), as_int(b, what))
    except (TypeError, ValueError):
        raise ArgumentError(f"{what} must be an int or a pair of ints, got {value!r}") from None


def _out_size(x, axis, kernel, stride, padding, dilation, weight=None):
    """The output length along ``axis`` (2: height, 3: width) of a window sliding over input ``x``."""
    size = x.shape[axis]
    out = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    if out < 1:
        shapes = fmt_shape(x.shape) + ("" if weight is None else f" and weight {fmt_shape(weight.shape)}")
        raise ShapeError(f"the {('height', 'width')[axis - 2]} window does not fit input {shapes}: size {size}, "
                         f"kernel {kernel}, padding {padding}, dilation {dilation}")
    return out


def _conv_canon(x, weight, *bias, stride, padding, dilation, groups):
    pairs = {k: _pair(v, k) for k, v in (("stride", stride), ("padding", padding), ("dilation", dilation))}
    if min(pairs["stride"] + pairs["dilation"]) < 1 or min(pairs["padding"]) < 0:
        raise ArgumentError(f"stride and dilation must be positive and padding non-negative, got {pairs}")
    return {**pairs, "groups": as_int(groups, "groups")}


def _conv_meta(x, weight, *bias, stride, padding, dilation, groups):
    require(x.dtype, FLOAT)
    if x.ndim != 4 or weight.ndim != 4:
        raise ShapeError(f"input must be (N, C, H, W) and weight (O, C/groups, KH, KW), got {fmt_shape(x.shape)} "
                         f"and {fmt_shape(weight.shape)}")
    n, c = x.shape[:2]
    o, cg, kh, kw = weight.shape
    if groups < 1 or c % groups or o % groups or cg * groups != c:
        raise ShapeError(f"input {fmt_shape(x.shape)} ({c} channels) and weight {fmt_shape(weight.shape)} "
                         f"do not fit groups={groups}")
    if bias and bias[0].shape != (o,):
        raise ShapeError(f"bias must be ({o},) for input {fmt_shape(x.shape)} and weight {fmt_shape(weight.shape)}, "
                         f"got {fmt_shape(bias[0].shape)}")
    oh = _out_size(x, 2, kh, stride[0], padding[0], dilation[0], weight)
    ow = _out_size(x, 3, kw, stride[1], padding[1], dilation[1], weight)
    return Meta((n, o, oh, ow), x.dtype)


def _conv_grad(xp, g, out, x, weight, *bias, stride, padding, dilation, groups):
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    gx = xp.nn.conv2d_input_grad(g, weight, shape=x.shape, **attrs)
    gw = xp.nn.conv2d_weight_grad(x, g, shape=weight.shape, **attrs)
    gb = (xp.sum(g, axis=(0, 2, 3)),) if bias else ()
    return (gx, gw) + gb


def _padded_bytes(shape, padding, dtype) -> int:
    """A copy of an NCHW input padded on both sides of H and W (none without padding)."""
    n, c, h, w = shape
    (ph, pw) = padding
    return n * c * (h + 2 * ph) * (w + 2 * pw) * dtype.itemsize if ph or pw else 0


def _windows_bytes(x_shape, out_hw, kernel, dtype) -> int:
    """The (N, C, OH, OW, KH, KW) windows a kernel unfolds into a contiguous copy (tensordot's)."""
    n, c = x_shape[:2]
    return n * c * out_hw[0] * out_hw[1] * kernel[0] * kernel[1] * dtype.itemsize


def _conv_scratch(ins, outs, attrs) -> int:
    x, weight, out = ins[0], ins[1], outs[0]
    return (_padded_bytes(x.shape, attrs["padding"], x.dtype) + _windows_bytes(x.shape, out.shape[2:], weight.shape[2:], x.dtype)
            + math.prod(out.shape) * out.dtype.itemsize)  # the groups' parts before they are joined


_CONV_ATTRS = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}
define(Op("conv2d", ("x", "weight", "*bias"), dict(_CONV_ATTRS), _conv_meta, _conv_canon, family="nn", promote_inputs=True,
          grad=_conv_grad, flops=lambda ins, outs, attrs: 2 * math.prod(outs[0].shape) * math.prod(ins[1].shape[1:]),
          scratch=_conv_scratch, doc="2-d convolution (cross-correlation) of NCHW input with OIHW weight."))


def _conv_input_grad_meta(g, weight, shape, stride, padding, dilation, groups):
    require(g.dtype, FLOAT)
    return Meta(shape, g.dtype)


def _conv_weight_grad_meta(x, g, shape, stride, padding, dilation, groups):
    require(g.dtype, FLOAT)
    return Meta(shape, g.dtype)


def _conv_grad_canon(a, b, shape, stride, padding, dilation, groups):
    return {"shape": as_shape(shape), **_conv_canon(a, b, stride=stride, padding=padding, dilation=dilation, groups=groups)}


define(Op("conv2d_input_grad", ("g", "weight"), {"shape": REQUIRED, **_CONV_ATTRS}, _conv_input_grad_meta, _conv_grad_canon,
          family="nn", promote_inputs=True, grad=_second_order("conv2d_input_grad"),
          scratch=lambda ins, outs, attrs: (2 * _windows_bytes(attrs["shape"], ins[0].shape[2:], ins[1].shape[2:], ins[0].dtype)
                                            + _padded_bytes(attrs["shape"], attrs["padding"], ins[0].dtype)),
          doc="The cotangent of conv2d's input for output cotangent g (a transposed convolution)."))
define(Op("conv2d_weight_grad", ("x", "g"), {"shape": REQUIRED, **_CONV_ATTRS}, _conv_weight_grad_meta, _conv_grad_canon,
          family="nn", promote_inputs=True, grad=_second_order("conv2d_weight_grad"),
          scratch=lambda ins, outs, attrs: (_windows_bytes(ins[0].shape, ins[1].shape[2:], attrs["shape"][2:], ins[0].dtype)
                                            + _padded_bytes(ins[0].shape, attrs["padding"], ins[0].dtype)
                                            + 2 * math.prod(ins[1].shape) * ins[1].dtype.itemsize),  # g reordered
          doc="The cotangent of conv2d's weight for input x and output cotangent g."))


def _pool_canon(x, kernel_size, stride, padding):
    kernel = _pair(kernel_size, "kernel_size")
    stride = kernel if stride is None else _pair(stride, "stride")
    padding = _pair(padding, "padding")
    if min(kernel + stride) < 1 or min(padding) < 0 or padding[0] > kernel[0] // 2 or padding[1] > kernel[1] // 2:
        raise ArgumentError(f"kernel_size and stride must be positive and padding at most half the kernel, got "
                            f"{kernel}, {stride}, {padding}")
    return {"kernel_size": kernel, "stride": stride, "padding": padding}


def _pool_meta(x, kernel_size, stride, padding):
    require(x.dtype, FLOAT)
    if x.ndim != 4:
        raise ShapeError(f"input must be (N, C, H, W), got {fmt_shape(x.shape)}")
    oh = _out_size(x, 2, kernel_size[0], stride[0], padding[0], 1)
    ow = _out_size(x, 3, kernel_size[1], stride[1], padding[1], 1)
    return Meta(x.shape[:2] + (oh, ow), x.dtype)


def _max_pool_grad(xp, g, out, x, kernel_size, stride, padding):
    return (xp.nn.max_pool2d_grad(x, g, kernel_size=kernel_size, stride=stride, padding=padding),)


def _avg_pool_grad(xp, g, out, x, kernel_size, stride, padding):
    c = x.shape[1]
    weight = xp.full((c, 1) + kernel_size, 1.0 / (kernel_size[0] * kernel_size[1]), dtype=x.dtype, device=x.device)
    return (xp.nn.conv2d_input_grad(g, weight, shape=x.shape, stride=stride, padding=padding, dilation=(1, 1), groups=c),)


UFUNC_BUFFER = 8192  # elements: NumPy's ufunc buffer (np.getbufsize()), which an in-place op on strided views fills


def _pool_scratch(ins, outs, attrs) -> int:
    """A pool combines strided windows of the padded input into its output in place, through one
    ufunc buffer; its gradient unfolds them twice."""
    x = ins[0]
    padded = _padded_bytes(x.shape, attrs["padding"], x.dtype)
    if len(ins) == 1:
        return padded + min(math.prod(outs[0].shape), UFUNC_BUFFER) * x.dtype.itemsize
    return padded + 2 * _windows_bytes(x.shape, ins[1].shape[2:], attrs["kernel_size"], x.dtype)


for _name, _grad, _doc in (("max_pool2d", _max_pool_grad, "Maximum over 2-d windows of NCHW input."),
                           ("avg_pool2d", _avg_pool_grad, "Mean over 2-d windows of NCHW input (padding counts as zeros).")):
    define(Op(_name, ("x",), {"kernel_size": REQUIRED, "stride": None, "padding": 0}, _pool_meta, _pool_canon, family="nn",
              positional=("kernel_size", "stride", "padding"), grad=_grad, scratch=_pool_scratch, doc=_doc))

define(Op("max_pool2d_grad", ("x", "g"), {"kernel_size": REQUIRED, "stride": None, "padding": 0},
          lambda x, g, **_: Meta(x.shape, x.dtype), lambda x, g, **attrs: _pool_canon(x, **attrs), family="nn",
          promote_inputs=True, grad=_second_order("max_pool2d_grad"), scratch=_pool_scratch,
          doc="The cotangent of max_pool2d's input: g routed to each window's maximum (ties: the first)."))


def _attention_meta(q, k, v, *mask, is_causal, scale):
    require(q.dtype, FLOAT)
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ShapeError(f"q, k, v must be (..., L, E), (..., S, E), (..., S, Ev), got {fmt_shape(q.shape)}, "
                         f"{fmt_shape(k.shape)}, {fmt_shape(v.shape)}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2]:
        raise ShapeError(f"q {fmt_shape(q.shape)}, k {fmt_shape(k.shape)} and v {fmt_shape(v.shape)} do not fit together")
    scores = q.shape[:-1] + k.shape[-2:-1]  # (..., L, S)
    if mask and not broadcasts_to(mask[0].shape, scores):  # added to the scores, it may not grow them
        raise ShapeError(f"mask must broadcast to the scores' shape {fmt_shape(scores)} for q {fmt_shape(q.shape)}, k "
                         f"{fmt_shape(k.shape)} and v {fmt_shape(v.shape)}, got {fmt_shape(mask[0].shape)}")
    return Meta(q.shape[:-1] + v.shape[-1:], q.dtype)


def _attention_grad(xp, g, out, q, k, v, *mask, is_causal, scale):
    s = (1 / math.sqrt(q.shape[-1])) if scale is None else scale
    scores = (q @ xp.matrix_transpose(k)) * s
    if mask:
        scores = scores + mask[0]
    if is_causal:
        keep = xp.tril(xp.ones((q.shape[-2], k.shape[-2]), dtype=xp.bool, device=q.device))
        scores = xp.where(keep, scores, -math.inf)
    p = xp.nn.softmax(scores, axis=-1)
    gv = xp.matrix_transpose(p) @ g
    gp = g @ xp.matrix_transpose(v)
    gs = p * (gp - xp.sum(gp * p, axis=-1, keepdims=True))
    gmask = (unbroadcast(xp, gs, mask[0].shape),) if mask else ()
    return (gs @ k * s, xp.matrix_transpose(gs) @ q * s, gv) + gmask


def _attention_scratch(ins, outs, attrs) -> int:
    q, k = ins[0], ins[1]
    # the (…, L, S) scores, their shifted exponentials and the softmax, with a temporary beside them
    return 4 * math.prod(q.shape[:-1]) * k.shape[-2] * q.dtype.itemsize


define(Op("scaled_dot_product_attention", ("q", "k", "v", "*mask"), {"is_causal": False, "scale": None}, _attention_meta,
          family="nn", promote_inputs=True, grad=_attention_grad, scratch=_attention_scratch,
          doc="softmax(q @ k.T · scale + mask) @ v, with an optional additive float mask or a causal mask."))
