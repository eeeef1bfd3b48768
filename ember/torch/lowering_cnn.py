"""The lowering table's convolution, pooling, batch-norm and dropout family (lowering.py merges it into ``LOWERINGS``).

Rows used: ``em.nn.conv2d`` and its cotangent rows ``conv2d_input_grad``/``conv2d_weight_grad``,
``em.nn.max_pool2d`` and ``max_pool2d_grad``; batch norm is written out of the namespace's
reductions. ``native_batch_norm`` updates its running statistics in place (PyTorch's schema does
not mark them written): its lowering returns :class:`Writes`, which the dispatcher rebinds into
those tensors' storages, so ``model.train()``/``model.eval()`` behave as in eager. Dropout's noise
(``bernoulli``) is drawn on the host by PyTorch's own CPU kernel and generator and uploaded, so the
mask, and the generator's state after it, are eager's: one upload of the mask per dropout, no read.
"""

from __future__ import annotations

import torch

import ember as em
from ember.errors import CaptureError, NotSupportedError

aten = torch.ops.aten


class Writes:
    """A lowering's result and the arrays its op writes into its arguments, by the schema's argument names."""

    __slots__ = ("result", "written")

    def __init__(self, result, written: dict):
        self.result, self.written = result, written


def _conv_attrs(x, stride, padding, dilation, transposed, output_padding, groups, op):
    if x.ndim != 4 or transposed:
        raise NotSupportedError(f"{op}: ember lowers 2-d convolutions (NCHW, not transposed); got a {x.ndim}-d input"
                                f"{', transposed' if transposed else ''}")
    if isinstance(padding, str):
        raise NotSupportedError(f"{op}: padding={padding!r}: ember takes numeric padding")
    return {"stride": tuple(stride), "padding": tuple(padding), "dilation": tuple(dilation), "groups": groups}


