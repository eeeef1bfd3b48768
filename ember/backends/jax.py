"""The JAX backend: jax:cpu and jax:gpu:N through one code path, eager ops through jax.numpy: the
generic table (generic.py) over it, with JAX's renames and overrides (the table at the end).

ember's default dtypes (float64, int64) hold here as on every device, without touching the
user's global JAX configuration: every kernel, transfer and compiled call runs inside
``jax.enable_x64(True)``, a context that is local to the running thread (JAX without it
silently computes float64 inputs in float32). Arrays stay 64-bit outside the context; only
operations on them would narrow, and ember runs none outside it.

JAX arrays are immutable: ``setitem`` is the functional ``x.at[key].set(value)``. Index
arrays out of bounds, which JAX clamps, are refused first like NumPy does (eagerly; a compiled
graph keeps JAX's clamping, see docs/architecture.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import dtypes as dt
from ..errors import NotSupportedError
from ..ops.creation import arange_length
from ..ops.indexing import decode_key
from ..ops.nn import GELU_A, GELU_C
from . import generic
from .base import Backend
from .numpy_nn import GOLDEN, MIX1, MIX2

NATIVE, EMBER = dt.NUMPY, dt.FROM_NUMPY  # JAX arrays carry NumPy dtypes


def in_x64(function):
    """``function`` run with 64-bit types enabled for this thread (see the module docstring)."""
    @functools.wraps(function)
    def kernel(*args, **kwargs):
        with jax.enable_x64(True):
            return function(*args, **kwargs)
    return kernel


def _concrete(value) -> bool:
    return not isinstance(value, jax.core.Tracer)


def _check_bounds(indices, size: int, what: str) -> None:
    """IndexError for indices outside [-size, size) (JAX would clamp them); skipped while tracing."""
    if _concrete(indices) and indices.size and bool(jnp.any((indices < -size) | (indices >= size))):
        raise IndexError(f"{what}: an index is out of bounds for an axis of size {size}")


def _key(x, key, indices):
    """The native key, its integer index arrays checked against the axes they index."""
    native = decode_key(key, indices)

    def width(item):  # the axes of x an item consumes
        if item is None or item is Ellipsis:
            return 0
        return item.ndim if getattr(item, "dtype", None) == jnp.bool_ else 1
    dim = 0
    for item in native:
        if hasattr(item, "dtype") and item.dtype != jnp.bool_:
            _check_bounds(item, x.shape[dim], "index")
        dim += x.ndim - sum(map(width, native)) if item is Ellipsis else width(item)
    return native


def _getitem(x, *indices, key):
    return x[_key(x, key, indices)]


def _setitem(x, value, *indices, key):
    return x.at[_key(x, key, indices)].set(value)


def _take(x, indices, axis):
    _check_bounds(indices, x.shape[0 if axis is None else axis], "take")
    return jnp.take(x, indices, axis=axis)


def _take_along_axis(x, indices, axis):
    _check_bounds(indices, x.shape[axis], "take_along_axis")
    return jnp.take_along_axis(x, indices, axis=axis)


def _scatter_add(x, indices, values):
    return x.at[indices].add(values)


def _floor_divide(x1, x2):
    out = jnp.floor_divide(x1, x2)
    if jnp.issubdtype(out.dtype, jnp.floating):  # inf // finite must be floor(x1 / x2), as in NumPy's fix
        x1, x2 = jnp.asarray(x1, out.dtype), jnp.asarray(x2, out.dtype)
        quotient = jnp.divide(x1, x2)
        infinite = jnp.isinf(x1) & jnp.isfinite(x2) | jnp.isfinite(x1) & jnp.isinf(x2)
        out = jnp.where(infinite, jnp.floor(quotient), out)
        out = jnp.where(out == 0, jnp.copysign(out, quotient), out)  # -0 // 2 is -0, the quotient's sign; XLA's is +0
    return out


def _remainder(x1, x2):
    out = jnp.remainder(x1, x2)
    if jnp.issubdtype(out.dtype, jnp.floating):  # a zero result takes the sign of x2
        out = jnp.where(out == 0, jnp.copysign(out, jnp.asarray(x2, out.dtype)), out)
    return out


def _sign(x):
    return jnp.where(x == 0, jnp.zeros_like(x), jnp.sign(x))  # sign(±0) is +0, sign(0j) is 0j (not nan)


def _complex_edges(name, function):
    """``function`` with NumPy backend's values where a complex input is not finite: XLA's complex functions miss
    many of the standard's special cases there (exp(-inf + infj) is 0 + 0j). Eager only: a compiled graph keeps
    XLA's values (see docs/conformance.md)."""
    from .numpy import KERNELS as NUMPY_KERNELS
    reference = NUMPY_KERNELS[name]

    def kernel(x):
        out = function(x)
        if jnp.iscomplexobj(x) and _concrete(x) and x.size and not bool(jnp.all(jnp.isfinite(x))):
            host = np.asarray(x)
            with np.errstate(all="ignore"):
                fixed = np.where(np.isfinite(host), np.asarray(out), reference(host)).astype(host.dtype)
            out = jax.device_put(fixed, x.device)
        return out
    return kernel


