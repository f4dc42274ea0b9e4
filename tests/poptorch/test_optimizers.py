"""poptorch.optim and optimizer semantics on a training model (docs/api-sections.md api §10;
docs/semantics.md S-50…S-55, S-57, S-58; the reductions docs/semantics.md S-41, S-42:
``test_reductions.py``).

Numerical comparisons run the same micro-batches through plain PyTorch: per device
iteration, A × R micro-batches (docs/semantics.md S-13 order), each loss divided by A × R for
``Mean`` (docs/semantics.md S-41), then one ``step()`` of the equivalent ``torch.optim`` optimizer.
Tolerance: ``rtol=1e-5, atol=1e-6`` on the weights after ≥ 10 updates unless stated otherwise.
"""
import copy
import logging

import pytest
import torch
import torch.nn as nn

import poptorch
import poptorch._executor.compile as program_module  # where capture() is called
import models
from models import Classifier, reference_training
from models import classifier_data as data

TOL = dict(rtol=1e-5, atol=1e-6)


def options(d=1, a=1, r=1):
    opts = poptorch.Options().deviceIterations(d).replicationFactor(r)
    opts.Training.gradientAccumulation(a)
    return opts


def assert_same_weights(a, b, **tol):
    models.assert_same_weights(a, b, **(tol or TOL))


def device_weights(training):
    return {k: v.clone() for k, v in training._state.session.readWeights().items()}


def device_state(training):
    return {k: v.clone() for k, v in training._state.session.readOptimizerState().items()}


def assert_unchanged(before, after):
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


# -- every optimizer matches torch.optim over >= 10 updates --------------------------------

MATCHES = {
    "sgd-separate": (lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1,
                                                  weight_decay=0.01),
                     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1,
                                               weight_decay=0.01)),
    "sgd-combined": (lambda p: poptorch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1,
                                                  weight_decay=0.01, use_combined_accum=True,
                                                  velocity_scaling=8.0),
                     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1,
                                               weight_decay=0.01)),
    "sgd-nesterov-combined": (
        lambda p: poptorch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True,
                                     use_combined_accum=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True)),
    "sgd-nesterov-separate": (
        lambda p: poptorch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True)),
    "adam": (lambda p: poptorch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                           weight_decay=0.01),
             lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                                        weight_decay=0.01)),
    "adamw": (lambda p: poptorch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    "rmsprop": (lambda p: poptorch.optim.RMSprop(p, lr=0.01, alpha=0.9, momentum=0.5,
                                                 weight_decay=0.01),
                lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, momentum=0.5,
                                              weight_decay=0.01)),
    "rmsprop-centered": (lambda p: poptorch.optim.RMSprop(p, lr=0.01, centered=True),
                         lambda p: torch.optim.RMSprop(p, lr=0.01, centered=True)),
    "lamb": (lambda p: poptorch.optim.LAMB(p, lr=0.01, weight_decay=0.01),
             lambda p: poptorch.optim.LAMB(p, lr=0.01, weight_decay=0.01)),
    "lamb-no-bias-correction": (
        lambda p: poptorch.optim.LAMB(p, lr=0.01, bias_correction=False, max_weight_norm=2.),
        lambda p: poptorch.optim.LAMB(p, lr=0.01, bias_correction=False,
                                      max_weight_norm=2.)),
    # the reference backend always bias-corrects AdamW (docs/semantics.md S-54 quirk)
    "adamw-bias-correction-off": (
        lambda p: poptorch.optim.AdamW(p, lr=0.01, bias_correction=False),
        lambda p: torch.optim.AdamW(p, lr=0.01)),
    "torch-sgd": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5),
                  lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5)),
}


@pytest.mark.parametrize("name", sorted(MATCHES))
def test_optimizer_matches_torch_over_12_updates(name):
    """D=3, A=2, R=2, 4 calls: 12 updates; rtol 1e-5 / atol 1e-6."""
    make, make_ref = MATCHES[name]
    model = Classifier()
    ref = copy.deepcopy(model)
    d, a, r = 3, 2, 2
    training = poptorch.trainingModel(model, options(d, a, r), make(model.parameters()))
    ref_opt = make_ref(ref.parameters())
    for call in range(4):
        x, t = data(d * a * r * 2, call)
        training(x, t)
        reference_training(ref, ref_opt, x, t, d, a, r)
    assert_same_weights(model, ref)


