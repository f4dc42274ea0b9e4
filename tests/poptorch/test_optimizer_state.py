"""Optimizer state on the device: ``state_dict`` / ``load_state_dict`` with ``ipu_state``
and ``ipu_param`` (docs/api-sections.md api §10.1, docs/semantics.md S-56, S-91), checkpoints
resumed in a new process, and bad state dicts (clear errors, device untouched)."""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from models import Classifier
from models import classifier_data as data


def snapshot(training):
    weights = {k: v.clone() for k, v in training._state.session.readWeights().items()}
    state = {k: v.clone() for k, v in training._state.session.readOptimizerState().items()}
    return weights, state


def assert_snapshot_equal(a, b):
    for before, after in zip(a, b):
        assert before.keys() == after.keys()
        for k in before:
            assert torch.equal(before[k], after[k]), k


def test_state_dict_lifecycle_and_names(poptorch_logs):
    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    state = opt.state_dict()
    assert state["ipu_state"] is None and state["ipu_param"] is None
    assert set(state) == {"state", "param_groups", "ipu_state", "ipu_param"}
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(4)
    training.compile(x, t)
    state = opt.state_dict()
    assert set(state["ipu_state"]) == {f"{kind}___{n}" for n, _ in model.named_parameters()
                                       for kind in ("Accl1", "Accl2", "Step")}
    assert state["ipu_param"]["learningRate___specific___fc1.weight"].item() == \
        pytest.approx(0.01)
    assert "learningRate___default___FLOAT" in state["ipu_param"]
    assert "weightDecay___specific___fc2.bias" in state["ipu_param"]
    training(x, t)
    poptorch_logs.clear()
    first = opt.state_dict()
    assert "Writing optimiser state tensors from IPU to host." in poptorch_logs.text
    assert first["ipu_state"]["Step___fc1.weight"].item() == 1
    poptorch_logs.clear()
    second = opt.state_dict()
    assert "Using cached optimiser state dict" in poptorch_logs.text
    assert "Writing optimiser state" not in poptorch_logs.text
    assert torch.equal(first["ipu_state"]["Accl1___fc1.weight"],
                       second["ipu_state"]["Accl1___fc1.weight"])


def test_sgd_state_names_and_hyper_parameters():
    model = Classifier()
    plain = poptorch.optim.SGD(model.parameters(), lr=0.1, dampening=0.5, weight_decay=0.1,
                               loss_scaling=4.0)
    training = poptorch.trainingModel(model, optimizer=plain)
    training(*data(2))
    state = plain.state_dict()
    assert state["ipu_state"] == {}  # no momentum, no accumulation: no state
    params = state["ipu_param"]
    assert params["scaledLearningRate0___specific___fc1.weight"].item() == \
        pytest.approx(0.1 * 0.5 / 4.0)
    assert params["weightDecayScaleFactor0___specific___fc1.weight"].item() == \
        pytest.approx(1 - 0.1 * 0.5 * 0.1)
    assert params["lossScaling_FLOAT"].item() == 4.0
    model = Classifier()
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    momentum = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, opts, momentum)
    training(*data(4))
    assert set(momentum.state_dict()["ipu_state"]) == {
        f"{kind}___{n}" for n, _ in model.named_parameters() for kind in ("Accl", "Accum")}


def test_load_state_dict_round_trip_after_destroy(tmp_path):
    """docs/semantics.md S-56 example: save with torch.save, destroy, new Adam, load, wrap, compile
    → the new ipu_state equals the saved one."""
    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters(), lr=1.0)
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(4)
    training(x, t)
    training(x, t)
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    training.destroy()
    new = poptorch.optim.Adam(model.parameters(), lr=1.0)
    new.load_state_dict(torch.load(path))
    assert new.has_state()
    training = poptorch.trainingModel(model, optimizer=new)
    training.compile(x, t)
    saved = torch.load(path)["ipu_state"]
    loaded = new.state_dict()["ipu_state"]
    assert saved.keys() == loaded.keys()
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def test_loaded_state_is_written_before_the_next_run(poptorch_logs):
    """Loading a state into the attached optimizer rewinds momentum and step counts."""
    model = Classifier()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(2)
    training(x, t)
    checkpoint = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    training(x, t)
    after_two = copy.deepcopy(model.state_dict())
    # rewind: weights through the executor, optimizer state through load_state_dict
    training.load_state_dict(weights)
    opt.load_state_dict(checkpoint)
    assert opt.state_dict()["ipu_state"]["Accl___fc1.weight"].equal(
        checkpoint["ipu_state"]["Accl___fc1.weight"])  # pending state, not the device's
    poptorch_logs.clear()
    training(x, t)
    assert "Writing optimiser state tensors from host to IPU memory." in poptorch_logs.text
    for k, v in model.state_dict().items():
        assert torch.equal(v, after_two[k]), k


