"""The lowering table's embedding, layer-norm, attention and GELU family (lowering.py merges it into ``LOWERINGS``).

Rows used: ``em.nn.embedding`` (its backward is ``scatter_add``, the row's own adjoint),
``em.nn.layer_norm``, ``em.nn.scaled_dot_product_attention`` and ``em.nn.gelu``/``gelu_grad``. Where
PyTorch hands a backward the statistics its forward saved (``native_layer_norm_backward`` gets the
mean and 1/σ), the cotangents are the row's own (``ops.nn.layer_norm_cotangents``); the attention's
backward is the row's gradient rule. PyTorch picks an attention kernel with ``_fused_sdp_choice``:
without dropout ember answers "flash", whose forward and backward are the row and its rule; with
dropout "math", PyTorch's composite of matmuls, softmax and dropout (its mask from PyTorch's own
generator, as for ``nn.Dropout``: lowering_cnn.py), which lowers op by op.
"""

from __future__ import annotations

import torch

import ember as em
from ember.errors import NotSupportedError
from ember.ops.nn import layer_norm_cotangents
from ember.ops.table import OPS

aten = torch.ops.aten

_MATH, _FLASH = 0, 1  # sdp::SDPBackend: the composite kernel, and the flash kernel ember lowers to its row
_attention_grad = OPS["scaled_dot_product_attention"].grad