def test_sgd_dampening_without_momentum_scales_the_step():
    """docs/semantics.md S-54 quirk: momentum 0 still scales the step by (1 − dampening)."""
    model = Classifier()
    ref = copy.deepcopy(model)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, dampening=0.25)
    training = poptorch.trainingModel(model, options(d=10), opt)
    x, t = data(20)
    training(x, t)
    reference_training(ref, torch.optim.SGD(ref.parameters(), lr=0.075), x, t, 10, 1, 1)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("make", [
    lambda p: poptorch.optim.SGD(p, lr=0.5, momentum=0.9, max_grad_norm=0.05),
    lambda p: poptorch.optim.SGD(p, lr=0.5, momentum=0.9, max_grad_norm=0.05,
                                 use_combined_accum=True),
    lambda p: poptorch.optim.Adam(p, lr=0.01, max_grad_norm=0.05),
], ids=["sgd", "sgd-combined", "adam"])
def test_max_grad_norm_clips_the_global_norm(make):
    """docs/semantics.md S-54: gradients scaled by min(1, max_norm / ‖G‖) over all parameters, like
    torch.nn.utils.clip_grad_norm_ (rtol 1e-4: torch adds 1e-6 to the norm)."""
    model = Classifier()
    ref = copy.deepcopy(model)
    opt = make(model.parameters())
    training = poptorch.trainingModel(model, options(d=10, a=2), opt)
    x, t = data(40)
    training(x, t)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9) \
        if isinstance(opt, torch.optim.SGD) else torch.optim.Adam(ref.parameters(), lr=0.01)
    reference_training(ref, ref_opt, x, t, 10, 2, 1, clip=0.05)
    assert_same_weights(model, ref, rtol=1e-4, atol=1e-5)


def test_accumulation_dtypes_set_state_storage():
    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01, accum_type=torch.float16,
                              first_order_momentum_accum_type=torch.float16,
                              second_order_momentum_accum_type=torch.float32)
    training = poptorch.trainingModel(model, options(a=2), opt)
    training(*data(4))
    state = opt.state_dict()["ipu_state"]
    assert state["Accl1___fc1.weight"].dtype == torch.float16
    assert state["Accl2___fc1.weight"].dtype == torch.float32
    assert state["Accum___fc1.weight"].dtype == torch.float16
    sgd_model = Classifier()
    sgd = poptorch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9,
                             velocity_accum_type=torch.float16)
    poptorch.trainingModel(sgd_model, optimizer=sgd)(*data(2))
    assert sgd.state_dict()["ipu_state"]["Accl___fc1.weight"].dtype == torch.float16
    with pytest.raises(AssertionError, match="Accumulation types must be either "
                                             "torch.float32 or torch.float16"):
        poptorch.optim.SGD(Classifier().parameters(), lr=0.1, accum_type=torch.int32)


def test_sgd_velocity_scaling_is_ignored_by_the_separate_variant(poptorch_logs):
    opt = poptorch.optim.SGD(Classifier().parameters(), lr=0.1, velocity_scaling=2.0)
    assert "velocity_scaling is ignored" in poptorch_logs.text
    assert "velocity_scaling" not in opt.defaults
    combined = poptorch.optim.SGD(Classifier().parameters(), lr=0.1, velocity_scaling=2.0,
                                  use_combined_accum=True)
    assert combined.param_groups[0]["velocity_scaling"] == 2.0


def test_lamb_host_step_matches_the_device():
    model = Classifier()
    ref = copy.deepcopy(model)
    training = poptorch.trainingModel(model, options(d=10),
                                      poptorch.optim.LAMB(model.parameters(), lr=0.02))
    x, t = data(20)
    training(x, t)
    reference_training(ref, poptorch.optim.LAMB(ref.parameters(), lr=0.02), x, t, 10, 1, 1)
    assert_same_weights(model, ref)


# -- loss scaling (docs/semantics.md S-51) and automatic loss scaling (docs/semantics.md S-57)
# ----------------------------------

def test_loss_scaling_leaves_float32_training_unchanged():
    """A power-of-two loss scale is exact in float32: identical weights."""
    base = Classifier()
    results = []
    for scale in (1.0, 1024.0):
        model = copy.deepcopy(base)
        opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                 loss_scaling=scale)
        training = poptorch.trainingModel(model, options(d=10, a=2), opt)
        training(*data(40))
        results.append(model.state_dict())
        if scale != 1.0:
            params = opt.state_dict()["ipu_param"]
            assert params["lossScaling_FLOAT"].item() == scale
            assert params["scaledLearningRate0___specific___fc1.weight"].item() == \
                pytest.approx(0.1 / scale)
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


