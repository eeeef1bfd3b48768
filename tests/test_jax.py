"""The JAX backend beyond the generated op-table tests: imported lazily, ember's dtypes without the
user's global JAX configuration, functional updates, em.jit compiled by jax.jit, a jax peer."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import ember as em

from .peers import Peer

jax = pytest.importorskip("jax")


def test_import_ember_does_not_import_jax():
    code = "import sys, ember; ember.asarray([1.0]) + 1; print('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_defaults_are_64_bit_and_the_global_config_stays_as_it_was():
    before = jax.config.jax_enable_x64
    x = em.asarray([[1.5, 2.0], [3.0, 4.0]], device="jax:cpu")
    y = em.sum(x @ x.mT * 0.1 + 1)
    assert x.dtype == em.float64 and y.dtype == em.float64 and em.arange(3, device="jax:cpu").dtype == em.int64
    assert em.asnumpy(y) == em.asnumpy(em.sum(em.asarray(em.asnumpy(x)) @ em.asarray(em.asnumpy(x)).mT * 0.1 + 1))
    assert jax.config.jax_enable_x64 == before
    assert "jax:cpu" in [str(d) for d in em.__array_namespace_info__().devices()]


def test_setitem_is_a_functional_update_under_the_hood():
    x = em.zeros((2, 3), device="jax:cpu")
    before = x._handle  # the JAX array x held keeps its values: x is rebound to the updated one
    x[0, 1:] = 7.0
    x[em.asarray([1], device="jax:cpu")] = em.asarray([1.0, 2.0, 3.0], device="jax:cpu")
    assert em.asnumpy(x).tolist() == [[0, 7, 7], [1, 2, 3]] and np.asarray(before).tolist() == [[0] * 3] * 2


@pytest.mark.parametrize("copy", [None, False])
def test_dlpack_below_version_one_gives_jaxs_legacy_capsule_without_a_copy(copy):
    """A consumer that reads only DLPack before 1.0 (max_version=(0, 0)) gets the legacy capsule JAX gives a consumer
    naming no version, zero-copy, though JAX refuses that version number: copy=False holds too."""
    x = em.asarray([[1.5, 2.0], [3.0, 4.0]], device="jax:cpu")

    class OldConsumerView:  # what an old consumer is handed: the capsule for max_version=(0, 0)
        def __dlpack__(self, **_):
            return x.__dlpack__(max_version=(0, 0), copy=copy)

        def __dlpack_device__(self):
            return x.__dlpack_device__()

    capsule = x.__dlpack__(max_version=(0, 0), copy=copy)
    assert "dltensor" in repr(capsule) and "versioned" not in repr(capsule)
    host = np.from_dlpack(OldConsumerView())
    assert host.tolist() == [[1.5, 2.0], [3.0, 4.0]]
    assert host.__array_interface__["data"][0] == np.asarray(x._handle).__array_interface__["data"][0]  # no copy


def test_index_arrays_out_of_bounds_are_refused_not_clamped():
    x = em.arange(4, device="jax:cpu")
    with pytest.raises(em.IndexingError, match="out of bounds"):
        em.take(x, em.asarray([4], device="jax:cpu"))
    with pytest.raises(em.IndexingError, match="out of bounds"):
        x[em.asarray([-5], device="jax:cpu")]


def _mlp(x, w1, w2):
    return em.sum(em.tanh(x @ w1) @ w2 * 0.5, axis=-1)


def test_jit_compiles_the_graph_with_jax_jit_once_per_shapes():
    from ember.backends.jax import CompiledPlan
    rng = np.random.default_rng(0)
    hosts = [rng.standard_normal(s) for s in ((5, 3), (3, 4), (4, 2))]
    f = em.jit(_mlp)
    out = f(*(em.asarray(h, device="jax:cpu") for h in hosts))
    np.testing.assert_allclose(em.asnumpy(out), em.asnumpy(_mlp(*map(em.asarray, hosts))), rtol=1e-12)
    ((graph, _),) = f.graphs.values()
    plan = em.device("jax:cpu").engine._plans[graph]
    assert isinstance(plan, CompiledPlan) and not plan.eager
    f(*(em.asarray(h * 2, device="jax:cpu") for h in hosts))
    assert plan.jitted._cache_size() == 1 and em.device("jax:cpu").engine._plans[graph] is plan
    f(*(em.asarray(h.astype(np.float32), device="jax:cpu") for h in hosts))  # new dtypes: a new graph, a new plan
    assert len(f.graphs) == 2


def test_gradients_on_jax_equal_numpys():
    rng = np.random.default_rng(1)
    hosts = [rng.standard_normal(s) for s in ((5, 3), (3, 4), (4, 2))]
    grads = {}
    for name in ("numpy", "jax:cpu"):
        grad = em.jit(em.grad(lambda *a: em.sum(_mlp(*a) ** 2), argnums=(1, 2)))
        grads[name] = [em.asnumpy(g) for g in grad(*(em.asarray(h, device=name) for h in hosts))]
    for a, b in zip(grads["numpy"], grads["jax:cpu"]):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-14)


def test_a_jax_peer_runs_ops_and_compiled_graphs():
    rng = np.random.default_rng(2)
    hosts = [rng.standard_normal(s) for s in ((5, 3), (3, 4), (4, 2))]
    with Peer("--device", "jax:cpu") as peer:
        remote = em.device(peer.url())
        assert em.asarray([1.0, 2.0], device=remote).dtype == em.float64
        f = em.jit(_mlp)
        for _ in range(2):
            out = f(*(em.asarray(h, device=remote) for h in hosts))
            np.testing.assert_allclose(em.asnumpy(out), em.asnumpy(_mlp(*map(em.asarray, hosts))), rtol=1e-12)


@pytest.mark.parametrize("shape, kernel, stride, padding", [((1, 1, 3, 6), (2, 2), (2, 2), (0, 1)),
                                                           ((1, 1, 6, 3), (2, 2), (2, 2), (1, 0)),
                                                           ((2, 2, 3, 6), (3, 2), (2, 2), (1, 1))])
def test_convolution_input_gradients_that_made_xla_abort(shape, kernel, stride, padding):
    """jax.vjp's transposed convolution made XLA 0.10's algebraic simplifier abort the whole process for these shapes
    (a check failure, not an exception); the jax kernel writes the transposed convolution out instead."""
    rng = np.random.default_rng(0)
    host, kernel_values = rng.standard_normal(shape), rng.standard_normal((2, shape[1], *kernel))
    grads = []
    for device in ("numpy", "jax:cpu"):
        x = em.asarray(host, device=em.autodiff(device)).requires_grad_()
        weight = em.asarray(kernel_values, device=x.device)
        y = em.nn.avg_pool2d(x, kernel, stride=stride, padding=padding)
        (em.sum(y * y) + em.sum(em.nn.conv2d(x, weight, stride=stride, padding=padding))).backward()
        grads.append(em.asnumpy(x.grad))
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-10, atol=1e-12)
