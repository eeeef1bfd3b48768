"""The lowering table: aten op → ember namespace functions, one line per op where possible.

A lowering is ``lower(out, *args, **kwargs)``: ``args``/``kwargs`` are the aten op's own, with every
ember tensor replaced by its ember array and every 0-d host tensor by its Python scalar; ``out`` is
the op's result as PyTorch's meta kernels compute it (a meta tensor, or a tuple of them), so shapes
and dtypes — PyTorch's promotion, float32 defaults, ``-1`` in a view — are PyTorch's own, read
rather than re-derived. The dispatcher (tensor.py) casts each result to ``out``'s dtype and checks
its shape.

Derived, not written: each in-place overload (``add_.Tensor``) runs its functional overload
(``add.Tensor``) and rebinds the tensor; each ``_foreach_*`` overload runs its per-tensor op once per
element (tensor.py). An aten op without a lowering runs torch's own decomposition
(``torch._decomp``) when it has one, else raises ``UnloweredOpError``.
"""

from __future__ import annotations

import torch

import ember as em

from .dtypes import to_ember, to_torch
from .lowering_cnn import LOWERINGS_CNN
from .lowering_transformer import LOWERINGS_TRANSFORMER

aten = torch.ops.aten

_REDUCTIONS = ("none", "mean", "sum")  # aten's reduction enum


def cast(x, dtype: torch.dtype):
    """``x`` in the ember dtype of ``dtype`` (Python scalars pass: ember's scalar rules take the array's)."""
    target = to_ember(dtype)
    return em.astype(x, target) if isinstance(x, em.Array) and x.dtype != target else x


def _scale(x, factor):
    return x if factor == 1 else x * factor


def arithmetic(fn):
    """An elementwise op computed in the result's dtype: PyTorch promotes, then computes (bools as uint8,
    since PyTorch adds and multiplies them; the result is cast back to bool)."""
    def lower(out, *args, **kwargs):
        dtype = torch.uint8 if out.dtype is torch.bool else out.dtype
        return fn(*(cast(a, dtype) for a in args), **kwargs)
    return lower


def comparison(fn):
    """A comparison: both sides in their common dtype (``torch.result_type``), the result bool."""
    def lower(out, x, y):
        common = torch.result_type(_probe(x), _probe(y))
        return fn(cast(x, common), cast(y, common))
    return lower


def _probe(x):
    """What ``torch.result_type`` reads of an operand: a meta tensor of its shape and dtype, or the scalar."""
    if isinstance(x, em.Array):
        return torch.empty(x.shape, dtype=to_torch(x.dtype), device="meta")
    return x


def filled(out, x, value, *args, **kwargs):
    """A creation op: ``value`` everywhere, in ``out``'s shape and dtype, on ``x``'s device."""
    dtype = to_ember(out.dtype)
    return em.full(tuple(out.shape), bool(value) if dtype == em.bool else value, dtype=dtype, device=x.device)


def like(value):
    """A creation op of a fixed value (``zeros_like``, ``new_ones`` …)."""
    return lambda out, x, *args, **kwargs: filled(out, x, value)


def reshaped(out, x, *args, **kwargs):
    """A view whose result is ``x``'s elements in ``out``'s shape (view, unsqueeze, squeeze, flatten …)."""
    return em.reshape(x, tuple(out.shape))


def _axes(dim, ndim):
    """aten's ``dim`` as ember's ``axis``: None for every axis (PyTorch also accepts 0 and -1 on a 0-d tensor)."""
    if dim is None or ndim == 0 or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    return tuple(d % max(ndim, 1) for d in dim) if isinstance(dim, (list, tuple)) else dim % max(ndim, 1)


def _reduce(fn):
    def lower(out, x, dim=None, keepdim=False, *, dtype=None):
        return fn(cast(x, out.dtype), axis=_axes(dim, x.ndim), keepdims=keepdim)
    return lower


def _transpose(out, x, dim0, dim1):
    if x.ndim < 2:
        return x
    axes = list(range(x.ndim))
    axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
    return em.permute_dims(x, tuple(axes))


def _slice(out, x, dim=0, start=None, end=None, step=1):
    return x[_index(x.ndim, dim, slice(start, end, step))]


def _select(out, x, dim, index):
    return x[_index(x.ndim, dim, index)]


def _index(ndim, dim, key):
    """``key`` along axis ``dim``, every element along the others."""
    where = [slice(None)] * ndim
    where[dim % ndim] = key
    return tuple(where)


