"""Recipes for the neural-network rows (ember/ops/nn.py). The cotangent rows' recipes draw a
conv2d or max_pool2d example and a cotangent shaped like its output, through the rows' own rules."""

from __future__ import annotations

from ember import dtypes as dt
from ember.errors import ArgumentError, DTypeError, ShapeError
from ember.ops.nn import _REDUCTIONS, FLOAT, _conv_canon, _conv_meta, _pool_canon, _pool_meta
from ember.ops.table import Meta

from . import samples

EXAMPLES = {}
BAD_EXAMPLES = {}


def _activation(name, low=None, high=None, extra=None):
    EXAMPLES[name] = lambda g: ((g.array(g.shape(), g.dtype(FLOAT), low=low, high=high),), extra(g) if extra else {})
    BAD_EXAMPLES[name] = samples.wrong_kind(FLOAT, 1)


_activation("relu")
_activation("sigmoid")
_activation("silu")
_activation("gelu", extra=lambda g: {"approximate": g.choice(["none", "tanh"])})
BAD_EXAMPLES["gelu"] = [BAD_EXAMPLES["gelu"], samples.refusal([(3,)], {"approximate": "erf"}, ArgumentError)]


def _gelu_grad_examples(g):
    shape, dtype = g.shape(), g.dtype(FLOAT)
    return (g.array(shape, dtype), g.array(shape, dtype)), {"approximate": g.choice(["none", "tanh"])}


EXAMPLES["gelu_grad"] = _gelu_grad_examples
BRANCHES = {name: [{"approximate": "none"}, {"approximate": "tanh"}] for name in ("gelu", "gelu_grad")}
BAD_EXAMPLES["gelu_grad"] = [samples.refusal([(3,), (4,)], {"approximate": "none"}, ShapeError),
                             samples.refusal([(3,), (3,)], {"approximate": "Tanh"}, ArgumentError),
                             samples.refusal([(3,), (3,)], {"approximate": "none"}, DTypeError, [dt.int64, dt.int64])]


def _axis_examples(g):
    shape = g.shape(min_dims=1, min_side=1)
    return (g.array(shape, g.dtype(FLOAT)),), {"axis": g.integer(-len(shape), len(shape) - 1)}


for _name in ("softmax", "log_softmax"):
    EXAMPLES[_name] = _axis_examples
    BAD_EXAMPLES[_name] = samples.bad_axis(FLOAT)


def _cross_entropy_examples(g):
    n, c = g.integer(1, 5), g.integer(1, 4)
    return (g.array((n, c), g.dtype(FLOAT), low=-3, high=3), g.array((n,), dt.int64, low=0, high=c - 1)), \
        {"reduction": g.choice(_REDUCTIONS)}


def _mse_examples(g):
    shape, dtype = g.shape(min_side=1), g.dtype(FLOAT)
    return (g.array(shape, dtype), g.array(shape, dtype)), {"reduction": g.choice(_REDUCTIONS)}


def _linear_examples(g):
    dtype = g.dtype(FLOAT)
    n_in, n_out = g.integer(1, 4), g.integer(1, 4)
    arrays = (g.array(g.shape(max_dims=2) + (n_in,), dtype), g.array((n_out, n_in), dtype))
    return (arrays + ((g.array((n_out,), dtype),) if g.flag() else ())), {}


def _layer_norm_examples(g):
    dtype = g.dtype(FLOAT)
    shape = g.shape(min_dims=1, min_side=2)
    k = g.integer(1, len(shape))
    normalized = shape[len(shape) - k:]
    affine = (g.array(normalized, dtype), g.array(normalized, dtype)) if g.flag() else ()
    return (g.array(shape, dtype), *affine), {"normalized_shape": normalized, "eps": 1e-5}


def _embedding_examples(g):
    rows, dim = g.integer(1, 5), g.integer(1, 4)
    return (g.array(g.shape(max_dims=2), dt.int64, low=0, high=rows - 1), g.array((rows, dim), g.dtype(FLOAT))), {}


