"""The executor's API face (docs/api-sections.md api §5, §6): its life cycle (compile, attach,
detach, destroy, wrapping a model again), attribute forwarding, the wrapped model, copies and
pickles refused, compilation time and performance counters, and ``setOptimizer`` of training
models."""
import copy
import pickle

import pytest
import torch

import poptorch
from models import Classifier, SingleLinear, assert_same_weights, reference_training


# -- life cycle (docs/api-sections.md api §5)
# ---------------------------------------------------------------

def test_lifecycle_state_machine():
    model = poptorch.inferenceModel(SingleLinear())
    assert not model.isCompiled() and not model.isAttachedToDevice()
    for method in (model.copyWeightsToHost, model.copyWeightsToDevice,
                   model.detachFromDevice, model.attachToDevice):
        with pytest.raises(poptorch.Error, match="Model has not been compiled or has been "
                                                 "destroyed."):
            method()
    model.compile(torch.randn(2, 6))
    assert model.isCompiled() and model.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="Device is already attached"):
        model.attachToDevice()
    model.detachFromDevice()
    assert not model.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="Device is not attached"):
        model.detachFromDevice()
    model(torch.randn(2, 6))  # re-attaches implicitly
    assert model.isAttachedToDevice()
    model.destroy()
    assert not model.isCompiled() and not model.isAttachedToDevice()
    model.destroy()  # no-op


def test_compile_twice_logs_a_warning(poptorch_logs):
    model = poptorch.inferenceModel(SingleLinear())
    model.compile(torch.randn(2, 6))
    model.compile(torch.randn(2, 6))
    assert "Call to compile() ignored: the executable is already compiled" in \
        poptorch_logs.text


def test_wrapping_an_executor_uses_its_model():
    m = SingleLinear()
    first = poptorch.inferenceModel(m)
    second = poptorch.inferenceModel(first)
    assert second.model is m


def test_attribute_forwarding_and_repr():
    m = SingleLinear()
    model = poptorch.inferenceModel(m)
    assert model.fc is m.fc
    assert torch.equal(model.forward(torch.ones(1, 6)), m(torch.ones(1, 6)))
    assert repr(model) == repr(m)
    assert model.model is m


# -- copies ----------------------------------------------------------------------------

def test_executor_copy_gives_a_clear_error():
    model = poptorch.inferenceModel(SingleLinear())
    model(torch.randn(1, 6))
    with pytest.raises(poptorch.Error, match="cannot be copied"):
        copy.deepcopy(model)
    assert model(torch.randn(1, 6)).shape == (1, 20)  # still usable


def test_shallow_copies_of_executors_are_refused_and_pickles_store_the_model():
    """Found by a user: copy.copy(executor) shared the device weights without the host
    synchronisation. Pickling (torch.save(executor), PopTorch's test_block_function_
    saving) stores the wrapped model with its weights."""
    user = SingleLinear()
    model = poptorch.inferenceModel(user)
    model(torch.randn(1, 6))
    with pytest.raises(poptorch.Error, match="cannot be copied"):
        copy.copy(model)
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded) is SingleLinear
    for (name, a), b in zip(loaded.state_dict().items(), user.state_dict().values()):
        assert torch.equal(a, b), name


# -- inspection ------------------------------------------------------------------------

def test_compilation_time_and_perf_counters():
    model = poptorch.inferenceModel(SingleLinear())
    with pytest.raises(poptorch.Error, match="compile the model before obtaining "
                                             "compilation time"):
        model.compilationTime()
    assert model.getPerfCounters()["input"] == [[]]
    model(torch.randn(2, 6))
    assert model.compilationTime().total_seconds() > 0
    counters = model.getPerfCounters()
    assert set(counters) == {"input", "input_complete", "output", "output_complete"}
    low, high, mean = model.getLatency()
    assert 0 <= low <= mean <= high
    quiet = poptorch.inferenceModel(SingleLinear(),
                                    poptorch.Options().showCompilationProgressBar(False))
    with pytest.raises(poptorch.Error, match="Please compile the model before obtaining "
                                             "compilation time."):
        quiet.compilationTime()  # not compiled is said first, as PopTorch
    quiet(torch.randn(2, 6))
    with pytest.raises(poptorch.Error, match="Please set showCompilationProgressBar option "
                                             "to obtain compilation time."):
        quiet.compilationTime()