def _scattered(key_of):
    """The backward of a view that picks elements (select, slice): zeros, the gradient where they were."""
    def lower(out, grad, input_sizes, dim, *key):
        result = em.zeros(tuple(input_sizes), dtype=grad.dtype, device=grad.device)
        result[_index(len(input_sizes), dim, key_of(*key))] = grad
        return result
    return lower


def _addmm(out, bias, a, b, *, beta=1, alpha=1):
    return _scale(em.matmul(a, b), alpha) + _scale(cast(bias, out.dtype), beta)


def _copy(out, x, source, non_blocking=False):
    """``source``'s values in ``x``'s shape, dtype and device: an ember array, a scalar, or host data."""
    if isinstance(source, torch.Tensor):  # a host tensor: uploaded (the one op that takes host data)
        source = em.asarray(source.detach().contiguous().numpy(), device=x.device)
    elif isinstance(source, em.Array) and source.device != x.device:
        source = source.to_device(x.device)
    else:
        source = em.asarray(source, device=x.device) if not isinstance(source, em.Array) else source
    return em.broadcast_to(cast(source, out.dtype), tuple(out.shape))


def _divide(out, x, y, *, rounding_mode=None):
    if rounding_mode == "floor":
        return em.floor_divide(cast(x, out.dtype), cast(y, out.dtype))
    quotient = em.divide(cast(x, torch.float64), cast(y, torch.float64)) if not out.dtype.is_floating_point \
        else em.divide(cast(x, out.dtype), cast(y, out.dtype))
    return em.trunc(quotient) if rounding_mode == "trunc" else quotient


def _along(fn):
    """A softmax-like op along ``dim``; a 0-d tensor as one of one element."""
    def lower(out, x, dim, *args):
        return em.reshape(fn(em.reshape(x, (1,)), axis=0), ()) if x.ndim == 0 else fn(cast(x, out.dtype), axis=dim)
    return lower


def _where(out, condition, x, y):
    return em.where(condition, cast(x, out.dtype), cast(y, out.dtype))


def _clamp(out, x, min=None, max=None):
    return em.clip(cast(x, out.dtype), cast(min, out.dtype), cast(max, out.dtype))


def _class_axis(x):
    return 1 if x.ndim > 1 else 0


def _nll_weights(x, target, weight, ignore_index):
    keep = em.not_equal(target, ignore_index)
    safe = em.where(keep, target, 0)
    if weight is None:
        return em.astype(keep, x.dtype), safe
    return em.where(keep, em.reshape(em.take(weight, em.reshape(safe, (-1,))), safe.shape), 0), safe


def _nll_loss_forward(out, x, target, weight, reduction, ignore_index):
    axis = _class_axis(x)
    w, safe = _nll_weights(x, target, weight, ignore_index)
    picked = em.squeeze(em.take_along_axis(x, em.expand_dims(safe, axis=axis), axis=axis), axis=axis)
    losses, total = -picked * w, em.sum(w)
    if _REDUCTIONS[reduction] == "none":
        return losses, total
    return (em.sum(losses) / total if _REDUCTIONS[reduction] == "mean" else em.sum(losses)), total


def _nll_loss_backward(out, grad, x, target, weight, reduction, ignore_index, total_weight):
    axis = _class_axis(x)
    w, safe = _nll_weights(x, target, weight, ignore_index)
    classes = em.reshape(em.arange(x.shape[axis], dtype=safe.dtype, device=x.device), (-1,) + (1,) * (x.ndim - axis - 1))
    scale = -w * grad / total_weight if _REDUCTIONS[reduction] == "mean" else -w * grad
    return em.where(em.equal(em.expand_dims(safe, axis=axis), classes), em.expand_dims(scale, axis=axis), 0)


def _mse_loss_backward(out, grad, x, y, reduction):
    slope = 2 * (x - y) * grad
    return slope / x.size if _REDUCTIONS[reduction] == "mean" else slope


def _softmax_backward(out, grad, output, dim, input_dtype):
    return output * (grad - em.sum(grad * output, axis=_axes(dim, grad.ndim), keepdims=True))


def _log_softmax_backward(out, grad, output, dim, input_dtype):
    return grad - em.exp(output) * em.sum(grad, axis=_axes(dim, grad.ndim), keepdims=True)


def _threshold_backward(out, grad, x, threshold):
    return em.where(x <= threshold, 0, grad)


def _relu(out, x):
    return em.nn.relu(x) if x.dtype.kind == em.dtypes.REAL else em.maximum(x, 0)


