"""The PyTorch backend: torch:cpu and torch:cuda:N through one code path.

Kernels are the generic table (generic.py) over torch, with torch's renames and overrides (the
table after the nn kernels): torch functions, through array_api_compat where its wrappers give the
standard's semantics. PyTorch stores uint16/uint32/uint64 tensors and converts them, but has no
arithmetic on them, so this backend holds arrays of those dtypes (moved in, moved out, cast with
``astype``) and declares them outside ``dtypes``, the dtypes ops compute on, instead of failing
inside kernels.
"""

from __future__ import annotations

import math

import array_api_compat.torch as compat
import numpy as np
import torch
import torch.nn.functional as F

from .. import dtypes as dt
from ..errors import NotSupportedError
from ..ops.creation import arange_length
from . import generic
from .base import Backend
from .numpy_nn import GOLDEN, MIX1, MIX2

SUPPORTED = tuple(d for d in dt.ALL if d not in (dt.uint16, dt.uint32, dt.uint64))
NATIVE = {d: getattr(torch, d.name) for d in dt.ALL}
EMBER = {v: k for k, v in NATIVE.items()}


def _scalars_as_tensors(function):
    """Binary kernels: a Python scalar operand becomes a 0-d tensor of the other's dtype
    (several torch functions accept tensors only)."""
    def kernel(x1, x2, **attrs):
        if not isinstance(x1, torch.Tensor):
            x1 = torch.tensor(x1, dtype=x2.dtype, device=x2.device)
        elif not isinstance(x2, torch.Tensor):
            x2 = torch.tensor(x2, dtype=x1.dtype, device=x1.device)
        return function(x1, x2, **attrs)
    return kernel


def _native_key(x, key, arrays):
    """``(axes to flip, torch key)`` for ember's key template. Torch has no negative-step
    slices: those axes are flipped and the slice mirrored. Beside index arrays, integers (and 0-d index arrays)
    count as advanced indices in NumPy, which decides where the arrays' dimensions go; torch takes an integer or a
    0-d tensor as a basic index, so they become tensors of the arrays' broadcast shape."""
    has_arrays = any(type(item) is tuple and item[0] == "a" for item in key)
    broadcast = torch.broadcast_shapes(*(arrays[item[1]].shape for item in key if type(item) is tuple and item[0] == "a"
                                         and arrays[item[1]].dtype != torch.bool)) if has_arrays else ()
    ndim = x.ndim
    consumed = sum(arrays[item[1]].ndim if type(item) is tuple and item[0] == "a" and arrays[item[1]].dtype == torch.bool
                   else 0 if item is None or item == "..." else 1 for item in key)
    dim = 0
    flips = []
    out = []
    for item in key:
        if type(item) is tuple and item[0] == "s":
            _, start, stop, step = item
            if step is not None and step < 0:
                size = x.shape[dim]
                picked = range(*slice(start, stop, step).indices(size))
                flips.append(dim)
                out.append(slice(size - 1 - picked[0], size - picked[-1], -step) if len(picked) else slice(0, 0))
            else:
                out.append(slice(start, stop, step))
            dim += 1
        elif type(item) is tuple:
            index = arrays[item[1]]
            if index.dtype == torch.bool and index.shape != x.shape[dim:dim + index.ndim]:
                # a mask with a 0-long axis selects nothing (the standard allows it; torch refuses the shape)
                index = torch.zeros(x.shape[dim:dim + index.ndim], dtype=torch.bool, device=x.device)
            out.append(index.expand(broadcast) if index.ndim == 0 and index.dtype != torch.bool else index)
            dim += index.ndim if index.dtype == torch.bool else 1
        elif item is None:
            out.append(None)
        elif item == "...":
            out.append(Ellipsis)
            dim += ndim - consumed
        else:
            out.append(torch.tensor(item, device=x.device).expand(broadcast) if has_arrays else item)
            dim += 1
    return flips, tuple(out)


