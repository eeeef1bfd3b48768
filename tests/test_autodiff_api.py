"""The autodiff API at its edges: every misuse is refused naming the call and the fix, and
``detach``, ``.grad``, copies and in-place updates behave exactly as documented."""

from __future__ import annotations

import numpy as np
import pytest

import ember as em

TRACKED = em.autodiff("numpy")


def _leaf(values=(1.0, 2.0, 3.0)):
    return em.asarray(list(values), device=TRACKED).requires_grad_()


@pytest.mark.parametrize("call, what", [
    (lambda x: x.requires_grad_(), "requires_grad_"),
    (lambda x: x.grad, "grad"),
    (lambda x: setattr(x, "grad", None), "grad"),
    (lambda x: x.backward(), "backward"),
])
def test_an_untracked_array_names_the_call_and_the_device_to_use(call, what):
    with pytest.raises(em.DeviceError, match=rf"^{what}: arrays on numpy do not track gradients; "
                                             rf"create them on em.autodiff\(numpy\)$"):
        call(em.ones(3))


def test_requires_grad_accepts_only_real_floating_leaves():
    with pytest.raises(em.DTypeError, match=r"^requires_grad_: only real floating arrays can require gradients, got int64$"):
        em.asarray([1, 2], device=TRACKED).requires_grad_()
    w = _leaf()
    assert w.requires_grad and w.requires_grad_(False) is w and not w.requires_grad
    assert w.requires_grad_(True) is w and w.requires_grad
    assert not em.ones(3, device=TRACKED).requires_grad and not em.ones(3).requires_grad
    with pytest.raises(em.EmberError, match=r"^requires_grad_: an array computed from tracked arrays cannot stop "
                                            r"requiring grad; use x\.detach\(\)$"):
        (w * 2).requires_grad_(False)
    assert (w * 2).requires_grad_(True).requires_grad  # asking again for what holds is fine


def test_backward_explains_why_nothing_requires_grad():
    with pytest.raises(em.EmberError, match=r"^backward: this array does not require grad \(nothing it depends on "
                                            r"requires grad: call requires_grad_\(\) on the inputs\)$"):
        em.sum(em.ones(3, device=TRACKED) * 2).backward()
    with pytest.raises(em.EmberError, match=r"^backward: this array does not require grad: it comes from argmax, "
                                            r"which has no gradient$"):
        em.argmax(_leaf()).backward()


def test_backward_of_a_non_scalar_needs_a_gradient_of_its_shape():
    w = _leaf()
    y = w * w
    with pytest.raises(em.EmberError, match=r"^backward: the output has shape \(3,\); pass a gradient for a non-scalar output$"):
        y.backward()
    for bad in (em.ones(2), np.ones(3)):
        with pytest.raises(em.EmberError, match=r"^backward: the gradient must be an array of shape \(3,\)$"):
            y.backward(bad)
    y.backward(em.asarray([1.0, 0.5, 0.0], device=TRACKED))  # a tracked seed counts by its value
    np.testing.assert_array_equal(em.asnumpy(w.grad), [2.0, 2.0, 0.0])
    assert w.grad.device is TRACKED and not w.grad.requires_grad


def test_grad_can_be_set_to_an_array_of_its_shape_or_none():
    w = _leaf()
    assert w.grad is None
    for bad in (np.ones(3), em.ones(2), [1.0, 2.0, 3.0]):
        with pytest.raises(em.EmberError, match=r"^grad: expected an array of shape \(3,\) or None$"):
            w.grad = bad
    w.grad = em.asarray([0.5, 0.5, 0.5], device=TRACKED)
    em.sum(w).backward()  # accumulates onto what was set
    np.testing.assert_array_equal(em.asnumpy(w.grad), [1.5, 1.5, 1.5])
    w.grad = em.zeros(3)  # a plain array is accepted too
    np.testing.assert_array_equal(em.asnumpy(w.grad), [0.0, 0.0, 0.0])
    w.grad = None
    assert w.grad is None


def test_detach_keeps_value_device_and_meta_and_cuts_the_tape():
    w = _leaf()
    y = (w * 3).detach()
    assert y.device is TRACKED and y.shape == (3,) and y.dtype == em.float64 and not y.requires_grad
    np.testing.assert_array_equal(em.asnumpy(y), [3.0, 6.0, 9.0])
    em.sum(w * y).backward()  # y is a constant here: dL/dw = y
    np.testing.assert_array_equal(em.asnumpy(w.grad), [3.0, 6.0, 9.0])
    plain = em.ones(2)
    assert plain.detach() is plain


def test_uploads_to_a_tracked_device_copy_as_asked():
    host = np.ones(3)
    copied = em.asarray(host, device=TRACKED, copy=True)
    host[0] = 5.0
    assert em.asnumpy(copied)[0] == 1.0 and copied.device is TRACKED


def test_an_in_place_update_of_a_leaf_must_be_under_no_grad():
    w = _leaf()
    with pytest.raises(em.EmberError, match=r"^__iadd__: an in-place update of an array that requires grad would be "
                                            r"recorded; update parameters inside `with em.no_grad\(\):`$"):
        w += 1.0
    np.testing.assert_array_equal(em.asnumpy(w), [1.0, 2.0, 3.0])
    with em.no_grad():
        w -= em.asarray([1.0, 1.0, 1.0], device=TRACKED) * 0.5
    assert w.requires_grad and w.grad is None  # still a leaf
    np.testing.assert_array_equal(em.asnumpy(w), [0.5, 1.5, 2.5])
    em.sum(w * w).backward()
    np.testing.assert_array_equal(em.asnumpy(w.grad), [1.0, 3.0, 5.0])


def test_a_gradient_is_an_array_that_can_itself_be_tracked_and_differentiated():
    x = _leaf()
    em.sum(x * x).backward()  # x.grad = 2x
    y = _leaf((4.0, 5.0, 6.0))
    em.sum(y * x.grad).backward()  # d/dy sum(y · 2x) = 2x
    np.testing.assert_array_equal(em.asnumpy(y.grad), [2.0, 4.0, 6.0])
    assert x.grad.device is TRACKED and x.grad.shape == (3,) and x.grad.dtype == em.float64


def test_an_argument_the_function_ignores_gets_zeros_on_the_plain_device():
    x, unused = em.asarray([1.0, 2.0]), em.asarray([3.0, 4.0, 5.0])
    gx, gu = em.grad(lambda a, b: em.sum(a * a), argnums=(0, 1))(x, unused)
    assert gu.device is em.device("numpy") and gx.device is em.device("numpy")  # not em.autodiff("numpy")
    np.testing.assert_array_equal(em.asnumpy(gu), [0.0, 0.0, 0.0])


def test_a_tracked_array_converts_to_numpy_like_any_other():
    x = _leaf()
    np.testing.assert_array_equal(np.asarray(x * 2), [2.0, 4.0, 6.0])


def test_backward_through_an_op_without_a_gradient_rule_says_why():
    a = em.asarray(np.eye(3) + 0.1, device=TRACKED).requires_grad_()
    q, r = em.linalg.qr(a)
    with pytest.raises(em.NotSupportedError, match=r"^backward: qr: gradients are not implemented yet$"):
        em.sum(r).backward()