class TinyGradient(nn.Module):
    """d loss / d w = x × 1e-4 ≈ 1e-8: below float16's smallest subnormal (6e-8)."""

    def __init__(self, dtype):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 0.5, dtype=dtype))

    def forward(self, x):
        return poptorch.identity_loss((self.w * x).sum() * 1e-4, reduction="sum")


def test_loss_scaling_prevents_float16_gradient_underflow():
    x16 = torch.full((4,), 1e-4, dtype=torch.float16)

    def train(dtype, scale):
        m = TinyGradient(dtype)
        opt = poptorch.optim.SGD(m.parameters(), lr=1e5, loss_scaling=scale)
        poptorch.trainingModel(m, optimizer=opt)(x16.to(dtype))
        return m.w.detach().float()

    f32 = train(torch.float32, 1.0)
    torch.testing.assert_close(f32, torch.full((4,), 0.499), rtol=0, atol=1e-5)
    assert torch.equal(train(torch.float16, 1.0), torch.full((4,), 0.5))  # underflow
    scaled = train(torch.float16, 16384.0)
    torch.testing.assert_close(scaled, f32, rtol=0, atol=5e-4)  # float16 resolution
    assert (scaled < 0.5).all()


class ScaledInput(nn.Module):
    """d loss / d w = x: the float16 gradient is x × loss scale."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, dtype=torch.float16))

    def forward(self, x):
        return poptorch.identity_loss((self.w * x).sum(), reduction="sum")


def test_automatic_loss_scaling_halves_on_overflow_and_doubles_otherwise():
    """docs/semantics.md S-57 rule (update period 1): halve when a float16 gradient overflows or
    reaches the top bin (≥ 65504 / 8 = 8188), else double, with the scale capped at 65504;
    finalLossScale = loss_scaling × factor before the run."""
    opts = options()
    opts.Training.setAutomaticLossScaling(True)
    opts.anchorTensor("scale", "finalLossScale")
    model = ScaledInput()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.0, loss_scaling=1024.0)
    training = poptorch.trainingModel(model, opts, opt)

    def run(value):
        training(torch.full((4,), value, dtype=torch.float16))
        return (training.getAnchoredTensor("scale").item(),
                opt.state_dict()["ipu_state"]["lossScaleUpdateFactor"].item())

    assert run(100.0) == (1024.0, 0.5)   # 102400 overflows float16 → halve
    assert run(10.0) == (512.0, 1.0)     # 5120: below the top bin → double
    assert run(10.0) == (1024.0, 0.5)    # 10240: top bin → halve
    for expected in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0):
        assert run(0.01)[1] == expected
    assert run(0.01) == (32768.0, 32.0)  # 65536 would exceed 65504: stays


def test_automatic_loss_scaling_ignores_float32_gradients():
    opts = options()
    opts.Training.setAutomaticLossScaling(True)
    model = Classifier()
    # torch optimizers: loss_scaling is constant at 1.0 unless ALS makes it variable
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    for _ in range(3):
        training(*data(2))
    state = training._state.binding.optimizer.state_dict()["ipu_state"]
    assert state["lossScaleUpdateFactor"].item() == 1.0
    assert "loss_scaling" not in training._state.binding.description.constant


# -- constant and variable attributes (docs/semantics.md S-52, S-53, S-58)
# ---------------------------------

@pytest.fixture
def count_captures(monkeypatch):
    calls = []
    real = program_module.capture

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(program_module, "capture", counting)
    return calls


class CountingClassifier(Classifier):
    """Counts the Python executions of forward (once per capture, docs/semantics.md S-1)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, x, t):
        self.calls.append(1)
        return super().forward(x, t)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_scheduler_drives_set_optimizer_without_recompiling(count_captures, poptorch_logs):
    """docs/semantics.md S-58: ExponentialLR + setOptimizer each epoch equals torch with the same
    schedule; the model is captured (forward executed in Python) exactly once."""
    model = CountingClassifier()
    ref = copy.deepcopy(model)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.4, momentum=0.5)
    training = poptorch.trainingModel(model, options(d=2), opt)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, 0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.4, momentum=0.5)
    ref_scheduler = torch.optim.lr_scheduler.ExponentialLR(ref_opt, 0.5)
    executable = None
    for epoch in range(5):
        x, t = data(4, epoch)
        training(x, t)
        executable = executable or training._state.executable
        scheduler.step()
        training.setOptimizer(opt)
        reference_training(ref, ref_opt, x, t, 2, 1, 1)
        ref_scheduler.step()
    assert len(count_captures) == 1
    assert len(model.calls) == 1
    assert training._state.executable is executable
    assert_same_weights(model, ref)
    params = opt.state_dict()["ipu_param"]
    torch.testing.assert_close(params["scaledLearningRate0___specific___fc2.bias"].item(),
                               0.4 * 0.5 ** 5)
    # the scheduler added 'initial_lr' to the groups and 'step' to the optimizer
    # (docs/semantics.md S-53)
    text = poptorch_logs.text
    assert "Ignoring unexpected group 0 attribute in SGD optimizer: ['initial_lr']" in text
    assert "Ignoring unexpected optimizer attribute in SGD optimizer: ['step']" in text
    assert text.count("Ignoring unexpected group 0 attribute") == 1  # once per message
    assert "Updating graph optimizer with SGD, defaultLearningRate=" in text
    assert "Updating group 0 optimizer with learningRate=" in text