def _embedding(out, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return em.nn.embedding(indices, weight)


def _embedding_backward(out, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """The rows of the weight's gradient: each index's cotangent added into its row (none at ``padding_idx``)."""
    if scale_grad_by_freq:
        raise NotSupportedError("aten.embedding_dense_backward: scale_grad_by_freq=True is not lowered to ember")
    dim = grad.shape[-1]
    if padding_idx >= 0:
        grad = em.where(em.expand_dims(em.not_equal(indices, padding_idx), axis=-1), grad, 0)
    flat = em.reshape(indices, (-1, 1)) * dim
    positions = em.reshape(flat + em.arange(dim, dtype=flat.dtype, device=flat.device), (-1,))
    rows = em.zeros(num_weights * dim, dtype=grad.dtype, device=grad.device)
    return em.reshape(em.scatter_add(rows, positions, em.reshape(grad, (-1,))), (num_weights, dim))


def _statistics(x, axes: int, eps: float):
    """The mean and 1/σ of ``x`` over its last ``axes`` axes, kept as axes of one."""
    normalized = tuple(range(x.ndim - axes, x.ndim))
    mean = em.mean(x, axis=normalized, keepdims=True)
    return mean, 1 / em.sqrt(em.var(x, axis=normalized, keepdims=True) + eps)


def _layer_norm(out, x, normalized_shape, weight, bias, eps):
    """The row (its affine part too when PyTorch has both weight and bias), and the statistics PyTorch saves."""
    shape = tuple(normalized_shape)
    both = weight is not None and bias is not None
    y = em.nn.layer_norm(x, shape, weight, bias, eps=eps) if both else em.nn.layer_norm(x, shape, eps=eps)
    if not both:  # one of the two: PyTorch's LayerNorm(bias=False) scales only
        y = y * weight if weight is not None else y
        y = y + bias if bias is not None else y
    mean, inv = _statistics(x, len(shape), eps)
    return y, em.reshape(mean, tuple(out[1].shape)), em.reshape(inv, tuple(out[2].shape))


def _layer_norm_backward(out, grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    axes = len(normalized_shape)
    kept = tuple(x.shape[:x.ndim - axes]) + (1,) * axes  # the statistics as the reductions left them
    gx, gw, gb = layer_norm_cotangents(em, grad, x, em.reshape(mean, kept), em.reshape(rstd, kept), weight, axes, True)
    return (gx if output_mask[0] else None, gw if output_mask[1] and weight is not None else None,
            gb if output_mask[2] and bias is not None else None)


def _sdp_choice(out, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """The kernel PyTorch runs attention with: the row ("flash") unless there is dropout, which only PyTorch's
    composite ("math") draws, or a mask the flash kernel does not take."""
    return _FLASH if dropout_p == 0 and attn_mask is None and not enable_gqa else _MATH


def _flash(out, q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, *, scale=None):
    """``_scaled_dot_product_flash_attention_for_cpu``: the output, and the log-sum-exp PyTorch saves (its backward,
    below, recomputes from q, k and v instead, as the row's rule does)."""
    if dropout_p:
        raise NotSupportedError(f"aten._scaled_dot_product_flash_attention_for_cpu: dropout_p={dropout_p} is run "
                                f"through PyTorch's math kernel, not the flash one")
    mask = () if attn_mask is None else (attn_mask,)
    y = em.nn.scaled_dot_product_attention(q, k, v, *mask, is_causal=is_causal, scale=scale)
    return y, em.zeros(tuple(out[1].shape), dtype=em.float32, device=q.device)


def _flash_backward(out, grad, q, k, v, output, logsumexp, dropout_p, is_causal, attn_mask=None, *, scale=None):
    mask = () if attn_mask is None else (attn_mask,)
    return _attention_grad(em, grad, output, q, k, v, *mask, is_causal=is_causal, scale=scale)[:3]


def _encoder_layer(out, src, width, heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps,
                   norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2, ffn_weight_1, ffn_bias_1, ffn_weight_2,
                   ffn_bias_2, mask=None, mask_type=None):
    """``nn.TransformerEncoderLayer``'s inference fast path (eval mode, no gradient), written out of the rows."""
    if mask is not None:
        raise NotSupportedError("aten._transformer_encoder_layer_fwd: a mask on the fast path is not lowered to ember; "
                                "run the layer with gradients enabled, or without a mask")
    batch, length = src.shape[0], src.shape[1]

    def heads_of(x):  # (batch, length, width) → (batch, heads, length, width / heads)
        return em.permute_dims(em.reshape(x, (batch, length, heads, width // heads)), (0, 2, 1, 3))

    def attention(x):
        q, k, v = (em.nn.linear(x, w, b) for w, b in zip(_thirds(qkv_weight), _thirds(qkv_bias)))
        y = em.nn.scaled_dot_product_attention(heads_of(q), heads_of(k), heads_of(v))
        return em.nn.linear(em.reshape(em.permute_dims(y, (0, 2, 1, 3)), (batch, length, width)), proj_weight, proj_bias)

    def feed_forward(x):
        hidden = em.nn.linear(x, ffn_weight_1, ffn_bias_1)
        return em.nn.linear(em.nn.gelu(hidden) if use_gelu else em.nn.relu(hidden), ffn_weight_2, ffn_bias_2)

    def norm(x, weight, bias):
        return em.nn.layer_norm(x, (width,), weight, bias, eps=eps)

    if norm_first:
        x = src + attention(norm(src, norm_weight_1, norm_bias_1))
        return x + feed_forward(norm(x, norm_weight_2, norm_bias_2))
    x = norm(src + attention(src), norm_weight_1, norm_bias_1)
    return norm(x + feed_forward(x), norm_weight_2, norm_bias_2)


def _thirds(x):
    """The query's, key's and value's parts of a packed in-projection (its first axis in three)."""
    third = x.shape[0] // 3
    return x[:third], x[third:2 * third], x[2 * third:]


LOWERINGS_TRANSFORMER = {
    aten._transformer_encoder_layer_fwd.default: _encoder_layer,
    aten.embedding.default: _embedding,
    aten.embedding_dense_backward.default: _embedding_backward,
    aten.native_layer_norm.default: _layer_norm,
    aten.native_layer_norm_backward.default: _layer_norm_backward,
    aten._fused_sdp_choice.default: _sdp_choice,
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_backward,
    aten.gelu.default: lambda out, x, *, approximate="none": em.nn.gelu(x, approximate=approximate),
    aten.gelu_backward.default: lambda out, grad, x, *, approximate="none": em.nn.gelu_grad(grad, x,
                                                                                           approximate=approximate),
}