def _convolution(out, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    attrs = _conv_attrs(x, stride, padding, dilation, transposed, output_padding, groups, "aten.convolution")
    return em.nn.conv2d(x, weight, bias, **attrs)


def _convolution_backward(out, grad, x, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
                          groups, output_mask):
    attrs = _conv_attrs(x, stride, padding, dilation, transposed, output_padding, groups, "aten.convolution_backward")
    return (em.nn.conv2d_input_grad(grad, weight, shape=x.shape, **attrs) if output_mask[0] else None,
            em.nn.conv2d_weight_grad(x, grad, shape=weight.shape, **attrs) if output_mask[1] else None,
            em.sum(grad, axis=(0, 2, 3)) if output_mask[2] else None)


def _pool_attrs(kernel_size, stride, padding, dilation, ceil_mode):
    pair = lambda v: (v[0], v[0]) if len(v) == 1 else tuple(v)  # noqa: E731
    kernel = pair(kernel_size)
    return {"kernel_size": kernel, "stride": pair(stride) if len(stride) else kernel, "padding": pair(padding),
            "dilation": pair(dilation), "ceil_mode": ceil_mode}


def _plain(attrs) -> bool:
    """Whether ember's max_pool2d rows take the pooling as it is (no dilation, no ceil_mode)."""
    return attrs["dilation"] == (1, 1) and not attrs["ceil_mode"]


def _row_attrs(attrs) -> dict:
    return {k: attrs[k] for k in ("kernel_size", "stride", "padding")}


def _batched(lower):
    """A pooling lowering that also takes an unbatched (C, H, W) input, as PyTorch does: as a batch of one."""
    def on_any(out, x, *args):
        if x.ndim == 4:
            return lower(out, x, *args)
        one = lambda a: em.expand_dims(a, axis=0) if isinstance(a, em.Array) else a  # noqa: E731
        batched = lambda o: torch.empty((1,) + tuple(o.shape), dtype=o.dtype, device="meta")  # noqa: E731
        result = lower(tuple(map(batched, out)) if isinstance(out, tuple) else batched(out), *map(one, (x,) + args))
        return tuple(r[0] for r in result) if isinstance(result, tuple) else result[0]
    return on_any


@_batched
def _max_pool(out, x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    attrs = _pool_attrs(kernel_size, stride, padding, dilation, ceil_mode)
    windows, offsets = _windows(x, tuple(out[0].shape[2:]), **attrs)
    k = em.argmax(windows, axis=0)  # the first of ties, as PyTorch
    (kw, (dh, dw)), (rows, cols) = (attrs["kernel_size"][1], attrs["dilation"]), offsets
    indices = (rows + (k // kw) * dh) * x.shape[3] + cols + (k % kw) * dw
    values = em.nn.max_pool2d(x, **_row_attrs(attrs)) if _plain(attrs) else em.max(windows, axis=0)
    return values, indices


def _windows(x, out_hw, kernel_size, stride, padding, dilation, ceil_mode, fill=-em.inf):
    """Each window offset's strided view of ``x`` (padded with ``fill``), stacked: (KH·KW, N, C, OH, OW), and
    each output position's first input row and column (its window's top left, padding counted)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw), (oh, ow) = kernel_size, stride, padding, dilation, out_hw
    x = _padded(x, ph, max(ph, (oh - 1) * sh + dh * (kh - 1) + 1 - x.shape[2] - ph),
                pw, max(pw, (ow - 1) * sw + dw * (kw - 1) + 1 - x.shape[3] - pw), fill)
    windows = em.stack([x[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
                        for i in range(kh) for j in range(kw)], axis=0)
    rows = em.reshape(em.arange(oh, dtype=em.int64, device=x.device) * sh - ph, (oh, 1))
    cols = em.reshape(em.arange(ow, dtype=em.int64, device=x.device) * sw - pw, (1, ow))
    return windows, (rows, cols)


def _padded(x, top, bottom, left, right, fill):
    n, c, h, w = x.shape
    full = lambda *shape: em.full(shape, fill, dtype=x.dtype, device=x.device)  # noqa: E731
    if top or bottom:
        x = em.concat([full(n, c, top, w), x, full(n, c, bottom, w)], axis=2)
    if left or right:
        x = em.concat([full(n, c, h + top + bottom, left), x, full(n, c, h + top + bottom, right)], axis=3)
    return x


@_batched
def _max_pool_backward(out, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    """ember's max_pool2d_grad row; with dilation or ceil_mode, ``grad`` added back window offset by offset
    where ``indices`` picked that offset."""
    attrs = _pool_attrs(kernel_size, stride, padding, dilation, ceil_mode)
    if _plain(attrs):
        return em.nn.max_pool2d_grad(x, grad, **_row_attrs(attrs))
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (attrs[k] for k in ("kernel_size", "stride", "padding", "dilation"))
    (oh, ow), (h, w) = grad.shape[2:], x.shape[2:]
    _, (rows, cols) = _windows(em.zeros((1, 1, h, w), dtype=x.dtype, device=x.device), (oh, ow), **attrs)
    k = ((indices // w - rows) // dh) * kw + (indices % w - cols) // dw
    bottom, right = max(ph, (oh - 1) * sh + dh * (kh - 1) + 1 - h - ph), max(pw, (ow - 1) * sw + dw * (kw - 1) + 1 - w - pw)
    total = _padded(em.zeros_like(x), ph, bottom, pw, right, 0)
    for i in range(kh):
        for j in range(kw):
            key = (slice(None), slice(None), slice(i * dh, i * dh + sh * (oh - 1) + 1, sh),
                   slice(j * dw, j * dw + sw * (ow - 1) + 1, sw))
            total[key] = total[key] + em.where(em.equal(k, i * kw + j), grad, 0)
    return total[:, :, ph:ph + h, pw:pw + w]


def _channels(x, v):
    """A per-channel (C,) vector shaped to broadcast against an (N, C, …) input."""
    return em.reshape(v, (1, -1) + (1,) * (x.ndim - 2))


def _batch_norm(out, x, weight, bias, running_mean, running_var, training, momentum, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    if training:
        mean = em.mean(x, axis=axes)
        var = em.mean(em.square(x - _channels(x, mean)), axis=axes)
        written = {}
        if running_mean is not None:
            count = x.size // x.shape[1]
            written["running_mean"] = (1 - momentum) * running_mean + momentum * mean
            written["running_var"] = (1 - momentum) * running_var + momentum * var * (count / max(count - 1, 1))
    else:
        mean, var, written = running_mean, running_var, {}
    invstd = 1 / em.sqrt(var + eps)
    y = (x - _channels(x, mean)) * _channels(x, invstd)
    if weight is not None:
        y = y * _channels(x, weight)
    if bias is not None:
        y = y + _channels(x, bias)
    saved = (mean, invstd) if training else (em.zeros((0,), dtype=x.dtype, device=x.device),) * 2  # eager's, not meta's
    return Writes((y,) + saved, written)


def _batch_norm_backward(out, grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
                         output_mask):
    axes = (0,) + tuple(range(2, x.ndim))
    mean, invstd = (save_mean, save_invstd) if train else (running_mean, 1 / em.sqrt(running_var + eps))
    xhat = (x - _channels(x, mean)) * _channels(x, invstd)
    grad_bias, grad_weight = em.sum(grad, axis=axes), em.sum(grad * xhat, axis=axes)
    scale = _channels(x, invstd if weight is None else invstd * weight)
    if train:
        count = x.size // x.shape[1]
        grad_x = scale * (grad - _channels(x, grad_bias) / count - xhat * _channels(x, grad_weight) / count)
    else:
        grad_x = grad * scale
    return (grad_x if output_mask[0] else None, grad_weight if output_mask[1] else None,
            grad_bias if output_mask[2] else None)


def _on_the_host(x, op: str) -> None:
    """Noise is drawn on the host, so a captured graph would replay one draw: refused on a capture device."""
    if x.device.kind == "capture":
        raise CaptureError(f"{op}: noise drawn on the host (dropout's) would repeat at each replay of a captured "
                           f"graph; capture in eval mode (model.eval()), or without dropout")


def _bernoulli(out, x, p=0.5, *, generator=None):
    """A 0/1 mask drawn on the host by PyTorch's own CPU kernel and generator, then uploaded: the same mask, and the
    same generator state after, as eager (dropout's noise on CPU tensors), drawn in the memory order of ``out``'s
    strides as eager's kernel draws; it costs one upload of the mask."""
    _on_the_host(x, "aten.bernoulli")
    # drawn as bool: PyTorch's CPU kernel draws the same mask for any dtype, and a quarter of float32's bytes go up
    mask = torch.empty_strided(out.shape, out.stride(), dtype=torch.bool).bernoulli_(p, generator=generator)
    return em.asarray(mask.numpy(), device=x.device)  # the dispatcher casts it to out's dtype, on the device


def _bernoulli_of(out, p, *, generator=None):
    """``torch.bernoulli(p)`` for a tensor of probabilities: PyTorch's CPU kernel draws one uniform an element, in
    order, from the generator, and keeps ``uniform < p``; the uniforms are drawn so on the host and uploaded (one
    upload of ``p``'s size), the comparison runs on the device."""
    _on_the_host(p, "aten.bernoulli")
    uniform = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype).uniform_(0, 1, generator=generator)
    return em.less(em.asarray(uniform.numpy(), device=p.device), p)


# ops whose eager CPU kernel gives an empty (0,) tensor where their meta kernel gives a shape (eval-mode batch
# norm's saved statistics): their lowerings give eager's
EAGER_EMPTY = {aten.native_batch_norm.default}

LOWERINGS_CNN = {
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
    aten.max_pool2d_with_indices.default: _max_pool,
    aten.max_pool2d_with_indices_backward.default: _max_pool_backward,
    aten.native_batch_norm.default: _batch_norm,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
    aten.bernoulli.default: _bernoulli_of,
    aten.bernoulli.p: _bernoulli,  # bernoulli_.float, dropout's on CPU, runs it (tensor.IN_PLACE_FUNCTIONAL)
}
