"""The parts of a capture beside ``_capture/capture.py`` on their own: the contexts a
capture runs in (``capture_contexts``), what a failed capture raises
(``capture_errors``), the model's state checks (``model_state``) and the compile hooks
(``hooks``). No model is compiled here."""
import pytest
import torch

import poptorch
from poptorch import _impl
from poptorch._capture import capture_errors, hooks, model_state
from poptorch._capture.capture import capture_contexts


def _validation():
    return torch.distributions.Distribution._validate_args


def test_capture_contexts_are_entered_and_left_in_order():
    before = _validation()
    model = torch.nn.Linear(2, 2).double()
    with capture_contexts(model, True, "cpu", None, True):
        assert _impl.isRunningOnIpu() and _impl.capturing_training()
        assert _validation() is False
        assert model.weight.dtype == torch.float32  # float64 held as float32
        assert torch.zeros(2, device="ipu").device == torch.device("cpu")
    assert not _impl.isRunningOnIpu()
    assert _validation() is before
    assert model.weight.dtype == torch.float64


def test_capture_contexts_are_left_when_the_capture_raises():
    before = _validation()
    model = torch.nn.Linear(2, 2).double()
    with pytest.raises(KeyError, match="inside"):
        with capture_contexts(model, False, "cpu", None, False):
            raise KeyError("inside")
    assert not _impl.isRunningOnIpu()
    assert _validation() is before
    assert model.weight.dtype == torch.float64


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # pylint: disable=broad-except
        return exc
    raise AssertionError("fn did not raise")


def test_a_users_own_error_and_a_poptorch_error_propagate_as_they_are():
    def user_code():
        raise ZeroDivisionError("the user's")

    capture_errors.raise_capture_error(_raised(user_code))  # returns: re-raised as is
    capture_errors.raise_capture_error(poptorch.Error("ours"))


def test_a_data_dependence_becomes_a_poptorch_error():
    def traced():
        raise RuntimeError("Could not guard on data-dependent expression u0 > 0")

    exc = _raised(traced)
    with pytest.raises(poptorch.Error, match="data"):
        capture_errors.raise_capture_error(exc)


def test_reassigned_and_removed_parameters_are_named_and_restored():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    before = model_state.state_identity(model)
    weight = model[0].weight
    model[0].weight = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(poptorch.Error, match="Parameter 0.weight is reassigned"):
        model_state.check_state_unchanged(model, before)
    model_state.restore_state(model, before)
    del model[0].bias
    with pytest.raises(poptorch.Error, match="Parameter 0.bias is removed"):
        model_state.check_state_unchanged(model, before)
    model_state.restore_state(model, before)
    assert model[0].weight is weight and isinstance(model[0].bias, torch.nn.Parameter)
    model_state.check_state_unchanged(model, before)


def test_containers_rebuilt_during_a_capture_are_put_back():
    model = torch.nn.Linear(2, 2)
    model.cfg = {"flag": False}
    original = model.cfg
    found = model_state.container_attributes(model)
    model.__dict__["cfg"] = dict(original)  # what torch.export writes back
    model_state.restore_containers(found)
    assert model.cfg is original


def test_compile_hooks_run_in_order_until_removed():
    calls = []
    first = hooks.registerPreCompileHook(lambda: calls.append("pre 1"))
    second = poptorch.registerPreCompileHook(lambda: calls.append("pre 2"))
    post = poptorch.registerPostCompileHook(lambda: calls.append("post"))
    try:
        hooks.run_pre_compile_hooks()
        hooks.run_post_compile_hooks()
        first.remove()
        hooks.run_pre_compile_hooks()
    finally:
        second.remove()
        post.remove()
    assert calls == ["pre 1", "pre 2", "post", "pre 2"]
    with pytest.raises(RuntimeError, match="must be callable"):
        poptorch.registerPreCompileHook(3)