def _getitem(x, *indices, key):
    flips, native = _native_key(x, key, indices)
    return (torch.flip(x, flips) if flips else x)[native]


def _setitem(x, value, *indices, key):
    flips, native = _native_key(x, key, indices)
    out = torch.flip(x, flips) if flips else x.clone()  # torch.flip copies
    out[native] = value
    return torch.flip(out, flips) if flips else out


def _positive_indices(indices, size):
    return torch.where(indices < 0, indices + size, indices)


def _expand_dims(x, axis):
    for a in (axis,) if isinstance(axis, int) else axis:  # sorted positions in the result: each insert keeps the others'
        x = torch.unsqueeze(x, a)
    return x


@_scalars_as_tensors
def _isin(x1, x2, invert):
    if x1.dtype == torch.bool:  # torch.isin has no bool kernel
        x1, x2 = x1.to(torch.uint8), x2.to(torch.uint8)
    return torch.isin(x1, x2, invert=invert)


def _take(x, indices, axis):
    axis = 0 if axis is None else axis
    return torch.index_select(x, axis, _positive_indices(indices, x.shape[axis]))


def _take_along_axis(x, indices, axis):
    return torch.take_along_dim(x, _positive_indices(indices, x.shape[axis]), dim=axis)


def _sum_like(function):
    def kernel(x, axis, dtype, keepdims):
        if axis == ():
            return x.to(NATIVE[dtype], copy=True)
        return function(x, axis=axis, dtype=NATIVE[dtype], keepdims=keepdims)
    return kernel


def _reduce(function):
    def kernel(x, axis, keepdims, **attrs):
        if axis == ():
            return x.clone()
        return function(x, axis=axis, keepdims=keepdims, **attrs)
    return kernel


def _imag(x):
    return x.imag if x.is_complex() else torch.zeros_like(x)


def _round(x):
    if x.is_complex():
        return torch.complex(torch.round(x.real), torch.round(x.imag))
    return torch.round(x) if x.is_floating_point() else x.clone()


def _repeat(x, repeats, axis):
    if isinstance(repeats, tuple):
        repeats = torch.tensor(repeats, dtype=torch.int64, device=x.device)
    return torch.repeat_interleave(x.reshape(-1) if axis is None else x, repeats, dim=0 if axis is None else axis)


def _unique_all(x):
    values, inverse, counts = _unique_flat(x)
    positions = torch.arange(inverse.numel(), device=x.device)
    first = torch.full((values.numel(),), inverse.numel(), dtype=torch.int64, device=x.device)
    first = first.scatter_reduce(0, inverse, positions, reduce="amin")
    return values, first, inverse.reshape(x.shape), counts


def _vecdot(x1, x2, axis):
    if x1.is_floating_point() or x1.is_complex():
        return torch.linalg.vecdot(x1, x2, dim=axis)
    return torch.sum(x1 * x2, dim=axis, dtype=x1.dtype)  # torch's vecdot takes floating inputs only


def _vector_norm(x, axis, keepdims, ord):
    if axis == ():  # torch reads dim=() as every axis; over no axes each element is its own norm
        magnitude = torch.abs(x)
        return (magnitude != 0).to(magnitude.dtype) if ord == 0 else magnitude
    return torch.linalg.vector_norm(x, ord=ord, dim=axis, keepdim=keepdims)


def _pow(x1, x2):
    out = compat.pow(x1, x2)
    if out.is_complex():  # torch gives nan for a complex 0 ** 0; the standard says 1
        out = torch.where(x2 == 0, torch.ones_like(out), out)
    return out


def _floor_divide(x1, x2):
    out = torch.floor_divide(x1, x2)
    if out.is_floating_point():  # torch gives nan for inf // finite and -1 for 1 // -inf; the standard wants floor(x1 / x2)
        infinite = torch.isinf(x1) & torch.isfinite(x2) | torch.isfinite(x1) & torch.isinf(x2)
        out = torch.where(infinite, torch.floor(torch.divide(x1, x2)), out)
    return out