def _repeat(x, repeats, axis):
    if isinstance(repeats, tuple):
        repeats = np.asarray(repeats)
        total = int(repeats.sum()) if repeats.size != 1 else int(repeats[0]) * (x.size if axis is None else x.shape[axis])
        return jnp.repeat(x, repeats, axis=axis, total_repeat_length=total)
    return jnp.repeat(x, repeats, axis=axis)


def _pinv(x, rtol):
    if rtol is None:  # the standard's default; JAX's is ten times larger
        rtol = max(x.shape[-2:]) * jnp.finfo(x.dtype).eps
    return jnp.linalg.pinv(x, rtol=rtol)


def _asinh(x):
    out = jnp.arcsinh(x)
    if jnp.iscomplexobj(out):  # on the branch cut (±0 + yj, |y| > 1) the real part takes the zero's sign; JAX's does not
        cut = (x.real == 0) & (jnp.abs(x.imag) > 1)
        out = jnp.where(cut, lax.complex(jnp.copysign(out.real, x.real), out.imag), out)
    return out


def _vector_norm(x, axis, keepdims, ord):
    if axis == ():  # over no axes each element is its own norm
        magnitude = jnp.abs(x)
        return (magnitude != 0).astype(magnitude.dtype) if ord == 0 else magnitude
    return jnp.linalg.vector_norm(x, axis=axis, keepdims=keepdims, ord=ord)


def _int64(kernel):
    """``kernel`` with its indices as int64 (jnp.searchsorted gives int32 even with 64-bit types enabled)."""
    return lambda *args, **attrs: kernel(*args, **attrs).astype(jnp.int64)


# --- nn ---------------------------------------------------------------------------------------------

def uniform_hash(size: int, seed: int):
    """numpy_nn.uniform_hash in uint64 arithmetic: the same bits on every device."""
    z = jnp.arange(size, dtype=jnp.uint64) + jnp.uint64(seed * GOLDEN % (1 << 64))
    z = (z ^ (z >> jnp.uint64(30))) * jnp.uint64(MIX1)
    z = (z ^ (z >> jnp.uint64(27))) * jnp.uint64(MIX2)
    z = z ^ (z >> jnp.uint64(31))
    return (z >> jnp.uint64(11)).astype(jnp.float64) * 2.0 ** -53


def _reduce(values, reduction):
    if reduction == "mean":
        return jnp.mean(values) if values.size else jnp.asarray(jnp.nan, values.dtype)
    return jnp.sum(values) if reduction == "sum" else values


def _cross_entropy(logits, target, reduction):
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return _reduce(-jnp.take_along_axis(log_p, target[:, None].astype(jnp.int64), axis=1)[:, 0], reduction)