def test_missing_entries_keep_their_device_values(poptorch_logs):
    model = Classifier()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*data(2))
    state = copy.deepcopy(opt.state_dict())
    kept = state["ipu_state"].pop("Accl___fc1.bias")
    del state["ipu_param"]["scaledLearningRate0___specific___fc1.bias"]
    state["ipu_state"]["Accl___fc2.bias"] = torch.zeros(4)
    opt.load_state_dict(state)
    # attached: writes the pending state now (docs/api-sections.md api §5.12)
    training.setOptimizer(opt)
    assert "ignoring missing state Accl___fc1.bias" in poptorch_logs.text
    assert "ignoring missing parameter scaledLearningRate0___specific___fc1.bias" in \
        poptorch_logs.text
    device = training._state.session.readOptimizerState()
    assert torch.equal(device["Accl___fc1.bias"], kept)
    assert torch.equal(device["Accl___fc2.bias"], torch.zeros(4))


def test_new_optimizer_with_state_overwrites_device_state():
    model = Classifier()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*data(2))
    zeros = {k: torch.zeros_like(v) for k, v in opt.state_dict()["ipu_state"].items()}
    fresh = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fresh.load_state_dict({**fresh.state_dict(), "ipu_state": zeros, "ipu_param": {}})
    training.setOptimizer(fresh)
    for k, v in training._state.session.readOptimizerState().items():
        assert torch.equal(v, zeros[k]), k


def test_detach_and_destroy_refresh_the_host_copy(poptorch_logs):
    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, optimizer=opt)
    training(*data(2))
    training.detachFromDevice()
    assert opt.get_state_dict()["ipu_state"]["Step___fc1.weight"].item() == 1
    training(*data(2))  # re-attaches, re-uploads the host copy, runs
    training.destroy()
    assert opt.get_state_dict()["ipu_state"]["Step___fc1.weight"].item() == 2


def test_native_and_empty_state_dicts_are_rejected():
    model = Classifier()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="Cannot load optimizer state dictionary "
                                           "because it is empty."):
        opt.load_state_dict({})
    native = torch.optim.SGD(model.parameters(), lr=0.1).state_dict()
    with pytest.raises(RuntimeError, match="Only IPU optimizer states can be loaded onto "
                                           "the IPU."):
        opt.load_state_dict(native)


def test_bad_state_dicts_leave_device_and_host_untouched():
    model = Classifier()
    opt = poptorch.optim.Adam(model.parameters(), lr=0.01)
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(2)
    training(x, t)
    good = copy.deepcopy(opt.state_dict())
    before = snapshot(training)
    groups = copy.deepcopy(opt.param_groups)

    def with_state(**changes):
        state = copy.deepcopy(good)
        state["ipu_state"].update(changes)
        return state

    def other_lr():
        state = copy.deepcopy(good)
        state["param_groups"][0]["lr"] = 0.5  # lr was passed: variable → allowed
        state["param_groups"][0]["eps"] = 1e-3  # eps was not: constant → rejected
        return state

    bad = [
        (with_state(**{"Accl1___fc1.weight": torch.zeros(3, 3)}), poptorch.Error,
         r"Accl1___fc1.weight has shape \[3, 3\] but the device expects \[8, 6\]"),
        (with_state(**{"Step___fc1.weight": 5}), poptorch.Error, "must map a tensor name"),
        (with_state(**{"Accl2___fc1.bias": torch.zeros(8, dtype=torch.bool)}),
         poptorch.Error, "dtype torch.bool"),
        ({**good, "ipu_state": [1, 2]}, poptorch.Error, "must be a dict of tensors"),
        (other_lr(), poptorch.Error, "constant eps"),
        ({**good, "param_groups": good["param_groups"] * 2}, ValueError, "param"),
    ]
    for state, exc, phrase in bad:
        with pytest.raises(exc, match=phrase):
            opt.load_state_dict(state)
        assert not poptorch.optim.state_pending(opt)
        assert opt.param_groups[0]["lr"] == groups[0]["lr"]
        assert opt.param_groups[0]["eps"] == groups[0]["eps"]
        assert_snapshot_equal(before, snapshot(training))
    training(x, t)  # still usable