def _remainder(x1, x2):
    out = torch.remainder(x1, x2)
    if out.is_floating_point():  # a zero result takes the sign of x2; torch keeps x1's (remainder(-0, 2) is -0)
        out = torch.where(out == 0, torch.copysign(out, x2), out)
    return out


def _acos(x):
    out = torch.acos(x)
    if out.is_complex():  # on the real axis the imaginary part's sign must mirror x's (acos(0 + 0j) is π/2 - 0j);
        on_axis = x.imag == 0  # torch loses it
        out = torch.where(on_axis, torch.complex(out.real, torch.copysign(out.imag, -x.imag)), out)
    return out


def _add_one(x):
    """``x + 1`` keeping the sign of a zero imaginary part (adding 1 + 0j would make -0j into +0j)."""
    return torch.complex(x.real + 1, x.imag) if x.is_complex() else x + 1


def _expm1(x):
    out = torch.expm1(x)
    if out.is_complex():  # torch's complex expm1 gives nan + nanj at infinities and nans; exp(x) - 1 is right there
        exp = torch.exp(x)
        out = torch.where(torch.isfinite(x), out, torch.complex(exp.real - 1, exp.imag))
        # and -0 + 0j for -0 + 0j, where the standard wants +0 + 0j
        out = torch.where(x == 0, torch.complex(torch.zeros_like(x.real), x.imag), out)
    return out


def _tanh(x):
    out = torch.tanh(x)
    if out.is_complex():  # tanh(±inf + yj) is ±1 + 0j with the zero signed like y; torch signs it like sin(2y)
        edge = torch.isinf(x.real) & torch.isfinite(x.imag)
        out = torch.where(edge, torch.complex(torch.sign(x.real), torch.copysign(torch.zeros_like(x.imag), x.imag)), out)
    return out


def _log1p(x):
    out = torch.log1p(x)
    if out.is_complex():  # torch's complex log1p gives nan + nanj for ±inf + nanj and nan + infj; log(1 + x) is right there
        out = torch.where(torch.isfinite(x), out, torch.log(_add_one(x)))
    return out


def _variance(x, axis, correction, keepdims):
    """torch.var refuses a fractional correction (pytorch#61492) and reads axis=() as every axis,
    so those are computed from the definition."""
    if axis != () and float(correction).is_integer():
        return compat.var(x, axis=axis, correction=int(correction), keepdims=keepdims)
    dims = tuple(range(x.ndim)) if axis is None else axis
    if not dims:
        return torch.zeros_like(x) / (1 - correction)
    count = math.prod(x.shape[d] for d in dims)
    squares = torch.square(x - torch.mean(x, dim=dims, keepdim=True))
    return torch.sum(squares, dim=dims, keepdim=keepdims) / (count - correction)


def _std(x, axis, correction, keepdims):
    return torch.sqrt(_variance(x, axis, correction, keepdims))


def _roll(x, shift, axis):
    if axis is None:
        return torch.roll(x, shift)
    return torch.roll(x, shift, axis) if axis else x.clone()  # torch refuses empty shifts; rolling no axes is a copy


def _unique_flat(x):
    """``(values, inverse, counts)`` over x's elements, NaNs distinct. torch.unique lacks complex
    dtypes, so complex numbers are made unique as (real, imag) rows."""
    flat = x.reshape(-1)
    if x.is_complex():
        rows, inverse, counts = torch.unique(torch.view_as_real(flat), dim=0, return_inverse=True, return_counts=True)
        return torch.view_as_complex(rows.contiguous()), inverse, counts
    return torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)


def _unique_values(x):
    return _unique_flat(x)[0]


def _unique_counts(x):
    values, _, counts = _unique_flat(x)
    return values, counts