# -- training models: wrap, detach, destroy, setOptimizer -------------------------------

def test_wrapping_twice_needs_destroy():
    m = Classifier()
    training = poptorch.trainingModel(m)
    with pytest.raises(RuntimeError, match=r"^Model has already been wrapped in "
                       r"'poptorch\.trainingModel'\. Call model\.destroy\(\) on the model "
                       r"to unwrap before wrapping again\.$"):  # PopTorch's words
        poptorch.trainingModel(m)
    training(torch.randn(2, 6), torch.randint(0, 4, (2,)))
    trained = m.fc1.weight.detach().clone()
    m.destroy()
    assert type(m) is Classifier and type(m.fc1.weight) is torch.nn.Parameter
    assert torch.equal(m.fc1.weight, trained)
    again = poptorch.trainingModel(training)
    assert again.model is m
    again(torch.randn(2, 6), torch.randint(0, 4, (2,)))


def test_detach_copies_back_and_reattach_continues():
    m = Classifier()
    ref = copy.deepcopy(m)
    training = poptorch.trainingModel(m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1,
                                                                   momentum=0.9))
    x, t = torch.randn(4, 6), torch.randint(0, 4, (4,))
    training(x, t)
    training.detachFromDevice()
    assert not training._state.host.stale
    inference = poptorch.inferenceModel(m)
    inference(x)
    training(x, t)  # re-attaches, re-uploads weights
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    reference_training(ref, opt, x, t, 1, 1, 1)
    reference_training(ref, opt, x, t, 1, 1, 1)
    assert_same_weights(m, ref, rtol=1e-5, atol=1e-6)


def test_errors_leave_device_and_host_weights_unchanged():
    m = Classifier()
    training = poptorch.trainingModel(m)
    x, t = torch.randn(4, 6), torch.randint(0, 4, (4,))
    training(x, t)
    host = copy.deepcopy(m.state_dict())
    device = training._state.session.readWeights()
    bad_calls = [
        lambda: training(torch.randn(4, 7), t),                  # shape
        lambda: training(x.double(), t),                         # dtype
        lambda: training(x),                                     # structure
        lambda: training(x[:3], t[:3]),                          # shape (batch)
    ]
    for call in bad_calls:
        with pytest.raises(poptorch.Error):
            call()
    opts = poptorch.Options().deviceIterations(4)
    with pytest.raises(AssertionError):
        poptorch.trainingModel(Classifier(), opts)(torch.randn(6, 6), torch.zeros(6).long())
    for k, v in m.state_dict().items():
        assert torch.equal(v, host[k])
    for k, v in training._state.session.readWeights().items():
        assert torch.equal(v, device[k])
    training(x, t)  # still usable


def test_unsupported_optimizers():
    m = Classifier()
    with pytest.raises(AssertionError, match="Unsupported optimizer type"):
        poptorch.trainingModel(m, optimizer=torch.optim.Adagrad(m.parameters()))
    assert type(m) is Classifier  # not instrumented after the failure
    with pytest.raises(ValueError, match="Only non-amsgrad Adam/AdamW optimizers are "
                                         "supported."):
        poptorch.trainingModel(m, optimizer=torch.optim.Adam(m.parameters(), amsgrad=True))


def test_set_optimizer_changes_variable_learning_rate_without_recompiling():
    m = Classifier()
    ref = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    training = poptorch.trainingModel(m, optimizer=opt)
    x, t = torch.randn(4, 6), torch.randint(0, 4, (4,))
    training(x, t)
    executable = training._state.executable
    for group in opt.param_groups:
        group["lr"] = 0.01
    training.setOptimizer(opt)
    training(x, t)
    assert training._state.executable is executable
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    reference_training(ref, ref_opt, x, t, 1, 1, 1)
    for group in ref_opt.param_groups:
        group["lr"] = 0.01
    reference_training(ref, ref_opt, x, t, 1, 1, 1)
    assert_same_weights(m, ref, rtol=1e-5, atol=1e-6)


