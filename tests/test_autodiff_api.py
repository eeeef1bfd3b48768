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


# --- the functional API: em.grad and em.value_and_grad at their edges ---------------------------------------

def _in_a_new_thread(function):
    """function()'s result, run in a thread of its own (thread-local state at its defaults); its error re-raised."""
    import threading
    box = {}

    def run():
        try:
            box["result"] = function()
        except BaseException as error:  # noqa: BLE001 (handed back to the caller)
            box["error"] = error
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_grad_refuses_what_it_cannot_differentiate_naming_it():
    with pytest.raises(em.DTypeError, match=r"^grad: differentiated arguments must be ember arrays \(or containers "
                                            r"of them\), got float$"):
        em.grad(lambda x: x * 2)(1.5)
    with pytest.raises(em.DTypeError, match=r"^grad: only real floating arrays can be differentiated, got int64$"):
        em.grad(em.sum)(em.asarray([1, 2]))
    with pytest.raises(em.EmberError, match=r"^grad: the function must return a scalar array, got \(3,\)$"):
        em.grad(lambda x: x * 2)(em.ones(3))
    with pytest.raises(em.EmberError, match=r"^grad: the function must return a scalar array, got float$"):
        em.grad(lambda x: 2.0)(em.ones(3))


def test_a_grad_inside_a_grad_is_refused_only_for_a_value_the_outer_one_tracks():
    """The inner grad of the outer's own variable would be a silent zero: refused. Of another array, plain or
    tracked by nobody, it is an ordinary gradient, and the outer grad goes on."""
    def outer(x):
        em.grad(lambda y: em.sum(y * x))(x)
    with pytest.raises(em.NotSupportedError, match=r"^grad: higher-order gradients are not supported: this grad runs "
                                                   r"inside another and differentiates a value the outer one tracks$"):
        em.grad(outer)(em.ones(2))

    def outer_after_an_inner(x):  # the count is a count: one inner grad ending does not end the outer's
        em.grad(lambda y: em.sum(y * y))(em.ones(2))
        em.grad(lambda y: em.sum(y * x))(x)
    with pytest.raises(em.NotSupportedError, match=r"^grad: higher-order gradients are not supported"):
        em.grad(outer_after_an_inner)(em.ones(2))

    inner_grads = []

    def loss(x):
        inner_grads.append(em.asnumpy(em.grad(lambda y: em.sum(y ** 3))(em.asarray([1.0, 2.0]))))
        return em.sum(x * x)
    np.testing.assert_array_equal(em.asnumpy(em.grad(loss)(em.asarray([3.0, 4.0]))), [6.0, 8.0])
    np.testing.assert_array_equal(inner_grads[0], [3.0, 12.0])


def test_grad_of_an_array_that_already_requires_grad_works_again_and_again():
    """A tracked leaf passed to grad outside any other grad is differentiated by value, each time: the nesting
    count returns to zero after every call, a failing one included."""
    x = _leaf([1.0, -2.0])
    for _ in range(3):
        np.testing.assert_array_equal(em.asnumpy(em.grad(lambda v: em.sum(v * v))(x)), [2.0, -4.0])
    with pytest.raises(ZeroDivisionError):
        em.grad(lambda v: 1 / 0)(x)
    np.testing.assert_array_equal(em.asnumpy(em.grad(lambda v: em.sum(v * v * v))(x)), [3.0, 12.0])
    assert x.grad is None  # grad is functional: the leaf's .grad is untouched


def test_grad_in_a_new_thread_starts_from_the_defaults():
    """Gradient mode and grad's nesting count are per thread: a new thread records ops on tracked arrays and
    differentiates tracked leaves, whatever the main thread has done."""
    x = _leaf([1.0, 2.0])

    def work():
        assert em.is_grad_enabled()
        y = x * 3
        assert y.requires_grad
        first = em.asnumpy(em.grad(lambda v: em.sum(v * v))(x))
        np.testing.assert_array_equal(em.asnumpy(em.grad(lambda v: em.sum(v * v * v))(x)), [3.0, 12.0])  # count back at 0
        return first
    with em.no_grad():
        np.testing.assert_array_equal(_in_a_new_thread(work), [2.0, 4.0])


def test_grad_passes_keyword_arguments_and_aux_through():
    def loss(w, *, scale, offset=0.0):
        return em.sum(w * w) * scale + offset, {"scaled": w * scale}
    w = em.asarray([1.0, 2.0])
    g, aux = em.grad(loss, has_aux=True)(w, scale=3.0, offset=1.0)
    np.testing.assert_array_equal(em.asnumpy(g), [6.0, 12.0])
    np.testing.assert_array_equal(em.asnumpy(aux["scaled"]), [3.0, 6.0])
    (value, aux), g = em.value_and_grad(loss, has_aux=True)(w, scale=2.0, offset=1.0)
    assert float(value) == 11.0 and em.asnumpy(g).tolist() == [4.0, 8.0]
    assert em.asnumpy(em.grad(lambda w, *, k: em.sum(w) * k)(w, k=5.0)).tolist() == [5.0, 5.0]