def _conv_examples(g):
    dtype = g.dtype(FLOAT)
    groups = g.choice([1, 1, 2])
    c, o = groups * g.integer(1, 2), groups * g.integer(1, 2)
    kh, kw = g.integer(1, 3), g.integer(1, 3)
    # each of stride, padding and dilation one int or a (height, width) pair, which may differ
    stride, padding, dilation = (g.choice([g.integer(low, high), (g.integer(low, high), g.integer(low, high))])
                                 for low, high in ((1, 2), (0, 1), (1, 2)))
    dh, dw = (dilation, dilation) if isinstance(dilation, int) else dilation
    h = g.integer(dh * (kh - 1) + 1, 6)
    w = g.integer(dw * (kw - 1) + 1, 6)
    arrays = (g.array((g.integer(1, 2), c, h, w), dtype), g.array((o, c // groups, kh, kw), dtype))
    if g.flag():
        arrays += (g.array((o,), dtype),)
    return arrays, {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}


def _conv_grad_example(role):
    """An example for a conv2d cotangent row: a conv2d example, and g shaped like its output."""
    def recipe(g):
        arrays, attrs = _conv_examples(g)
        x, weight = arrays[:2]
        pairs = _conv_canon(None, None, **attrs)
        out = _conv_meta(Meta(x.shape, dt.float64), Meta(weight.shape, dt.float64), **pairs)
        cotangent = g.array(out.shape, g.dtype_of(x))
        if role == "input":
            return (cotangent, weight), {"shape": x.shape, **attrs}
        return (x, cotangent), {"shape": weight.shape, **attrs}
    return recipe


def _pool_examples(g):
    kh, kw = g.integer(1, 3), g.integer(1, 3)
    shape = (g.integer(1, 2), g.integer(1, 2), g.integer(kh, 6), g.integer(kw, 6))
    padding = g.choice([g.integer(0, min(kh, kw) // 2), (g.integer(0, kh // 2), g.integer(0, kw // 2))])
    return (g.array(shape, g.dtype(FLOAT)),), {"kernel_size": (kh, kw), "stride": g.choice([None, 1, 2, (1, 2), (2, 1)]),
                                              "padding": padding}


def _max_pool_grad_examples(g):
    (x,), attrs = _pool_examples(g)
    pairs = _pool_canon(None, **attrs)
    out = _pool_meta(Meta(x.shape, dt.float64), **pairs)
    return (x, g.array(out.shape, g.dtype_of(x))), attrs


def _attention_examples(g):
    dtype = g.dtype(FLOAT)
    batch = g.shape(max_dims=2, min_side=1)
    length, source, e, ev = g.integer(1, 4), g.integer(1, 4), g.integer(1, 3), g.integer(1, 3)
    causal = g.flag()
    if causal:
        source = length
    arrays = (g.array(batch + (length, e), dtype), g.array(batch + (source, e), dtype), g.array(batch + (source, ev), dtype))
    if not causal and g.flag():
        # an additive mask of any shape that broadcasts to the scores' (..., L, S) without growing them
        arrays += (g.array(g.broadcastable(batch + (length, source), only_smaller=True), dtype, low=-2, high=0),)
    return arrays, {"is_causal": causal, "scale": g.choice([None, 0.5])}


EXAMPLES.update({
    "cross_entropy": _cross_entropy_examples,
    "mse_loss": _mse_examples,
    "linear": _linear_examples,
    "layer_norm": _layer_norm_examples,
    "dropout_mask": lambda g: ((), {"shape": g.shape(), "p": g.choice([0.0, 0.25, 0.5, 0.9]), "seed": g.integer(0, 2**40)}),
    "embedding": _embedding_examples,
    "conv2d": _conv_examples,
    "conv2d_input_grad": _conv_grad_example("input"),
    "conv2d_weight_grad": _conv_grad_example("weight"),
    "max_pool2d": _pool_examples,
    "avg_pool2d": _pool_examples,
    "max_pool2d_grad": _max_pool_grad_examples,
    "scaled_dot_product_attention": _attention_examples,
})

_bad = samples.refusal


_CONV = {"stride": 1, "padding": 0, "dilation": 1, "groups": 1}
_POOL = {"kernel_size": 2, "stride": None, "padding": 0}
_POOL_REFUSALS = [_bad([(1, 1, 2, 2)], {**_POOL, "kernel_size": 3}, ShapeError),
                  _bad([(1, 2, 2)], _POOL, ShapeError),
                  _bad([(1, 1, 4, 4)], {**_POOL, "kernel_size": 0}, ArgumentError),
                  _bad([(1, 1, 4, 4)], {**_POOL, "stride": (1, 0)}, ArgumentError),
                  _bad([(1, 1, 4, 4)], {**_POOL, "padding": 2}, ArgumentError),
                  _bad([(1, 1, 4, 4)], {**_POOL, "kernel_size": 4, "padding": (0, 3)}, ArgumentError),  # one side only
                  _bad([(1, 1, 4, 4)], {**_POOL, "kernel_size": (2, 2, 2)}, ArgumentError),
                  _bad([(1, 1, 4, 4)], {**_POOL, "stride": 1.5}, ArgumentError),
                  _bad([(1, 1, 4, 4)], {**_POOL, "padding": "1"}, ArgumentError),
                  _bad([(1, 1, 4, 4)], {**_POOL, "padding": -1}, ArgumentError),
                  _bad([(1, 1, 4, 4)], {**_POOL, "padding": (0, 0.5)}, ArgumentError)]  # the pair's second
_ATTENTION = {"is_causal": False, "scale": None}

BAD_EXAMPLES.update({
    "cross_entropy": [_bad([(3, 2), (4,)], {"reduction": "mean"}, ShapeError, [dt.float64, dt.int64]),
                      _bad([(3, 2), (3,)], {"reduction": "mean"}, DTypeError, [dt.float64, dt.float64]),  # class scores
                      _bad([(3, 2), (3,)], {"reduction": "mean"}, DTypeError, [dt.int64, dt.int64]),  # integer logits
                      _bad([(3, 2, 1), (3,)], {"reduction": "mean"}, ShapeError, [dt.float64, dt.int64]),
                      _bad([(3, 2), (3,)], {"reduction": "avg"}, ArgumentError, [dt.float64, dt.int64])],
    "mse_loss": [_bad([(3,), (4,)], {"reduction": "mean"}, ShapeError),
                 _bad([(3,), (3,)], {"reduction": "avg"}, ArgumentError)],
    "linear": [_bad([(2, 3), (4, 2)], {}, ShapeError), _bad([(2, 3), (4, 3), (5,)], {}, ShapeError),
               _bad([(2, 3), (3,)], {}, ShapeError)],
    "layer_norm": [_bad([(2, 3)], {"normalized_shape": (4,), "eps": 1e-5}, ShapeError),
                   _bad([(2, 3)], {"normalized_shape": (), "eps": 1e-5}, ShapeError),
                   _bad([(2, 3), (3,)], {"normalized_shape": (3,), "eps": 1e-5}, ShapeError),
                   _bad([(2, 3), (3,), (2,)], {"normalized_shape": (3,), "eps": 1e-5}, ShapeError)],
    "dropout_mask": [*(lambda g, p=p: ((), {"shape": (3,), "p": p, "seed": 0}, ArgumentError) for p in (1.5, 1.0, -0.1)),
                     lambda g: ((), {"shape": (3,), "p": 0.5, "seed": 1.5}, ArgumentError)],
    "embedding": [_bad([(2,), (3, 2)], {}, DTypeError), _bad([(2,), (3, 2)], {}, DTypeError, [dt.int64, dt.int64]),
                  _bad([(2,), (3, 2, 2)], {}, ShapeError, [dt.int64])],
    "conv2d": [_bad([(1, 3, 4, 4), (2, 2, 3, 3)], _CONV, ShapeError),
               _bad([(3, 4, 4), (2, 3, 3, 3)], _CONV, ShapeError),
               _bad([(1, 3, 4, 4, 4), (2, 3, 3, 3)], _CONV, ShapeError),  # each input's rank on its own
               _bad([(1, 3, 4, 4), (2, 3, 3)], _CONV, ShapeError),
               _bad([(1, 3, 4, 4), (2, 3, 3, 3), (3,)], _CONV, ShapeError),
               _bad([(1, 3, 2, 4), (2, 3, 3, 3)], _CONV, ShapeError),
               _bad([(1, 3, 4, 2), (2, 3, 3, 3)], _CONV, ShapeError),
               _bad([(1, 3, 4, 4), (2, 3, 3, 3)], {**_CONV, "stride": 0}, ArgumentError),
               _bad([(1, 3, 4, 4), (2, 3, 3, 3)], {**_CONV, "padding": (0, -1)}, ArgumentError),
               _bad([(1, 3, 4, 4), (2, 3, 3, 3)], {**_CONV, "dilation": "2"}, ArgumentError),
               _bad([(1, 3, 4, 4), (2, 3, 3, 3)], {**_CONV, "groups": 1.5}, ArgumentError),
               _bad([(1, 3, 4, 4), (2, 3, 3, 3)], {**_CONV, "stride": (1.5, 1)}, ArgumentError),  # the pair's first
               _bad([(1, 4, 4, 4), (3, 2, 3, 3)], {**_CONV, "groups": 2}, ShapeError),  # 3 outputs in 2 groups
               _bad([(1, 3, 4, 4), (2, 3, 3, 3)], {**_CONV, "groups": 0}, ShapeError)],
    "max_pool2d": _POOL_REFUSALS,
    "avg_pool2d": _POOL_REFUSALS,
    "scaled_dot_product_attention": [_bad([(2, 3), (2, 4), (2, 4)], _ATTENTION, ShapeError),
                                     _bad([(3,), (2, 3), (2, 3)], _ATTENTION, ShapeError),
                                     _bad([(2, 3), (4, 3), (5, 2)], _ATTENTION, ShapeError),
                                     _bad([(2, 3), (4, 3), (4, 2), (4, 2)], _ATTENTION, ShapeError),
                                     _bad([(2, 3), (4, 3), (4, 2), (2, 2, 4)], _ATTENTION, ShapeError),  # grows the scores
                                     _bad([(3,), (3,), (3,)], _ATTENTION, ShapeError),
                                     _bad([(2, 1, 4), (3, 1, 4), (3, 1, 4)], _ATTENTION, ShapeError)],  # q's batch alone
})