def test_inference_executor_has_no_set_optimizer():
    with pytest.raises(AttributeError):
        poptorch.inferenceModel(Classifier()).setOptimizer(
            torch.optim.SGD(Classifier().parameters(), lr=0.1))


def test_recompiling_after_destroy_keeps_host_in_sync():
    """Found by a user: after destroy() a re-used training executor trained on, but the
    host model was no longer instrumented and kept stale weights."""
    m = Classifier()
    training = poptorch.trainingModel(m, optimizer=poptorch.optim.SGD(m.parameters(), lr=0.5))
    x, t = torch.randn(8, 6), torch.randint(0, 4, (8,))
    training(x, t)
    training.destroy()
    assert type(m) is Classifier
    before = m.fc1.weight.detach().clone()
    for _ in range(3):
        training(x[:4], t[:4])  # recompiles with the new shape
    assert type(m).__name__ == "PoptorchClassifier"
    assert not torch.equal(before, m.fc1.weight.detach())
    out = poptorch.inferenceModel(m)(x)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x))


def test_destroyed_executor_cannot_retake_a_model_wrapped_again():
    m = Classifier()
    first = poptorch.trainingModel(m)
    x, t = torch.randn(2, 6), torch.randint(0, 4, (2,))
    first(x, t)
    first.destroy()
    second = poptorch.trainingModel(m)
    second(x, t)
    with pytest.raises(RuntimeError, match="already been wrapped"):
        first(x, t)
    second(x, t)  # unaffected


def test_printing_instrumented_tensors_looks_like_plain_ones():
    m = Classifier()
    m.register_buffer("steps", torch.zeros(2))
    training = poptorch.trainingModel(m)
    training(torch.randn(2, 6), torch.randint(0, 4, (2,)))
    text = repr(m.fc2.bias)
    assert text.startswith("Parameter containing:\ntensor(") and "_Instrumented" not in text
    assert repr(m.steps) == "tensor([0., 0.])"
    assert torch.equal(m.fc2.bias, training._state.session.readWeights()["fc2.bias"])


def test_optimizer_is_logged_once_per_compile(poptorch_logs):
    m = Classifier()
    poptorch.trainingModel(m)(torch.randn(2, 6), torch.randint(0, 4, (2,)))
    assert poptorch_logs.text.count("Updating graph optimizer with SGD") == 1


# -- compiling part of the way (poptorch.plan's entry) -----------------------------------

def test_a_transient_executor_compiles_up_to_a_pass_and_commits_nothing(tmp_path):
    """``wrapping.transient`` + ``_compile_until``: the normal compile entry, stopped
    after a named pass; the executor stays uncompiled, the cache is not touched, and
    the training model is handed back uninstrumented."""
    from poptorch._executor import wrapping
    m = Classifier()
    seen = []
    opts = poptorch.Options().enableExecutableCaching(str(tmp_path / "cache"))
    with wrapping.transient(m, opts, True, poptorch.optim.SGD(m.parameters(), lr=0.1)) \
            as executor:
        assert type(m).__name__ == "PoptorchClassifier"
        exe = executor._compile_until("place", torch.randn(2, 6), torch.tensor([1, 3]),
                                      check_capture=seen.append)
        assert not executor.isCompiled()
    assert type(m) is Classifier
    assert [name for name, _ in exe.passes][-1] == "place" and exe.estimate is None
    assert exe.training and exe.optimizer is not None and exe.placement is not None
    assert seen == [exe.graph]  # checked as captured, before the passes
    assert not (tmp_path / "cache").exists()
    with pytest.raises(poptorch.Error, match="no compiler pass has that name"):
        poptorch.inferenceModel(SingleLinear())._compile_until("lower", torch.randn(2, 6))
    poptorch.trainingModel(m)  # no longer registered as wrapped for training
