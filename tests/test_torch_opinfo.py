"""ember.torch judged by PyTorch's own op tests: the OpInfo samples (torch.testing's op_db) of every op the table
lowers, and of every op ember runs through torch's decompositions, run on ember and compared with torch eager.

Which entries are judged is found, not listed: an entry whose aten op the table lowers (by name), and an entry whose
first sample, tried on ember at collection (numpy, forward only: about 1 s for all of op_db), reaches no
aten op without a lowering or a decomposition into lowered ones. A judged entry must pass every float32 sample —
values, shapes, dtypes and gradients through torch.autograd.grad; an entry that fails for a reason ember does not
honour is in KNOWN_FAILURES with the reason, a strict xfail, so that a fix flips it. ``tools/opinfo_report.py`` runs
this same judge and writes docs/torch-opinfo.md.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ember.torch as et  # noqa: E402
from ember.torch.errors import UnloweredOpError  # noqa: E402
from ember.torch.lowering import LOWERINGS  # noqa: E402

# --- PyTorch's own op tests as the judge: the OpInfo samples of every op the table lowers, float32 ----------------

LOWERED_NAMES = {op.overloadpacket.__name__.lstrip("_") for op in LOWERINGS}


def _op_db() -> list:
    """torch.testing's op_db, its entries with float32 samples ([] without expecttest)."""
    try:
        from torch.testing._internal.common_methods_invocations import op_db
    except ImportError:  # op_db needs expecttest, a test dependency of PyTorch's own
        return []
    return [info for info in op_db if torch.float32 in info.dtypes]


def _opinfos() -> list:
    """The OpInfo entries (torch.testing's op_db) whose aten op the lowering table holds, by the table's names."""
    return [info for info in _op_db() if info.aten_name in LOWERED_NAMES]


def _opinfo_id(info) -> str:
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def _leaves(value) -> list:
    from torch.utils._pytree import tree_flatten
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _first_sample(info):
    """The first float32 sample eager accepts (without gradients), or None: from the entry's sample function itself,
    for ``sample_inputs`` reads the caller's stack (inspect.stack, for its test's name), 40 ms a call in pytest."""
    torch.manual_seed(0)
    for sample in info.sample_inputs_func(info, "cpu", torch.float32, False):
        try:
            info.op(sample.input, *sample.args, **sample.kwargs)
        except Exception:  # noqa: BLE001 — a sample eager refuses judges nothing
            continue
        return sample
    return None


def why_not_run(info) -> str | None:
    """None where ember runs the entry's first sample (forward) without meeting an aten op it can neither lower nor
    decompose into lowered ones; else why not. Other errors count as running: the judge records them."""
    from torch.utils._pytree import tree_map
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        try:
            sample = _first_sample(info)
        except Exception as error:  # noqa: BLE001 — sample inputs this build cannot make (sparse layouts …)
            return f"its samples do not build here: {type(error).__name__}: {error}"
        if sample is None:
            return "eager refuses every float32 sample"
        arguments = (sample.input, sample.args, sample.kwargs)
        if not _leaves(arguments):
            return "its samples hold no tensor (a factory op: nothing runs on ember)"
        try:
            on_ember = tree_map(lambda x: et.to_device(x, "numpy") if isinstance(x, torch.Tensor) else x, arguments)
        except Exception as error:  # noqa: BLE001 — a layout ember holds no array of (sparse …)
            return f"its tensors do not move to ember: {type(error).__name__}: {error}"
        try:
            info.op(on_ember[0], *on_ember[1], **on_ember[2])
        except UnloweredOpError as error:
            return str(error).split(" (ember.torch.supported_ops()")[0]
        except Exception:  # noqa: BLE001 — it ran into ember: what went wrong is the judge's to record
            pass
    return None


def _decomposed() -> list:
    """The entries not in the table whose first sample ember runs through torch._decomp (or a composite kernel)."""
    return [info for info in _op_db() if info.aten_name not in LOWERED_NAMES and why_not_run(info) is None]


OPINFOS = _opinfos()
DECOMPOSED = _decomposed()
UNINITIALISED = {"empty_like", "new_empty", "new_empty_strided"}  # their values are whatever memory held: metas only

# why an entry's samples fail, by kind (docs/torch-opinfo.md has every failing sample, from tools/opinfo_report.py)
HOST = ("its decomposition makes a tensor on the host (a factory op on device cpu, the device an ember tensor reports) "
        "and mixes it with ember tensors")