def test_relaxed_attribute_checks_log_at_debug(poptorch_logs):
    opts = poptorch.Options().relaxOptimizerAttributesChecks()
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    training = poptorch.trainingModel(model, opts, opt)
    opt.param_groups[0]["loss_scaling"] = 4.0
    training.setOptimizer(opt)
    record = [r for r in poptorch_logs.records if "Ignoring unexpected" in r.getMessage()]
    assert record and record[0].levelno == logging.DEBUG
    assert training._state.binding.description.loss_scaling == 1.0  # group value ignored


def test_group_loss_scaling_is_ignored_with_a_warning(poptorch_logs):
    model = Classifier()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=2.0)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*data(2))
    opt.param_groups[0]["loss_scaling"] = 4.0
    training.setOptimizer(opt)
    assert "Ignoring unexpected group 0 attribute in SGD optimizer: ['loss_scaling']" in \
        poptorch_logs.text
    assert opt.state_dict()["ipu_param"]["lossScaling_FLOAT"].item() == 2.0


def test_unpassed_attributes_are_constant():
    """docs/semantics.md S-52 example: Adam's lr not passed is constant; changing it after compile
    fails and leaves the device untouched; passing it makes it variable."""
    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters())
    assert opt.variable_attrs.isConstant("lr")
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(2)
    training(x, t)
    weights, state = device_weights(training), device_state(training)
    for group in opt.param_groups:
        group["lr"] = 1e-4
    with pytest.raises(poptorch.Error, match="compiled optimizer cannot be changed") as info:
        training.setOptimizer(opt)
    assert "constant lr" in info.value.message
    assert_unchanged(weights, device_weights(training))
    assert_unchanged(state, device_state(training))
    for group in opt.param_groups:
        group["lr"] = 1e-3
    training(x, t)  # still usable

    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters(), lr=1e-3)
    assert not opt.variable_attrs.isConstant("lr")
    training = poptorch.trainingModel(model, optimizer=opt)
    training(x, t)
    opt.param_groups[0]["lr"] = 1e-4
    training.setOptimizer(opt)
    assert training._state.binding.description.groups[0]["lr"] == 1e-4


def test_mark_as_constant_and_variable():
    model = Classifier()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    assert opt.variable_attrs.isConstant("momentum")
    opt.variable_attrs.markAsVariable("momentum")
    opt.variable_attrs.markAsConstant("lr")
    with pytest.raises(AssertionError, match="Unknown attribute foo, allowed values"):
        opt.variable_attrs.markAsVariable("foo")
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(2)
    training(x, t)
    assert "Accl___fc1.weight" in opt.state_dict()["ipu_state"]  # variable momentum
    opt.param_groups[0]["momentum"] = 0.9
    training.setOptimizer(opt)  # variable: fine
    opt.param_groups[0]["lr"] = 0.2
    with pytest.raises(poptorch.Error, match="constant lr"):
        training.setOptimizer(opt)
    opt.param_groups[0]["lr"] = 0.1
    opt.loss_scaling = 8.0  # constant (not passed)
    with pytest.raises(poptorch.Error, match="constant loss_scaling"):
        training.setOptimizer(opt)


