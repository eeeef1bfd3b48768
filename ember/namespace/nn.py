"""``ember.nn``: functional neural-network operations (plain arrays in and out, any device).

Each is an op row (ember/ops/nn.py) with meta and gradient rules; optional arrays (a bias, an
affine pair, an attention mask) travel as trailing inputs.
"""

from __future__ import annotations

from ..array import Array, bind
from ..devices import device as as_device
from ..ops import OPS
from ._generate import from_row, lift, promote_all, require_array

relu = from_row("relu")
sigmoid = from_row("sigmoid")
silu = from_row("silu")
gelu = from_row("gelu")
gelu_grad = from_row("gelu_grad")
softmax = from_row("softmax")
log_softmax = from_row("log_softmax")
cross_entropy = from_row("cross_entropy")
mse_loss = from_row("mse_loss")
embedding = from_row("embedding")
max_pool2d = from_row("max_pool2d")
avg_pool2d = from_row("avg_pool2d")
conv2d_input_grad = from_row("conv2d_input_grad")
conv2d_weight_grad = from_row("conv2d_weight_grad")
max_pool2d_grad = from_row("max_pool2d_grad")
_dropout_mask = from_row("dropout_mask")

__all__ = ["relu", "sigmoid", "silu", "gelu", "softmax", "log_softmax", "cross_entropy", "mse_loss", "linear",
           "layer_norm", "dropout", "dropout_mask", "embedding", "conv2d", "max_pool2d", "avg_pool2d",
           "scaled_dot_product_attention"]


def _with_optional(name: str, arrays: tuple, attrs: dict):
    op = OPS[name]
    for a in arrays:
        require_array(a, name)
    arrays = promote_all(name, lift(op, arrays))
    return bind(op, arrays, attrs)


def linear(x, weight, bias=None) -> Array:
    """x @ weight.T + bias, with weight shaped (out, in) as in PyTorch."""
    return _with_optional("linear", (x, weight) + ((bias,) if bias is not None else ()), {})


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> Array:
    """Normalise the trailing ``normalized_shape`` axes; then scale by weight and shift by bias
    (both or neither)."""
    affine = (weight, bias) if weight is not None or bias is not None else ()
    if affine and (weight is None or bias is None):
        from ..errors import ArgumentError
        raise ArgumentError("layer_norm: give both weight and bias, or neither")
    return _with_optional("layer_norm", (x, *affine), {"normalized_shape": normalized_shape, "eps": eps})


def conv2d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1) -> Array:
    """2-d convolution of NCHW input with OIHW weight (PyTorch's cross-correlation)."""
    return _with_optional("conv2d", (x, weight) + ((bias,) if bias is not None else ()),
                          {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups})


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal: bool = False, scale=None) -> Array:
    """softmax(q @ k.T · scale + attn_mask) @ v; ``is_causal`` masks the future."""
    return _with_optional("scaled_dot_product_attention", (q, k, v) + ((attn_mask,) if attn_mask is not None else ()),
                          {"is_causal": is_causal, "scale": scale})


def dropout_mask(shape, p: float = 0.5, *, seed: int, device=None) -> Array:
    """A boolean keep-mask (P(keep) = 1 - p) that depends only on (shape, p, seed)."""
    return _dropout_mask(shape=shape, p=p, seed=seed, device=as_device(device) if device is not None else None)


def dropout(x, p: float = 0.5, *, seed: int, training: bool = True) -> Array:
    """Zero elements with probability p and scale the rest by 1/(1-p); the mask is a pure
    function of (shape, p, seed), identical on every backend, device and replay."""
    require_array(x, "dropout")
    if not training or p == 0:
        return x
    from .searching import where
    mask = dropout_mask(x.shape, p, seed=seed, device=x.device.inner())
    return where(mask, x / (1 - p), 0.0)