def _reaches(op: str, via: str = "") -> str:
    return f"{via + ' ' if via else ''}reaches {op}, which ember neither lowers nor decomposes into lowered ops"


SQUEEZE_ = "matmul of a 1-d operand squeezes in place: aten.squeeze_ fails in ember's metas, sizes (1) vs strides (2) (ember bug)"
ROUNDING = "float32 rounding beyond rtol 1e-4/atol 1e-5 in a gradient"
ISNAN = _reaches("prims.ne", "aten.isnan's decomposition")
CONVOLUTIONS = "ember lowers 2-d, non-transposed convolutions only (aten.convolution)"
BACKWARD = "the gradient: {} has no lowering, and its decomposition reaches aten.where.ScalarSelf, which has none"

KNOWN_FAILURES: dict[str, str] = {  # entry → why ember does not pass all its float32 samples
    "native_layer_norm": f"{ROUNDING}: a 1-element normalized shape, where eager's weight gradient is rounding noise "
                         "(1.6e-5; its x̂ is not exactly 0) and ember's exactly 0",
    "nn.functional.layer_norm": f"{ROUNDING}: a 1-element normalized shape, where eager's weight gradient is rounding "
                                "noise (1.6e-5; its x̂ is not exactly 0) and ember's exactly 0",
    "nn.functional.scaled_dot_product_attention": f"{HOST} (the causal mask); {ROUNDING} (2.7e-5 where eager's reach 39)",
    "block_diag": f"{HOST} (aten.cat of an empty host block)",
    "corrcoef": _reaches("aten.as_strided", "aten.diagonal's decomposition"),
    "einsum": _reaches("aten.as_strided", "aten.diagonal's decomposition (a repeated subscript)"),
    "cov": "aten.min.default (a full reduction) has no lowering and no decomposition",
    "isin": _reaches("aten.sort", "aten.isin.Tensor_Tensor's decomposition"),
    "linspace.tensor_overload": f"{HOST}: aten.copy into a host tensor from an ember one refuses device cpu",
    "logspace.tensor_overload": f"{HOST}: aten.copy into a host tensor from an ember one refuses device cpu",
    "matmul": SQUEEZE_,
    "__rmatmul__": SQUEEZE_,
    "nn.functional.linear": SQUEEZE_,
    "nn.functional.linear_cross_entropy": f"{SQUEEZE_}; "
                                          + _reaches("aten.where.ScalarOther", "aten.nll_loss2d_forward's decomposition"),
    "nn.functional.cross_entropy": _reaches("aten.where.ScalarOther", "aten.nll_loss2d_forward's decomposition"),
    "nn.functional.nll_loss": _reaches("aten.where.ScalarOther", "aten.nll_loss2d_forward's decomposition"),
    "isclose": f"equal_nan=True: {ISNAN}",
    "norm.inf": ISNAN,
    "masked.norm": ISNAN,
    "masked.normalize": ISNAN,
    "linalg.vector_norm": ISNAN,
    "linalg.norm": f"{ISNAN}; aten._linalg_svd has no lowering",
    "linalg.norm.subgradients_at_zero": f"{ISNAN}; aten._linalg_svd has no lowering",
    "linalg.matrix_norm": "aten._linalg_svd has no lowering and no decomposition",
    "linalg.matrix_power": "negative powers: aten.linalg_inv_ex has no lowering and no decomposition",
    "nn.functional.adaptive_max_pool1d": "torch._decomp's aten.adaptive_max_pool2d returns NotImplemented for these "
                                         "sizes, which ember passes up as a TypeError; aten.adaptive_max_pool2d_backward "
                                         "has no lowering",
    "nn.functional.adaptive_max_pool2d": "torch._decomp's aten.adaptive_max_pool2d returns NotImplemented for these "
                                         "sizes, which ember passes up as a TypeError; aten.adaptive_max_pool2d_backward "
                                         "has no lowering",
    "nn.functional.conv1d": CONVOLUTIONS,
    "nn.functional.conv3d": f"{CONVOLUTIONS}; padding='same': "
                            + _reaches("prims.copy_to", "aten.constant_pad_nd's decomposition"),
    "nn.functional.conv_transpose1d": CONVOLUTIONS,
    "nn.functional.conv_transpose2d": CONVOLUTIONS,
    "nn.functional.conv_transpose3d": CONVOLUTIONS,
    "nn.functional.conv2d": "aten.convolution's lowering refuses a 1-element padding (0,), which aten expands to both "
                            "dimensions (ember bug); padding='same', an even kernel: "
                            + _reaches("prims.copy_to", "aten.constant_pad_nd's decomposition"),
    "nn.functional.pad.circular": "its decomposition copies into a slice (a view) of its result: ember refuses an "
                                  "in-place op on a view whose base is alive (AliasingError)",
    "nn.functional.hardswish": BACKWARD.format("aten.hardswish_backward"),
    "nn.functional.hardsigmoid": BACKWARD.format("aten.hardsigmoid_backward"),
    "nn.functional.hardtanh": BACKWARD.format("aten.hardtanh_backward"),
    "nn.functional.relu6": BACKWARD.format("aten.hardtanh_backward"),
    "nn.functional.prelu": BACKWARD.format("aten._prelu_kernel_backward"),
    "nn.functional.softshrink": "the gradient: aten.softshrink_backward has no lowering and no decomposition",
    "nn.functional.kl_div": _reaches("aten.where.ScalarSelf", "aten.xlogy.Tensor's decomposition"),
    "nn.functional.max_unpool1d": HOST,
    "nn.functional.max_unpool1d.grad": HOST,
    "nn.functional.max_unpool2d": HOST,
    "nn.functional.max_unpool2d.grad": HOST,
    "nn.functional.max_unpool3d": HOST,
    "nn.functional.max_unpool3d.grad": HOST,
    "mvlgamma.mvlgamma_p_1": f"{HOST} (torch.arange)",
    "mvlgamma.mvlgamma_p_3": f"{HOST} (torch.arange)",
    "mvlgamma.mvlgamma_p_5": f"{HOST} (torch.arange)",
    "select_scatter": f"{HOST} (the mask of aten.where)",
    "normal": f"{HOST} (the draws)",
    "svd_lowrank": f"{HOST} (a random projection)",
    "pca_lowrank": f"{HOST} (a random projection)",
    "masked.mean": f"{HOST} (the count it divides by)",
    "masked.var": f"{HOST} (the count it divides by)",
    "masked.std": f"{HOST} (the count it divides by)",
    "repeat": "a zero repeat count: its decomposition's empty result is a host tensor, not an ember one",
    "tile": "a zero repeat count: its decomposition's empty result is a host tensor, not an ember one",
    "roll": _reaches("aten.index_select", "aten.roll's decomposition"),
    "slice_scatter": _reaches("aten._unsafe_masked_index", "aten.slice_scatter's decomposition"),
    "repeat_interleave": "aten.repeat_interleave.Tensor has no lowering and no decomposition",
    "masked.prod": _reaches("prims.prod", "aten.prod.dim_int's decomposition"),
    "tensor_split": "tensor indices: its C++ kernel reads an ember tensor's data, which a wrapper tensor does not hold",
    "bucketize": "aten.where.self with two scalar branches: ember's where needs an array among them (ember bug); "
                 + _reaches("aten.index.Tensor", "aten.bucketize.Tensor's decomposition"),
    "to": "Tensor.to naming device cpu reads the tensor back to the host, by design (an ember tensor reports device "
          "cpu; .to('cpu') and .cpu() are its reads), where the samples expect the tensor to stay put",
    "bfloat16": "ember has no dtype torch.bfloat16",
    "half": "ember has no dtype torch.float16",
    "chalf": "ember has no dtype torch.complex32",
    "cfloat": "aten.view_as_real has no lowering and no decomposition",
    "cdouble": "aten.view_as_real has no lowering and no decomposition",
}