def _unique_inverse(x):
    values, inverse, _ = _unique_flat(x)
    return values, inverse.reshape(x.shape)


# --- nn ---------------------------------------------------------------------------------------------

def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch multiplies with the same wrap-around."""
    value %= 1 << 64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z, k: int):
    return (z >> k) & ((1 << (64 - k)) - 1)  # a logical shift on int64


def _uniform_hash(size: int, seed: int, device) -> torch.Tensor:
    """numpy_nn.uniform_hash in int64 arithmetic: the same bits on every torch device."""
    z = torch.arange(size, dtype=torch.int64, device=device) + _signed(seed * GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _signed(MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(MIX2)
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).to(torch.float64) * 2.0 ** -53


def _max_pool2d_grad(x, g, kernel_size, stride, padding):
    _, indices = F.max_pool2d(x, kernel_size, stride, padding, return_indices=True)
    n, c, h, w = x.shape
    gx = torch.zeros((n, c, h * w), dtype=g.dtype, device=g.device)
    return gx.scatter_add_(2, indices.reshape(n, c, -1), g.reshape(n, c, -1)).reshape(x.shape)


def _layer_norm(x, *affine, normalized_shape, eps):
    weight, bias = affine if affine else (None, None)
    return F.layer_norm(x, normalized_shape, weight, bias, eps=eps)


# --- the table ---------------------------------------------------------------------------------------

# torch under the standard's names: its own functions of other names, and array_api_compat's where torch's do not
# take the standard's arguments (fftn's axes among them). Its argument parser takes NumPy's ``axis`` and ``keepdims``
# for ``dim`` and ``keepdim`` (as array_api_compat relies on), so the other generic rows call torch's own unchanged.
XP = generic.Namespace(
    torch, bitwise_invert=torch.bitwise_not, conj=torch.conj_physical, positive=torch.clone, equal=torch.eq,
    not_equal=torch.ne, greater=torch.gt, greater_equal=torch.ge, less=torch.lt, less_equal=torch.le,
    moveaxis=torch.movedim, permute_dims=torch.permute, unstack=torch.unbind, fft=compat.fft,
    linalg=generic.Namespace(torch.linalg, solve=compat.linalg.solve, cross=compat.linalg.cross),
    **{name: getattr(compat, name) for name in ("sign", "cumulative_sum", "cumulative_prod", "sort", "argsort", "reshape")})

KERNELS = {
    **generic.kernels(XP, NATIVE),
    # torch's values fixed where the standard's differ
    "acos": _acos, "expm1": _expm1, "imag": _imag, "log1p": _log1p, "round": _round, "tanh": _tanh, "pow": _pow,
    "floor_divide": _floor_divide, "remainder": _remainder,
    # torch reads axis=() as every axis: over no axes a reduction is a copy
    "sum": _sum_like(compat.sum), "prod": _sum_like(compat.prod),
    "max": _reduce(compat.max), "min": _reduce(compat.min), "mean": _reduce(compat.mean),
    "std": _std, "var": _variance,
    "all": lambda x, axis, keepdims: compat.all(x, axis=axis, keepdims=keepdims) if axis != () else x.to(torch.bool),
    "any": lambda x, axis, keepdims: compat.any(x, axis=axis, keepdims=keepdims) if axis != () else x.to(torch.bool),
    "count_nonzero": lambda x, axis, keepdims: compat.count_nonzero(x, axis=axis, keepdims=keepdims).to(torch.int64)
    if axis != () else (x != 0).to(torch.int64),
    "vector_norm": _vector_norm,
    # the rows torch spells another way
    "diff": lambda x, axis, n: torch.diff(x, n=n, dim=axis) if n else x.clone(),
    "isin": _isin,
    "nonzero": lambda x: torch.nonzero(x, as_tuple=True),
    "unique_values": _unique_values, "unique_counts": _unique_counts, "unique_inverse": _unique_inverse,
    "unique_all": _unique_all,
    "astype": lambda x, dtype, copy: x.to(NATIVE[dtype], copy=copy),
    "broadcast_to": lambda x, shape: torch.broadcast_to(x, shape),
    "concat": lambda *arrays, axis: torch.cat([a.reshape(-1) for a in arrays] if axis is None else arrays, dim=axis or 0),
    "expand_dims": _expand_dims,
    "flip": lambda x, axis: torch.flip(x, tuple(range(x.ndim)) if axis is None else axis),
    "repeat": _repeat,
    "roll": _roll,
    "squeeze": lambda x, axis: torch.squeeze(x, axis) if axis else x,
    "getitem": _getitem, "setitem": _setitem, "take": _take, "take_along_axis": _take_along_axis,
    "scatter_add": lambda x, indices, values: x.index_add(0, indices, values),
    "tensordot": lambda x1, x2, axes: torch.tensordot(x1, x2, dims=(list(axes[0]), list(axes[1]))),
    "vecdot": _vecdot,
    "eig": lambda x: tuple(torch.linalg.eig(x)), "eigvals": torch.linalg.eigvals,
    "diagonal": lambda x, offset: torch.diagonal(x, offset, dim1=-2, dim2=-1),
    "trace": lambda x, offset, dtype: torch.sum(torch.diagonal(x, offset, dim1=-2, dim2=-1), dim=-1, dtype=NATIVE[dtype]),
    "fftshift": lambda x, axes: torch.fft.fftshift(x, axes) if axes else x.clone(),
    "ifftshift": lambda x, axes: torch.fft.ifftshift(x, axes) if axes else x.clone(),
    # nn
    "relu": torch.relu, "sigmoid": torch.sigmoid, "silu": F.silu,
    "gelu": lambda x, approximate: F.gelu(x, approximate=approximate),
    "gelu_grad": lambda g, x, approximate: torch.ops.aten.gelu_backward(g, x, approximate=approximate),
    "softmax": lambda x, axis: torch.softmax(x, axis), "log_softmax": lambda x, axis: torch.log_softmax(x, axis),
    "cross_entropy": lambda logits, target, reduction: F.cross_entropy(logits, target.long(), reduction=reduction),
    "mse_loss": lambda x, y, reduction: F.mse_loss(x, y, reduction=reduction),
    "linear": lambda x, weight, *bias: F.linear(x, weight, bias[0] if bias else None),
    "layer_norm": _layer_norm,
    "embedding": lambda indices, weight: F.embedding(indices.long(), weight),
    "conv2d": lambda x, weight, *bias, stride, padding, dilation, groups: F.conv2d(
        x, weight, bias[0] if bias else None, stride, padding, dilation, groups),
    "conv2d_input_grad": lambda g, weight, shape, stride, padding, dilation, groups: torch.nn.grad.conv2d_input(
        shape, weight, g, stride, padding, dilation, groups),
    "conv2d_weight_grad": lambda x, g, shape, stride, padding, dilation, groups: torch.nn.grad.conv2d_weight(
        x, shape, g, stride, padding, dilation, groups),
    "max_pool2d": lambda x, kernel_size, stride, padding: F.max_pool2d(x, kernel_size, stride, padding),
    "max_pool2d_grad": _max_pool2d_grad,
    "avg_pool2d": lambda x, kernel_size, stride, padding: F.avg_pool2d(x, kernel_size, stride, padding, count_include_pad=True),
    # PyTorch reads a mask's last two axes before broadcasting it: a 0-d or 1-d mask gets leading 1s first
    "scaled_dot_product_attention": lambda q, k, v, *mask, is_causal, scale: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[0].reshape((1,) * (2 - mask[0].ndim) + tuple(mask[0].shape)) if mask else None,
        is_causal=is_causal, scale=scale),
}
# several torch functions take tensors only: a Python scalar operand of a binary row becomes a 0-d tensor
KERNELS.update({name: _scalars_as_tensors(KERNELS[name]) for name in generic.BINARY})


def _creation_kernels(device: torch.device) -> dict:
    """Kernels without array inputs, which must be told the device."""
    def arange(start, stop, step, dtype):
        n = arange_length(start, stop, step)
        if all(isinstance(v, int) for v in (start, stop, step)):
            return torch.arange(start, start + n * step, step, dtype=NATIVE[dtype], device=device)[:n]
        # NumPy's formula (start + i*step) so the length always matches the meta rule
        return (start + step * torch.arange(n, dtype=torch.float64, device=device)).to(NATIVE[dtype])

    return {
        "dropout_mask": lambda shape, p, seed: (_uniform_hash(math.prod(shape), seed, device) >= p).reshape(shape),
        "arange": arange,
        "full": lambda shape, fill_value, dtype: torch.full(shape, fill_value, dtype=NATIVE[dtype], device=device),
        "empty": lambda shape, dtype: torch.empty(shape, dtype=NATIVE[dtype], device=device),
        "eye": lambda n_rows, n_cols, k, dtype: compat.eye(n_rows, n_cols, k=k, dtype=NATIVE[dtype], device=device),
        "linspace": lambda start, stop, num, dtype, endpoint: compat.linspace(
            start, stop, num, dtype=NATIVE[dtype], device=device, endpoint=endpoint),
        "fftfreq": lambda n, d, dtype: torch.fft.fftfreq(n, d, dtype=NATIVE[dtype], device=device),
        "rfftfreq": lambda n, d, dtype: torch.fft.rfftfreq(n, d, dtype=NATIVE[dtype], device=device),
    }


class TorchBackend(Backend):
    """One torch device (cpu or cuda:N)."""

    name = "torch"
    native_type = torch.Tensor
    dtypes = SUPPORTED
    gaps: dict = {}

    def __init__(self, device_name: str):
        self.device_name = device_name
        self.device = torch.device(device_name.split(":", 1)[1])
        self.kernels = {**KERNELS, **_creation_kernels(self.device)}

    def coerce(self, value):
        return torch.as_tensor(value, device=self.device)

    def dtype_of(self, native) -> dt.DType:
        try:
            return EMBER[native.dtype]
        except KeyError:
            raise NotSupportedError(f"torch dtype {native.dtype} is not supported by ember") from None

    def from_host(self, host: np.ndarray):
        if not host.flags.writeable or any(s < 0 for s in host.strides):
            host = np.array(host)  # torch.from_numpy needs writable, non-negative strides
        tensor = torch.from_numpy(host)
        return tensor if self.device.type == "cpu" else tensor.to(self.device)

    def to_host(self, native) -> np.ndarray:
        return native.detach().cpu().resolve_conj().resolve_neg().numpy()

    def adopt(self, native):
        """``native`` on this device: shared on the same device, copied device to device (CUDA peer to
        peer where the hardware allows) otherwise, never through the host."""
        return native.to(self.device)

    def from_dlpack(self, obj, copy=None):
        tensor = torch.from_dlpack(obj)
        if tensor.device != self.device:
            return tensor.to(self.device)
        return tensor.clone() if copy else tensor


def devices() -> list[str]:
    """``torch:cpu`` and one ``torch:cuda:N`` per visible GPU."""
    return ["torch:cpu"] + [f"torch:cuda:{i}" for i in range(torch.cuda.device_count())]


_BACKENDS: dict[str, TorchBackend] = {}


def backend(device_name: str) -> TorchBackend:
    """The backend object of ``device_name`` ("torch:cpu", "torch:cuda:1" …)."""
    if device_name not in _BACKENDS:
        if device_name.startswith("torch:cuda") and int(device_name.rsplit(":", 1)[1]) >= torch.cuda.device_count():
            raise NotSupportedError(f"{device_name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        _BACKENDS[device_name] = TorchBackend(device_name)
    return _BACKENDS[device_name]