def _conv(x, weight, stride, padding, dilation, groups):
    return lax.conv_general_dilated(x, weight, window_strides=stride, padding=[(p, p) for p in padding],
                                    rhs_dilation=dilation, feature_group_count=groups,
                                    dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _conv2d(x, weight, *bias, stride, padding, dilation, groups):
    out = _conv(x, weight, stride, padding, dilation, groups)
    return out + bias[0][None, :, None, None] if bias else out


def _conv2d_input_grad(g, weight, shape, stride, padding, dilation, groups):
    """The transposed convolution written out: g spread over a stride-sized grid, convolved with the kernel flipped
    and its channels swapped within each group. (jax.vjp's transpose, and lax's lhs_dilation, make XLA 0.10's
    algebraic simplifier abort the process for some shapes: a (1, 1, 3, 6) input, 2x2 windows, stride 2, padding
    (0, 1).)"""
    o, per_group, kh, kw = weight.shape
    flipped = (weight.reshape(groups, o // groups, per_group, kh, kw).transpose(0, 2, 1, 3, 4)
               .reshape(groups * per_group, o // groups, kh, kw)[:, :, ::-1, ::-1])
    pads = []
    for n, k, s, p, d in zip(shape[2:], (kh, kw), stride, padding, dilation):
        reach = d * (k - 1) + 1  # the dilated window
        pads.append((reach - 1 - p, reach - 1 - p + (n + 2 * p - reach) % s))  # the rows the strides left out, at the end
    (sh, sw), (batch, channels, oh, ow) = stride, g.shape
    spread = jnp.zeros((batch, channels, (oh - 1) * sh + 1, (ow - 1) * sw + 1), g.dtype).at[:, :, ::sh, ::sw].set(g)
    return lax.conv_general_dilated(spread, flipped, window_strides=(1, 1), padding=pads, rhs_dilation=dilation,
                                    feature_group_count=groups, dimension_numbers=("NCHW", "OIHW", "NCHW"))


def _conv2d_weight_grad(x, g, shape, stride, padding, dilation, groups):
    _, pullback = jax.vjp(lambda w: _conv(x, w, stride, padding, dilation, groups), jnp.zeros(shape, g.dtype))
    return pullback(g)[0]


def _pool(x, init, function, kernel_size, stride, padding):
    return lax.reduce_window(x, init, function, (1, 1, *kernel_size), (1, 1, *stride),
                             [(0, 0), (0, 0), *((p, p) for p in padding)])


def _max_pool2d(x, kernel_size, stride, padding):
    return _pool(x, jnp.array(-jnp.inf, x.dtype), lax.max, kernel_size, stride, padding)


def _max_pool2d_grad(x, g, kernel_size, stride, padding):
    _, pullback = jax.vjp(lambda v: _max_pool2d(v, kernel_size, stride, padding), x)
    return pullback(g)[0]


def _avg_pool2d(x, kernel_size, stride, padding):
    return _pool(x, jnp.array(0, x.dtype), lax.add, kernel_size, stride, padding) / math.prod(kernel_size)


@functools.partial(jax.jit, static_argnames="approximate")
def _gelu_grad(g, x, approximate):
    """g · gelu'(x), one fused XLA computation."""
    if approximate == "tanh":
        t = jnp.tanh(GELU_C * (x + GELU_A * (x * x * x)))
        return g * (0.5 * (1 + t + x * (1 - t * t) * (GELU_C * (1 + 3 * GELU_A * (x * x)))))
    return g * (0.5 * (1 + lax.erf(x / math.sqrt(2))) + x * jnp.exp(-0.5 * (x * x)) / math.sqrt(2 * math.pi))


def _arange(start, stop, step, dtype):
    n = arange_length(start, stop, step)
    if all(isinstance(v, int) for v in (start, stop, step)):
        return jnp.arange(start, start + n * step, step, dtype=NATIVE[dtype])[:n]
    return (start + step * jnp.arange(n, dtype=jnp.float64)).astype(NATIVE[dtype])  # NumPy's formula


# --- the table ---------------------------------------------------------------------------------------

# JAX's functions of the standard's names are wrappers of its NumPy-named ones, which the kernels call directly
XP = generic.Namespace(jnp, acos=jnp.arccos, acosh=jnp.arccosh, asin=jnp.arcsin, atan=jnp.arctan, atanh=jnp.arctanh,
                       atan2=jnp.arctan2, bitwise_invert=jnp.invert, bitwise_left_shift=jnp.left_shift,
                       bitwise_right_shift=jnp.right_shift, pow=jnp.power, concat=jnp.concatenate,
                       permute_dims=jnp.transpose)
_STANDARD = generic.kernels(XP, NATIVE)
_OWN = {
    **_STANDARD,
    "asinh": _asinh, "sign": _sign, "floor_divide": _floor_divide, "remainder": _remainder,  # XLA's values fixed
    **{name: _int64(_STANDARD[name]) for name in ("argmax", "argmin", "searchsorted")},
    "nonzero": lambda x: tuple(i.astype(jnp.int64) for i in jnp.nonzero(x)),
    # JAX arrays are immutable: where NumPy copies, JAX hands back the array itself
    "astype": lambda x, dtype, copy: x.astype(NATIVE[dtype]),
    "reshape": lambda x, shape, copy: jnp.reshape(x, shape),
    "fftshift": lambda x, axes: jnp.fft.fftshift(x, axes) if axes else x,
    "ifftshift": lambda x, axes: jnp.fft.ifftshift(x, axes) if axes else x,
    "repeat": _repeat, "pinv": _pinv, "vector_norm": _vector_norm,
    # indices out of bounds refused (JAX clamps them); setitem and scatter_add functional
    "getitem": _getitem, "setitem": _setitem, "take": _take, "take_along_axis": _take_along_axis,
    "scatter_add": _scatter_add,
    "arange": _arange, "empty": lambda shape, dtype: jnp.zeros(shape, dtype=NATIVE[dtype]),
    "dropout_mask": lambda shape, p, seed: (uniform_hash(math.prod(shape), seed) >= p).reshape(shape),
    # nn
    "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "silu": jax.nn.silu,
    "gelu": lambda x, approximate: jax.nn.gelu(x, approximate=approximate == "tanh"),
    "gelu_grad": _gelu_grad,
    "softmax": lambda x, axis: jax.nn.softmax(x, axis=axis), "log_softmax": lambda x, axis: jax.nn.log_softmax(x, axis=axis),
    "cross_entropy": _cross_entropy,
    "mse_loss": lambda x, y, reduction: _reduce((x - y) ** 2, reduction),
    "conv2d": _conv2d, "conv2d_input_grad": _conv2d_input_grad, "conv2d_weight_grad": _conv2d_weight_grad,
    "max_pool2d": _max_pool2d, "max_pool2d_grad": _max_pool2d_grad, "avg_pool2d": _avg_pool2d,
    "scaled_dot_product_attention": generic.attention(XP, jax.nn.softmax),
}
_COMPLEX_EDGES = ("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "exp", "expm1", "log", "log1p", "log2",
                  "log10", "sin", "sinh", "sqrt", "tan", "tanh")
KERNELS = {**_OWN, **{name: _complex_edges(name, _OWN[name]) for name in _COMPLEX_EDGES}}
CREATION = ("arange", "full", "empty", "eye", "linspace", "fftfreq", "rfftfreq", "dropout_mask")  # no array inputs


class JaxBackend(Backend):
    """One JAX device (cpu, or gpu:N)."""

    name = "jax"
    dtypes = dt.ALL
    gaps: dict = {}

    def __init__(self, device_name: str, device):
        self.device_name, self.device = device_name, device
        self.native_type = type(jax.device_put(np.zeros(()), device))
        put = functools.partial(jax.device_put, device=device)
        placed = {name: (lambda f: lambda *a, **k: put(f(*a, **k)))(KERNELS[name]) for name in CREATION}
        self.kernels = {name: in_x64(function) for name, function in {**KERNELS, **placed}.items()}

    @in_x64
    def coerce(self, value):
        return value if isinstance(value, jax.Array) else jax.device_put(value, self.device)  # a tracer stays

    def compiled(self, plan):
        return CompiledPlan(plan)

    def dtype_of(self, native) -> dt.DType:
        return EMBER[native.dtype]

    @in_x64
    def from_host(self, host: np.ndarray):
        return jax.device_put(host, self.device)

    def to_host(self, native) -> np.ndarray:
        return np.asarray(native)

    @in_x64
    def adopt(self, native):
        return jax.device_put(native, self.device)

    @in_x64
    def from_dlpack(self, obj, copy=None):
        array = jax.device_put(jnp.from_dlpack(obj), self.device)
        return jnp.array(array, copy=True) if copy else array


_UNTRACEABLE = (jax.errors.JAXTypeError, jax.errors.JAXIndexError)  # a kernel needed concrete values


class CompiledPlan:
    """A graph's plan compiled by ``jax.jit`` as one XLA program (traced again for new input shapes or
    dtypes, which ember's jit keys apart anyway). A graph that cannot be traced — data-dependent
    shapes (nonzero, unique, a boolean mask), bounds checks that read data — runs its plan eagerly,
    op by op, as on any backend; so does every later call of it."""

    def __init__(self, plan):
        self.plan, self.steps = plan, plan.steps
        outputs = plan.outputs
        self.jitted = jax.jit(lambda inputs: [plan.trace(inputs)[i] for i in outputs])
        self.eager = False

    def run(self, inputs) -> list:
        if not self.eager:
            try:
                with jax.enable_x64(True):
                    results = self.jitted(list(inputs))
            except Exception as error:  # the plan names the op; JAX's error, beneath, says whether it traced
                if not isinstance(error.__cause__ or error, _UNTRACEABLE):
                    raise
                self.eager = True
            else:
                return results
        return self.plan.run(inputs)


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        return []


def devices() -> list[str]:
    """``jax:cpu`` and one ``jax:gpu:N`` per visible GPU."""
    return ["jax:cpu"] + [f"jax:gpu:{i}" for i in range(len(_gpus()))]


_BACKENDS: dict[str, JaxBackend] = {}


def backend(device_name: str) -> JaxBackend:
    """The backend object of ``device_name`` ("jax:cpu", "jax:gpu:0" …)."""
    if device_name not in _BACKENDS:
        if device_name == "jax:cpu":
            device = jax.devices("cpu")[0]
        else:
            gpus, index = _gpus(), int(device_name.rsplit(":", 1)[1])
            if index >= len(gpus):
                raise NotSupportedError(f"{device_name}: this machine has {len(gpus)} JAX GPU device(s)")
            device = gpus[index]
        _BACKENDS[device_name] = JaxBackend(device_name, device)
    return _BACKENDS[device_name]