def test_bad_state_loaded_before_compilation_is_dropped():
    """Shapes can only be checked once compiled: the upload fails with a clear error,
    the device keeps fresh state and the model stays usable."""
    model = Classifier()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = opt.state_dict()
    state["ipu_state"] = {"Accl___fc1.weight": torch.zeros(2)}
    state["ipu_param"] = {}
    opt.load_state_dict(state)
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(2)
    with pytest.raises(poptorch.Error, match="Accl___fc1.weight has shape"):
        training(x, t)
    assert not poptorch.optim.state_pending(opt)
    assert not training.isCompiled()  # a failed upload commits nothing (issue 14)
    training(x, t)
    assert opt.state_dict()["ipu_state"]["Accl___fc1.weight"].shape == \
        model.fc1.weight.shape


def test_offline_target_has_no_state():
    model = Classifier()
    opts = poptorch.Options().useOfflineIpuTarget()
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, opts, opt)
    training.compile(*data(2))
    assert opt.state_dict()["ipu_state"] is None


_RESUME = textwrap.dedent("""
    import importlib.util, os, sys, torch
    sys.path.insert(0, {tests!r})
    spec = importlib.util.spec_from_file_location(  # tests/models.py, as conftest.py does
        "models", os.path.join(os.path.dirname({tests!r}), "models.py"))
    sys.modules["models"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["models"])
    import poptorch
    from test_optimizer_state import Classifier, data, make_training
    torch.manual_seed(123)  # a different initialisation: everything comes from the file
    checkpoint = torch.load({path!r})
    model = Classifier()
    model.load_state_dict(checkpoint["model"])
    training, opt = make_training(model, {kind!r})
    opt.load_state_dict(checkpoint["optimizer"])
    for call in range(3, 6):
        training(*data(12, call))
    torch.save(model.state_dict(), {out!r})
""")


def make_training(model, kind):
    """The training setup shared by the uninterrupted run and the resumed process."""
    opts = poptorch.Options().deviceIterations(3)
    opts.Training.gradientAccumulation(2)
    if kind == "adamw":
        opt = poptorch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    else:
        opt = poptorch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.1,
                                 use_combined_accum=kind == "sgd-combined")
    return poptorch.trainingModel(model, opts, opt), opt


@pytest.mark.parametrize("kind", ["adamw", "sgd", "sgd-combined"])
def test_checkpoint_resumed_in_a_new_process_is_bit_identical(tmp_path, kind):
    """Train 3 calls, checkpoint (model + optimizer state_dict), train 3 more; a new
    process loads the checkpoint into a differently initialised model and trains the
    same 3 calls: the weights are bit-identical."""
    model = Classifier()
    training, opt = make_training(model, kind)
    for call in range(3):
        training(*data(12, call))
    path = tmp_path / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    for call in range(3, 6):
        training(*data(12, call))
    out = tmp_path / "resumed.pt"
    script = _RESUME.format(tests=os.path.dirname(__file__), path=str(path), out=str(out),
                            kind=kind)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=900,
                   env={**os.environ, "POPTORCH_LOG_LEVEL": "ERR"})
    resumed = torch.load(out)
    for k, v in model.state_dict().items():
        assert torch.equal(v, resumed[k]), k


def test_pickled_optimizer_and_rewrapped_optimizer_upload_their_state():
    """docs/api-sections.md api §10.1: an unpickled optimizer carrying a state uploads it on first
    use; an optimizer re-used after destroy() continues with its momentum
    (docs/api-sections.md api §5.2 step 3)."""
    import pickle
    model = Classifier()
    ref = copy.deepcopy(model)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, optimizer=opt)
    x, t = data(2)
    training(x, t)
    training.destroy()
    again = poptorch.trainingModel(model, optimizer=opt)
    again(x, t)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        ref_opt.zero_grad()
        ref(x, t)[1].backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    blob = pickle.dumps(opt)
    restored = pickle.loads(blob)
    assert restored.loss_scaling == 1.0 and restored.use_combined_accum is False
    assert restored.has_state() and poptorch.optim.state_pending(restored)
    saved = opt.state_dict()["ipu_state"]
    again.destroy()
    model2 = Classifier()
    restored = pickle.loads(blob)
    restored.param_groups[0]["params"] = list(model2.parameters())
    third = poptorch.trainingModel(model2, optimizer=restored)
    third.compile(x, t)
    for k, v in third._state.session.readOptimizerState().items():
        assert torch.equal(v, saved[k]), k