def test_torch_optimizer_constant_rules():
    """docs/semantics.md S-52: torch optimizers — lr variable; others constant iff equal to the
    default (AdamW weight_decay 1e-2); betas/alpha/nesterov always constant."""
    def constants(cls, **kw):
        model = Classifier()
        training = poptorch.trainingModel(model, optimizer=cls(model.parameters(), **kw))
        return training._state.binding.description.constant

    assert constants(torch.optim.SGD, lr=0.1) >= {"momentum", "dampening", "weight_decay",
                                                  "nesterov", "loss_scaling"}
    c = constants(torch.optim.SGD, lr=0.1, momentum=0.9)
    assert "momentum" not in c and "lr" not in c
    assert "weight_decay" in constants(torch.optim.AdamW, lr=0.1)
    c = constants(torch.optim.AdamW, lr=0.1, weight_decay=0.0)
    assert "weight_decay" not in c and "betas" in c
    c = constants(torch.optim.RMSprop, lr=0.1, alpha=0.5, eps=1e-5)
    assert "alpha" in c and "eps" not in c


def test_per_group_hyper_parameters_and_parameters_in_no_group():
    """docs/semantics.md S-55: fc1 in a group with its own lr, fc2.weight in the default group,
    fc2.bias in no group → trained with optimizer.defaults."""
    model = Classifier()
    ref = copy.deepcopy(model)
    groups = [{"params": model.fc1.parameters(), "lr": 0.05, "momentum": 0.5},
              {"params": [model.fc2.weight]}]
    opt = poptorch.optim.SGD(groups, lr=0.2, momentum=0.9)
    training = poptorch.trainingModel(model, options(d=10), opt)
    x, t = data(20)
    training(x, t)
    ref_opt = torch.optim.SGD([{"params": ref.fc1.parameters(), "lr": 0.05, "momentum": 0.5},
                               {"params": [ref.fc2.weight, ref.fc2.bias]}],
                              lr=0.2, momentum=0.9)
    reference_training(ref, ref_opt, x, t, 10, 1, 1)
    assert_same_weights(model, ref)
    params = opt.state_dict()["ipu_param"]
    assert params["scaledLearningRate0___specific___fc1.weight"].item() == pytest.approx(0.05)
    assert params["scaledLearningRate0___specific___fc2.bias"].item() == pytest.approx(0.2)


def test_new_optimizer_object_keeps_device_state_and_swaps_hyper_parameters():
    """docs/semantics.md S-56: a new optimizer without state does not reset the device momentum."""
    model = Classifier()
    ref = copy.deepcopy(model)
    first = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, options(d=5), first)
    x, t = data(10)
    training(x, t)
    second = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    training.setOptimizer(second)
    training(x, t)
    assert first._device is None and first.state_dict()["ipu_state"] is not None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    reference_training(ref, ref_opt, x, t, 5, 1, 1)
    ref_opt.param_groups[0]["lr"] = 0.05
    reference_training(ref, ref_opt, x, t, 5, 1, 1)
    assert_same_weights(model, ref)


# -- bad input: clear errors, nothing changes ------------------------------------------------

def test_invalid_optimizers_leave_weights_and_state_untouched():
    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(2)
    training(x, t)
    weights, state = device_weights(training), device_state(training)
    host = copy.deepcopy(model.state_dict())

    def bad_lr():
        o = poptorch.optim.Adam(model.parameters(), lr=0.01)
        o.param_groups[0]["lr"] = "fast"
        return o

    def bad_betas():
        o = poptorch.optim.Adam(model.parameters(), lr=0.01)
        o.param_groups[0]["betas"] = 0.9
        return o

    def missing():
        o = poptorch.optim.Adam(model.parameters(), lr=0.01)
        del o.param_groups[0]["eps"]
        return o

    def nan_norm():
        return poptorch.optim.Adam(model.parameters(), lr=0.01, max_grad_norm=float("nan"))

    def other_type():
        return poptorch.optim.SGD(model.parameters(), lr=0.01)

    def fp16_accum():
        return poptorch.optim.Adam(model.parameters(), lr=0.01, accum_type=torch.float16)

    def centered_mix():
        return torch.optim.RMSprop([{"params": model.fc1.parameters(), "centered": True},
                                    {"params": model.fc2.parameters()}], lr=0.01)

    cases = [
        (bad_lr, AssertionError, "Expected a number for lr"),
        (bad_betas, AssertionError, "Expected a pair of numbers for betas"),
        (missing, AssertionError, "Mandatory attribute eps not found in optimizer group"),
        (nan_norm, poptorch.Error, "Maximum norm of gradients cannot be NaN"),
        (other_type, poptorch.Error, "optimizer type"),
        (fp16_accum, ValueError, "is already compiled"),
        (centered_mix, AssertionError, "centered"),
        (lambda: torch.optim.Adagrad(model.parameters()), AssertionError,
         "Unsupported optimizer type"),
        (lambda: torch.optim.Adam(model.parameters(), amsgrad=True), ValueError,
         "Only non-amsgrad Adam/AdamW optimizers are supported."),
        (lambda: poptorch.optim.Adam(Classifier().parameters(), lr=0.01), poptorch.Error,
         "not parameters of the model"),
    ]
    for make, exc, phrase in cases:
        with pytest.raises(exc, match=phrase):
            training.setOptimizer(make())
        assert training._state.binding.optimizer is opt
        assert_unchanged(weights, device_weights(training))
        assert_unchanged(state, device_state(training))
    for k, v in model.state_dict().items():
        assert torch.equal(v, host[k])
    training(x, t)