def _params(infos: list) -> list:
    return [pytest.param(info, id=_opinfo_id(info),
                         marks=[pytest.mark.xfail(reason=KNOWN_FAILURES[_opinfo_id(info)], strict=True)]
                         if _opinfo_id(info) in KNOWN_FAILURES else []) for info in infos]


@pytest.fixture(scope="module", params=["numpy", "peer"])
def judged_on(request):
    return request.param if request.param == "numpy" else request.getfixturevalue("peer").url()


def _compare(got, want, info, failures: list, what: str, rtol: float, on_ember: bool = True) -> None:
    """``got`` against eager's ``want``; ``on_ember``: each tensor must be an ember tensor (an op's results; a gradient
    autograd's engine fills with zeros it makes on the host, as for an input the op ignores, is judged by value)."""
    for g, w in zip(got, want):
        if (g is None) != (w is None) or not isinstance(w, torch.Tensor):
            if g != w:
                failures.append(f"{what}: {g!r} where eager gives {w!r}")
            continue
        if on_ember and not isinstance(g, et.Tensor):  # computed on the host, or made there: it left ember
            failures.append(f"{what}: a host {type(g).__name__}{tuple(g.shape)}, not an ember tensor: the result left ember")
        elif (g.dtype, tuple(g.shape)) != (w.dtype, tuple(w.shape)):
            failures.append(f"{what}: {g.dtype}{tuple(g.shape)} where eager gives {w.dtype}{tuple(w.shape)}")
        elif info.aten_name not in UNINITIALISED and not np.allclose(_elements(g), _elements(w), rtol=rtol, atol=1e-5,
                                                                      equal_nan=True):
            failures.append(f"{what}: values differ from eager's")