# -- torch.optim state in saved executables (docs/semantics.md S-62)
# -------------------------------------

_MAKERS = {"sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
           "adam": lambda p: torch.optim.Adam(p, lr=0.01),
           "poptorch_adam": lambda p: poptorch.optim.Adam(p, lr=0.01)}


def _trained_file(path, make):
    """A training executable saved after two steps; the trainer and its data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    trainer = poptorch.trainingModel(
        _Loss(model), optimizer=make(model.parameters()))
    x, t = torch.randn(4, 4), torch.randint(0, 4, (4,))
    for _ in range(2):
        trainer(x, t)
    trainer.save(str(path))
    return trainer, x, t


@pytest.mark.parametrize("kind", sorted(_MAKERS))
def test_optimizer_state_survives_save_and_load(tmp_path, kind):
    """A ``torch.optim`` optimizer keeps its state only on the device: save() lost
    the momentum / Adam moments, so the loaded model trained differently
    (docs/semantics.md S-62)."""
    path = tmp_path / "train.poptorch"
    trainer, x, t = _trained_file(path, _MAKERS[kind])
    expected = [trainer(x, t) for _ in range(3)]
    loaded = poptorch.load(str(path))
    got = [loaded(x, t) for _ in range(3)]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["sgd_momentum", "poptorch_adam"])
@pytest.mark.parametrize("edit, message", [
    (lambda state: {}, "missing optimizer state ipu_state/"),  # was: state reset
    (lambda state: {k: torch.zeros(1) if k.startswith("ipu_state/") else v
                    for k, v in state.items()},
     r"optimizer state ipu_state/\S+ has shape \[1\] but the compiled optimizer "
     r"expects \[4"),
    (lambda state: {**state, "ipu_state/Accl9___x": torch.zeros(1)},
     "unknown optimizer state ipu_state/Accl9___x"),
], ids=["empty", "wrong_shapes", "unknown"])
def test_stored_optimizer_state_must_match_the_optimizer(tmp_path, kind, edit, message):
    """The state in ``optimizer.safetensors`` names exactly the compiled optimizer's
    state tensors, with their shapes, or the file is refused, naming it."""
    from poptorch._files import container
    path = tmp_path / "train.poptorch"
    _trained_file(path, _MAKERS[kind])
    blobs = container.read_container(str(path))
    state = container.tensors_from_bytes(blobs["optimizer.safetensors"])
    blobs["optimizer.safetensors"] = container.tensors_to_bytes(edit(state))
    container.write_container(str(path), blobs)
    with pytest.raises(poptorch.Error,
                       match=f"Invalid file {path}: optimizer.safetensors: {message}"):
        poptorch.load(str(path))


class _Loss(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, t):
        return F.cross_entropy(self.body(x), t)


def test_a_training_file_compiled_offline_stores_no_state_and_loads(tmp_path):
    """Compiled without a device (``useOfflineIpuTarget``), a training file holds no
    optimizer state: it loads, and trains from the optimizer's initial state."""
    from poptorch._files import container
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    fresh = copy.deepcopy(model)
    x, t = torch.randn(4, 4), torch.randint(0, 4, (4,))
    path = str(tmp_path / "offline.poptorch")
    poptorch.trainingModel(_Loss(model), poptorch.Options().useOfflineIpuTarget(),
                           optimizer=poptorch.optim.Adam(model.parameters(), lr=0.01)
                           ).compileAndExport(path, x, t)
    blobs = container.read_container(path)
    assert container.tensors_from_bytes(blobs["optimizer.safetensors"]) == {}
    loaded = poptorch.load(path)
    reference = poptorch.trainingModel(
        _Loss(fresh), optimizer=poptorch.optim.Adam(fresh.parameters(), lr=0.01))
    for _ in range(2):
        assert torch.equal(loaded(x, t), reference(x, t))