def test_grad_of_a_function_that_ignores_its_argument_is_zero():
    for function in (lambda x: em.sum(em.ones(3)), lambda x: em.asarray(2.0)):
        g = em.grad(function)(em.asarray([1.0, 2.0]))
        assert em.asnumpy(g).tolist() == [0.0, 0.0] and g.device is em.device("numpy")


def test_grad_functions_are_named_after_the_function():
    import functools

    def loss(x):
        return em.sum(x)
    assert em.grad(loss).__name__ == "grad(loss)" and em.value_and_grad(loss).__name__ == "value_and_grad(loss)"
    unnamed = functools.partial(lambda x, k: em.sum(x) * k, k=2.0)
    assert em.grad(unnamed).__name__ == "grad(function)"
    assert em.value_and_grad(unnamed).__name__ == "value_and_grad(function)"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_keep_the_dtype_of_the_output(dtype):
    """The seed of backward and grad is a one of the output's dtype: float32 in, float32 gradients out."""
    x = em.asarray([1.0, 2.0], dtype=getattr(em, dtype), device=TRACKED).requires_grad_()
    em.sum(x * x).backward()
    assert x.grad.dtype == getattr(em, dtype)
    g = em.grad(lambda v: em.sum(v * v))(em.asarray([1.0, 2.0], dtype=getattr(em, dtype)))
    assert g.dtype == getattr(em, dtype) and em.asnumpy(g).tolist() == [2.0, 4.0]


def test_values_off_the_tape_are_read_like_any_other():
    """A row without a gradient (a comparison, argmax) on tracked arrays gives a plain value, readable, and
    the backward pass names it when asked to go through it."""
    x = _leaf([3.0, -1.0, 2.0])
    positive, top = x > 0, em.argmax(x)
    assert (positive.shape, positive.dtype, em.asnumpy(positive).tolist()) == ((3,), em.bool, [True, False, True])
    assert (top.shape, int(top)) == ((), 0) and not top.requires_grad
    with pytest.raises(em.EmberError, match=r"^backward: this array does not require grad: it comes from argmax"):
        top.backward()


def test_a_node_no_cotangent_reaches_does_not_end_the_backward_pass():
    """nextafter(z, b) passes no gradient to b, so b's node gets no cotangent; the pass skips it and goes on to
    the node both z and b come from, which the tape orders after b's."""
    x = _leaf([1.0, -2.0, 3.0])
    e = x + 1
    z, b = e * 3, e * 2
    em.sum(em.nextafter(z, b)).backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [3.0, 3.0, 3.0])


def test_shared_subexpressions_are_walked_once():
    """y = y + y sixty times: a tape of 60 nodes with 2^60 paths through it. The backward pass visits each node
    once (a walk over paths would never finish) and the gradient is exact."""
    x = _leaf([1.0])
    y = x
    for _ in range(60):
        y = y + y
    em.sum(y).backward()
    assert em.asnumpy(x.grad).tolist() == [2.0 ** 60]


def test_a_tracked_array_hands_its_value_over_by_dlpack():
    x = _leaf([1.0, 2.0])
    y = x * 2
    np.testing.assert_array_equal(np.from_dlpack(y), [2.0, 4.0])
    assert y.__dlpack_device__() == em.ones(1).__dlpack_device__()


def test_a_float32_gradient_is_computed_in_float32_throughout():
    """The seed is a one of the output's dtype, so the whole backward pass stays in float32 (a float64 seed would
    promote every step and be cast back at the end: the same dtype out, twice the work, other roundings)."""
    with em.capture() as cap:
        w = cap.input((3,), em.float32, name="w")
        cap.output(em.grad(lambda v: em.sum(em.sin(v) * v))(w), name="g")
    floating = {meta.dtype for meta in cap.graph.metas.values() if meta.dtype in (em.float32, em.float64)}
    assert floating == {em.float32}


def test_the_grad_property_is_documented_for_help():
    assert "accumulated by ``backward``" in em.Array.grad.__doc__


def test_a_value_off_the_tape_feeds_a_gradient_rule():
    """x > 0 is off the tape (a comparison has no gradient) yet where's rule reads it, with its shape."""
    x = _leaf([2.0, -3.0, 0.5])
    em.sum(em.where(x > 0, x * x, -x)).backward()
    np.testing.assert_array_equal(em.asnumpy(x.grad), [4.0, -1.0, 1.0])