def test_optimizer_over_another_models_parameters_is_rejected_at_wrap():
    model = Classifier()
    with pytest.raises(poptorch.Error, match="not parameters of the model wrapped"):
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(Classifier().parameters(),
                                                                 lr=0.1))
    assert type(model) is Classifier  # not instrumented


def test_rejected_set_optimizer_leaves_attribute_tracking_unchanged(poptorch_logs):
    """Found by a user: after a rejected setOptimizer(Adam), valid setOptimizer calls of
    the compiled SGD warned that its momentum was being ignored."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            return poptorch.identity_loss(self.fc(x).sum(), "sum")

    m = Net()
    opt = poptorch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(m, optimizer=opt)
    training(torch.ones(1, 3))
    with pytest.raises(poptorch.Error, match="optimizer type: SGD -> Adam"):
        training.setOptimizer(poptorch.optim.Adam(m.parameters(), lr=0.1))
    poptorch_logs.clear()
    opt.param_groups[0]["lr"] = 0.05
    training.setOptimizer(opt)
    assert "Ignoring unexpected" not in poptorch_logs.text
    training(torch.ones(1, 3))


class _StepCountingSGD(torch.optim.SGD):
    """A subclass whose Python step() PopTorch never calls."""
    steps = 0

    def step(self, closure=None):
        type(self).steps += 1
        return super().step(closure)


class _PopTorchSGDSubclass(poptorch.optim.SGD):
    """A subclass that changes nothing: it must warn once and train as its base."""


@pytest.mark.parametrize("optimizer_class", [_StepCountingSGD, _PopTorchSGDSubclass])
def test_subclassed_optimizer_warns_and_trains_as_its_base(optimizer_class, poptorch_logs):
    model = Classifier()
    reference = copy.deepcopy(model)
    x, t = data(4)
    training = poptorch.trainingModel(model, optimizer=optimizer_class(model.parameters(),
                                                                       lr=0.1))
    training(x, t)
    warnings = [r.getMessage() for r in poptorch_logs.records
                if r.levelno == logging.WARNING and "Subclassed optimizers" in r.getMessage()]
    assert len(warnings) == 1 and optimizer_class.__name__ in warnings[0]
    assert _StepCountingSGD.steps == 0  # the device runs SGD's own update
    reference_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, t,
                       1, 1, 1)
    assert_same_weights(model, reference)


def test_plain_optimizers_do_not_warn_about_subclassing(poptorch_logs):
    for optimizer_class in (torch.optim.SGD, poptorch.optim.SGD):
        model = Classifier()
        poptorch.trainingModel(model, optimizer=optimizer_class(model.parameters(),
                                                                lr=0.1))(*data(4))
    assert not [r for r in poptorch_logs.records if "Subclassed" in r.getMessage()]


@pytest.mark.parametrize("accum_type", [torch.float16, torch.float32])
def test_graph_optimizer_log_names_the_storage_types(poptorch_logs, accum_type):
    """The "Updating graph optimizer" line gives the accumulation types in PopTorch's
    words (accumType=, firstOrderMomentumAccumType=, secondOrderMomentumAccumType=)."""
    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01, accum_type=accum_type,
                              first_order_momentum_accum_type=torch.float16,
                              second_order_momentum_accum_type=torch.float32)
    training = poptorch.trainingModel(model, optimizer=opt)
    training.compile(*data(4))
    line = [ln for ln in poptorch_logs.text.splitlines() if "graph optimizer" in ln][-1]
    name = str(accum_type).rpartition(".")[2]
    assert f"accumType={name}, firstOrderMomentumAccumType=float16, " \
        "secondOrderMomentumAccumType=float32, useTfVariant=0, maxGradNorm=inf" in line