def _elements(tensor) -> np.ndarray:
    """A tensor's elements; eager's gradient may be an efficient zero tensor (sgn's), whose numpy() is refused."""
    if tensor._is_zerotensor():
        return np.zeros(tuple(tensor.shape), dtype=torch.empty((), dtype=tensor.dtype).numpy().dtype)
    return tensor.detach().cpu().numpy()


def judge(info, device) -> tuple[int, int, list[str]]:
    """Every float32 sample of ``info`` on ``device`` against eager: (samples judged, samples failed, failures)."""
    from torch.utils._pytree import tree_map
    failures, judged, failed = [], 0, 0
    for number, sample in enumerate(info.sample_inputs("cpu", torch.float32, requires_grad=info.supports_autograd)):
        arguments = (sample.input, sample.args, sample.kwargs)
        try:
            want = info.op(sample.input, *sample.args, **sample.kwargs)
        except Exception:  # noqa: BLE001 — a sample eager refuses judges nothing
            continue
        moved = {id(t): et.to_device(t, device) for t in _leaves(arguments)}
        on_ember = tree_map(lambda x: moved.get(id(x), x) if isinstance(x, torch.Tensor) else x, arguments)
        judged += 1
        before = len(failures)
        try:
            got = info.op(on_ember[0], *on_ember[1], **on_ember[2])
            _compare(_leaves(got), _leaves(want), info, failures, f"sample {number}", rtol=1e-5)
            differentiable = [(g, w) for g, w in zip(_leaves(got), _leaves(want)) if w.requires_grad]
            inputs = [t for t in _leaves(arguments) if t.requires_grad]
            if differentiable and inputs:
                cotangents = [torch.randn_like(w) for _, w in differentiable]
                eager = torch.autograd.grad([w for _, w in differentiable], inputs, cotangents, allow_unused=True)
                ours = torch.autograd.grad([g for g, _ in differentiable], [moved[id(t)] for t in inputs],
                                           [et.to_device(c, device) for c in cotangents], allow_unused=True)
                _compare(ours, eager, info, failures, f"sample {number}'s gradient", rtol=1e-4, on_ember=False)
        except Exception as error:  # noqa: BLE001 — every failure is recorded with its reason
            failures.append(f"sample {number}: {type(error).__name__}: {error}")
        failed += len(failures) > before
    return judged, failed, failures


@pytest.mark.skipif(not OPINFOS, reason="torch.testing's op_db needs the expecttest package")
@pytest.mark.parametrize("info", _params(OPINFOS))
def test_opinfo_samples_match_torch_eager_values_shapes_dtypes_and_gradients(info, judged_on):
    judged, failed, failures = judge(info, judged_on)
    print(f"\nFIGURE OpInfo {_opinfo_id(info)} on {judged_on}: {judged - failed}/{judged} samples")
    assert judged and not failures, failures


@pytest.mark.skipif(not DECOMPOSED, reason="torch.testing's op_db needs the expecttest package")
@pytest.mark.parametrize("info", _params(DECOMPOSED))
def test_opinfo_samples_of_ops_run_through_torchs_decompositions_match_torch_eager(info, judged_on):
    judged, failed, failures = judge(info, judged_on)
    print(f"\nFIGURE OpInfo {_opinfo_id(info)} (decomposed) on {judged_on}: {judged - failed}/{judged} samples")
    assert judged and not failures, failures