def _joined(xs):
    """cat's operands, less the 1-d empty tensors PyTorch lets any cat skip (a legacy it keeps)."""
    return [x for x in xs if x.shape != (0,)] or xs[:1]


def _truth(x):
    return x if x.dtype == em.bool else em.not_equal(x, 0)


def _local_scalar(out, x):
    return em.asnumpy(x).item()


LOWERINGS = {
    # elementwise arithmetic, in PyTorch's result dtype
    aten.add.Tensor: arithmetic(lambda x, y, alpha=1: x + _scale(y, alpha)),
    aten.add.Scalar: arithmetic(lambda x, y, alpha=1: x + _scale(y, alpha)),
    aten.sub.Tensor: arithmetic(lambda x, y, alpha=1: x - _scale(y, alpha)),
    aten.sub.Scalar: arithmetic(lambda x, y, alpha=1: x - _scale(y, alpha)),
    aten.rsub.Tensor: arithmetic(lambda x, y, alpha=1: y - _scale(x, alpha)),
    aten.rsub.Scalar: arithmetic(lambda x, y, alpha=1: y - _scale(x, alpha)),
    aten.mul.Tensor: arithmetic(em.multiply),
    aten.mul.Scalar: arithmetic(em.multiply),
    aten.div.Tensor: arithmetic(em.divide),
    aten.div.Scalar: arithmetic(em.divide),
    aten.div.Tensor_mode: _divide,
    aten.div.Scalar_mode: _divide,
    aten.pow.Tensor_Scalar: arithmetic(lambda x, y: x ** y),
    aten.pow.Tensor_Tensor: arithmetic(em.pow),
    aten.pow.Scalar: arithmetic(lambda x, y: x ** y),
    aten.maximum.default: arithmetic(em.maximum),
    aten.minimum.default: arithmetic(em.minimum),
    aten.addcdiv.default: arithmetic(lambda x, a, b, *, value=1: x + _scale(a / b, value)),
    aten.addcmul.default: arithmetic(lambda x, a, b, *, value=1: x + _scale(a * b, value)),
    aten.lerp.Scalar: arithmetic(lambda x, end, weight: x + weight * (end - x)),
    aten.lerp.Tensor: arithmetic(lambda x, end, weight: x + weight * (end - x)),
    aten.neg.default: arithmetic(em.negative),
    aten.abs.default: arithmetic(em.abs),
    aten.sign.default: arithmetic(em.sign),
    aten.reciprocal.default: arithmetic(em.reciprocal),
    aten.sqrt.default: arithmetic(em.sqrt),
    aten.rsqrt.default: arithmetic(lambda x: 1 / em.sqrt(x)),
    aten.exp.default: arithmetic(em.exp),
    aten.log.default: arithmetic(em.log),
    aten.tanh.default: arithmetic(em.tanh),
    aten.sigmoid.default: arithmetic(em.nn.sigmoid),
    aten.sin.default: arithmetic(em.sin),
    aten.cos.default: arithmetic(em.cos),
    aten.clamp.default: _clamp,
    aten.clamp.Tensor: _clamp,
    aten.where.self: _where,
    aten.relu.default: _relu,
    aten.threshold_backward.default: _threshold_backward,
    # comparisons and logic
    aten.eq.Tensor: comparison(em.equal),
    aten.eq.Scalar: comparison(em.equal),
    aten.ne.Tensor: comparison(em.not_equal),
    aten.ne.Scalar: comparison(em.not_equal),
    aten.lt.Tensor: comparison(em.less),
    aten.lt.Scalar: comparison(em.less),
    aten.le.Tensor: comparison(em.less_equal),
    aten.le.Scalar: comparison(em.less_equal),
    aten.gt.Tensor: comparison(em.greater),
    aten.gt.Scalar: comparison(em.greater),
    aten.ge.Tensor: comparison(em.greater_equal),
    aten.ge.Scalar: comparison(em.greater_equal),
    aten.logical_and.default: comparison(lambda x, y: em.logical_and(_truth(x), _truth(y))),
    aten.logical_or.default: comparison(lambda x, y: em.logical_or(_truth(x), _truth(y))),
    aten.logical_xor.default: comparison(lambda x, y: em.logical_xor(_truth(x), _truth(y))),
    aten.bitwise_and.Tensor: arithmetic(em.bitwise_and),
    aten.bitwise_or.Tensor: arithmetic(em.bitwise_or),
    aten.bitwise_xor.Tensor: arithmetic(em.bitwise_xor),
    aten.__and__.Tensor: arithmetic(em.bitwise_and),
    aten.__or__.Tensor: arithmetic(em.bitwise_or),
    aten.__xor__.Tensor: arithmetic(em.bitwise_xor),
    aten.masked_fill.Scalar: lambda out, x, mask, value: em.where(mask, cast(value, out.dtype), x),
    aten.masked_fill.Tensor: lambda out, x, mask, value: em.where(mask, cast(value, out.dtype), x),
    aten.logical_not.default: lambda out, x: em.logical_not(x) if x.dtype == em.bool else em.equal(x, 0),
    # linear algebra
    aten.mm.default: arithmetic(em.matmul),
    aten.bmm.default: arithmetic(em.matmul),
    aten.addmm.default: _addmm,
    aten.dot.default: arithmetic(lambda x, y: em.vecdot(x, y)),
    # reductions
    aten.sum.dim_IntList: _reduce(em.sum),
    aten.sum.default: lambda out, x, *, dtype=None: em.sum(cast(x, out.dtype)),
    aten.mean.dim: _reduce(em.mean),
    aten.mean.default: lambda out, x, *, dtype=None: em.mean(cast(x, out.dtype)),
    aten.amax.default: _reduce(em.max),
    aten.amin.default: _reduce(em.min),
    aten.argmax.default: lambda out, x, dim=None, keepdim=False: em.argmax(x, axis=_axes(dim, x.ndim), keepdims=keepdim),
    aten.argmin.default: lambda out, x, dim=None, keepdim=False: em.argmin(x, axis=_axes(dim, x.ndim), keepdims=keepdim),
    # neural-network rows
    aten._softmax.default: _along(em.nn.softmax),
    aten._log_softmax.default: _along(em.nn.log_softmax),
    aten._softmax_backward_data.default: _softmax_backward,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.mse_loss.default: lambda out, x, y, reduction=1: em.nn.mse_loss(x, y, reduction=_REDUCTIONS[reduction]),
    aten.mse_loss_backward.default: _mse_loss_backward,
    aten.nll_loss_forward.default: _nll_loss_forward,
    aten.nll_loss_backward.default: _nll_loss_backward,
    # shapes and views (the dispatcher marks the views: tensor.VIEWS)
    aten.view.default: reshaped,
    aten._unsafe_view.default: reshaped,
    aten.reshape.default: reshaped,
    aten.unsqueeze.default: reshaped,
    aten.squeeze.default: reshaped,
    aten.squeeze.dim: reshaped,
    aten.squeeze.dims: reshaped,
    aten.t.default: lambda out, x: x.mT if x.ndim == 2 else x,
    aten.transpose.int: _transpose,
    aten.permute.default: lambda out, x, dims: em.permute_dims(x, tuple(d % x.ndim for d in dims)),
    aten.expand.default: lambda out, x, size, *, implicit=False: em.broadcast_to(x, tuple(out.shape)),
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.select_backward.default: _scattered(lambda index: index),
    aten.slice_backward.default: _scattered(lambda start, end, step: slice(start, end, step)),
    aten.cat.default: lambda out, xs, dim=0: em.concat([cast(x, out.dtype) for x in _joined(xs)], axis=dim),
    aten.stack.default: lambda out, xs, dim=0: em.stack([cast(x, out.dtype) for x in xs], axis=dim),
    # copies, casts and creation
    aten.clone.default: lambda out, x, *, memory_format=None: x,  # ember arrays are values: in-place ops rebind
    aten.copy.default: _copy,
    aten._to_copy.default: lambda out, x, **kwargs: cast(x, out.dtype),
    aten.zeros_like.default: like(0),
    aten.ones_like.default: like(1),
    aten.empty_like.default: like(0),
    aten.full_like.default: filled,
    aten.fill.Scalar: filled,
    aten.zero.default: like(0),
    aten.new_zeros.default: like(0),
    aten.new_ones.default: like(1),
    aten.new_empty.default: like(0),
    aten.new_empty_strided.default: like(0),
    aten.new_full.default: lambda out, x, size, fill_value, **kwargs: filled(out, x, fill_value),
    # reads
    aten._local_scalar_dense.default: _local_scalar,
    # convolution, pooling and batch norm (lowering_cnn.py); embedding, layer norm and attention (lowering_transformer.py)
    **LOWERINGS_CNN,
    **LOWERINGS_TRANSFORMER,
}
