"""Precompiled executables: ``compileAndExport``, ``save``, ``poptorch.load``,
``loadExecutable``, ``importPoptorchMetadataFromFile`` (docs/api-sections.md api §2.3, §2.13,
§5.4-§5.6; docs/semantics.md S-62, S-81, S-96), the file format's checks and the no-unpickling
rule."""
import copy
import json
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from poptorch._files import container as _serialization


class Net(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)
        self.drop = nn.Dropout(p)

    def forward(self, x, t=None):
        out = self.fc2(self.drop(F.relu(self.fc1(x))))
        if t is None:
            return out
        return out, F.cross_entropy(out, t)


def data(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def rewrite(path, **changes):
    """Rewrite a container with some blobs replaced (valid checksums)."""
    blobs = _serialization.read_container(str(path))
    blobs.update(changes)
    _serialization.write_container(str(path), blobs)


def test_inference_export_and_load_match_the_model(tmp_path, captures):
    model = Net().eval()
    x, _ = data()
    path = tmp_path / "net.poptorch"
    exe = poptorch.inferenceModel(model)
    exe.compileAndExport(str(path), x)
    assert len(captures) == 1
    loaded = poptorch.load(str(path))
    assert len(captures) == 1  # nothing captured again
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert isinstance(loaded.model, poptorch._files.export.ExportedModel)
    with pytest.raises(poptorch.Error, match="Shape mismatch for x"):
        loaded(torch.randn(4, 6))


def test_training_continues_bit_identically_after_load(tmp_path):
    """Weights, Adam state and the dropout RNG stream carry over (docs/semantics.md S-62, S-96)."""
    model = Net(p=0.5)
    optimizer = poptorch.optim.Adam(model.parameters(), lr=0.01, loss_scaling=2.0)
    opts = poptorch.Options().randomSeed(7)
    trainer = poptorch.trainingModel(model, opts, optimizer)
    x, t = data()
    for _ in range(2):
        trainer(x, t)
    path = tmp_path / "train.poptorch"
    trainer.save(str(path))
    expected = [trainer(x, t)[1] for _ in range(3)]
    expected_weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    loaded = poptorch.load(str(path))
    got = [loaded(x, t)[1] for _ in range(3)]
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    weights = loaded.model.state_dict()
    for name, value in expected_weights.items():
        assert torch.equal(weights[name], value), name
    assert isinstance(loaded._state.binding.optimizer, poptorch.optim.Adam)
    assert loaded._state.binding.optimizer.loss_scaling == 2.0


def test_load_of_a_program_with_a_dtype_cast_passes_the_verifier(tmp_path):
    """``.to(dtype)`` of a computed mask captures ``aten._assert_tensor_metadata``,
    which returns nothing: torch's serializer drops its (None) value, and the loaded
    graph failed POPTORCH_VERIFY's "has no meta['val']" (found by issue 24's tests)."""
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            return self.fc(x) * (x[:, :4] > 0).to(x.dtype)

    model = Masked().eval()
    x, _ = data()
    path = tmp_path / "masked.poptorch"
    poptorch.inferenceModel(model).compileAndExport(str(path), x)
    loaded = poptorch.load(str(path))
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_load_executable_uses_the_wrappers_weights_without_capturing(tmp_path,
                                                                    captures):
    x, _ = data()
    path = tmp_path / "net.poptorch"
    poptorch.inferenceModel(Net()).compileAndExport(str(path), x, export_model=False)
    other = Net()  # other weights, same architecture
    exe = poptorch.inferenceModel(other)
    exe.loadExecutable(str(path))
    assert len(captures) == 1
    assert exe.isCompiled()
    torch.testing.assert_close(exe(x), other(x), rtol=0, atol=0)


def test_load_of_an_executable_only_file_points_at_load_executable(tmp_path):
    x, _ = data()
    path = tmp_path / "net.poptorch"
    poptorch.inferenceModel(Net()).compileAndExport(str(path), x, export_model=False)
    with pytest.raises(AssertionError, match=r"export_model=False.*loadExecutable"):
        poptorch.load(str(path))


def test_save_errors_and_target_paths(tmp_path, poptorch_logs, monkeypatch):
    exe = poptorch.inferenceModel(Net())
    with pytest.raises(poptorch.Error,
                       match="Model has not been compiled or has been destroyed."):
        exe.save(str(tmp_path / "a.poptorch"))
    x, _ = data()
    exe.compile(x)
    exe.save(str(tmp_path))  # a directory
    assert (tmp_path / "model.poptorch").is_file()
    assert "is a directory" in poptorch_logs.text
    exe.save(str(tmp_path / "new" / "dir" / "b.poptorch"))
    assert (tmp_path / "new" / "dir" / "b.poptorch").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(AssertionError, match="is not a directory"):
        exe.save(str(tmp_path / "file" / "c.poptorch"))
    # a directory that does not exist yet, named with a trailing separator
    exe.save(str(tmp_path / "newdir") + os.sep)
    assert (tmp_path / "newdir" / "model.poptorch").is_file()
    assert "ends with a path separator" in poptorch_logs.text
    # an empty name: refused before anything is written (not even a temporary file in
    # the parent of the working directory)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(poptorch.Error, match="Cannot save to '': give the path of a file"):
        exe.save("")
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not list((tmp_path / "cwd").iterdir())


def test_trivial_model_has_nothing_to_export(tmp_path):
    class Identity(nn.Module):
        def forward(self, x):
            return x

    exe = poptorch.inferenceModel(Identity())
    exe.compile(torch.ones(2))
    with pytest.raises(poptorch.Error, match="Nothing to export"):
        exe.save(str(tmp_path / "i.poptorch"))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("exported") / "net.poptorch"
    x, _ = data()
    poptorch.inferenceModel(Net()).compileAndExport(str(path), x)
    return path


def test_truncated_corrupted_and_foreign_files_are_refused(exported, tmp_path):
    raw = exported.read_bytes()
    truncated = tmp_path / "truncated.poptorch"
    truncated.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(poptorch.Error, match=r"Invalid file .*truncated"):
        poptorch.load(str(truncated))

    corrupted = tmp_path / "corrupted.poptorch"
    with zipfile.ZipFile(exported) as src, zipfile.ZipFile(corrupted, "w") as dst:
        for item in src.namelist():
            data_ = src.read(item)
            if item == "program.json":
                data_ = data_.replace(b"linear", b"lineaX", 1)
            dst.writestr(item, data_)
    with pytest.raises(poptorch.Error, match="blob program.json is corrupted"):
        poptorch.load(str(corrupted))

    foreign = tmp_path / "foreign.zip"
    with zipfile.ZipFile(foreign, "w") as dst:
        dst.writestr("hello.txt", "hi")
    with pytest.raises(poptorch.Error, match="does not contain Poptorch metadata"):
        poptorch.importPoptorchMetadataFromFile(str(foreign))
    with pytest.raises(poptorch.Error, match="no such file"):
        poptorch.load(str(tmp_path / "missing.poptorch"))


@pytest.mark.parametrize("version, shown", [
    (1, "1"),  # before the options' classes moved
    ("2", "'2'"), (2.0, "2.0"), (True, "True")])  # the right number, not an integer
def test_another_format_version_is_refused(exported, tmp_path, version, shown):
    other = tmp_path / "v1.poptorch"
    with zipfile.ZipFile(exported) as src, zipfile.ZipFile(other, "w") as dst:
        for item in src.namelist():
            data_ = src.read(item)
            if item == "manifest.json":
                manifest = json.loads(data_)
                manifest["format_version"] = version
                data_ = json.dumps(manifest).encode()
            dst.writestr(item, data_)
    with pytest.raises(poptorch.Error, match=f"format version {shown} is not supported "
                       r"by this PopTorch \(which reads version 2\)"):
        poptorch.load(str(other))


def test_poptorch_version_mismatch(exported, tmp_path):
    path = tmp_path / "old.poptorch"
    path.write_bytes(exported.read_bytes())
    meta = json.loads(poptorch.importPoptorchMetadataFromFile(str(path)))
    assert meta["poptorch_version"] == poptorch.__version__
    meta["poptorch_version"] = "3.3.0"
    rewrite(path, **{"metadata.json": json.dumps(meta).encode()})
    with pytest.raises(AssertionError, match="PopTorch version mismatch"):
        poptorch.load(str(path))
    with pytest.raises(poptorch.Error, match="PopTorch version mismatch"):
        poptorch.inferenceModel(Net()).loadExecutable(str(path))


def test_files_for_another_model_or_options_are_refused(exported):
    class Wider(Net):
        def __init__(self):
            super().__init__()
            self.fc2 = nn.Linear(8, 5)

    with pytest.raises(poptorch.Error, match=r"weight fc2.weight has shape \[5, 8\] here "
                                             r"but \[4, 8\]"):
        poptorch.inferenceModel(Wider()).loadExecutable(str(exported))
    with pytest.raises(poptorch.Error, match="inference executable but this is an "
                                             "training model"):
        poptorch.trainingModel(Net()).loadExecutable(str(exported))
    opts = poptorch.Options().deviceIterations(2)
    with pytest.raises(poptorch.Error, match="compile-time option device_iterations"):
        poptorch.inferenceModel(Net(), opts).loadExecutable(str(exported))

    class OtherInputs(Net):
        def forward(self, x, y, t=None):
            return super().forward(x + y, t)

    with pytest.raises(poptorch.Error, match=r"forward takes \['x', 'y', 't'\] here"):
        poptorch.inferenceModel(OtherInputs()).loadExecutable(str(exported))


class _Payload:
    """Unpickling this creates the file ``path``: code from the file would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_loading_never_unpickles_unless_asked(exported, tmp_path):
    path = tmp_path / "evil.poptorch"
    path.write_bytes(exported.read_bytes())
    marker = tmp_path / "code-ran"
    rewrite(path, **{"model.pkl": pickle.dumps(_Payload(str(marker)))})
    x, _ = data()
    loaded = poptorch.load(str(path))  # the program runs; the pickle is not read
    assert loaded(x).shape == (8, 4)
    assert not marker.exists()
    with pytest.raises(Exception):
        poptorch.load(str(path), unpickle_model=True)  # opting in runs the pickle
    assert marker.exists()


def test_unpickle_model_restores_the_python_model(tmp_path):
    model = Net()
    x, t = data()
    trainer = poptorch.trainingModel(model)
    trainer(x, t)
    path = tmp_path / "t.poptorch"
    trainer.save(str(path))
    loaded = poptorch.load(str(path), unpickle_model=True)
    # the stored (uninstrumented) Net, instrumented again by the new trainingModel
    assert poptorch._executor.instrument.original_class(loaded.model) is Net
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], value)


def test_offline_precompilation_and_edit_opts_fn(tmp_path):
    """docs/semantics.md S-62 / S-81: precompile with useOfflineIpuTarget, run after
    poptorch.load."""
    x, _ = data()
    model = Net().eval()
    path = tmp_path / "offline.poptorch"
    opts = poptorch.Options().useOfflineIpuTarget(2)
    exe = poptorch.inferenceModel(model, opts)
    exe.compileAndExport(str(path), x)
    seen = []
    loaded = poptorch.load(str(path), edit_opts_fn=lambda o: seen.append(
        (o.connection_type, o.exists("ipu_version"))))
    assert seen == [(poptorch.ConnectionType.Always.value, False)]
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    # docs/semantics.md S-62: only run-time options may change after loading
    with pytest.raises(poptorch.Error, match="compile-time option replication_factor"):
        poptorch.load(str(path), edit_opts_fn=lambda o: o.replicationFactor(2))


def test_options_the_environment_creates_are_not_required_in_a_file(exported,
                                                                    monkeypatch):
    """Every option a file stores must be present (a missing one is refused), but not
    those that this process's POPTORCH_DEFAULT_OPTIONS creates (random_seed)."""
    monkeypatch.setenv("POPTORCH_DEFAULT_OPTIONS", '{"randomSeed": 3}')
    assert poptorch.Options().exists("random_seed")
    x, _ = data()
    assert poptorch.load(str(exported))(x).shape == (8, 4)


def test_import_metadata_describes_the_file(exported):
    meta = json.loads(poptorch.importPoptorchMetadataFromFile(str(exported)))
    assert meta["kind"] == "executable"
    assert meta["training"] is False and meta["export_model"] is True
    assert meta["torch_version"] == torch.__version__


def test_loaded_models_are_not_connected(tmp_path):
    """docs/semantics.md S-62: a loaded inference model does not follow a loaded training model."""
    x, t = data()
    trainer = poptorch.trainingModel(Net())
    trainer.compileAndExport(str(tmp_path / "t.poptorch"), x, t)
    inference = poptorch.inferenceModel(copy.deepcopy(trainer.model))
    inference.compileAndExport(str(tmp_path / "i.poptorch"), x)
    t2 = poptorch.load(str(tmp_path / "t.poptorch"))
    i2 = poptorch.load(str(tmp_path / "i.poptorch"))
    before = i2(x)
    t2(x, t)
    assert torch.equal(i2(x), before)


_MODULE = '''
import torch
import torch.nn as nn
import torch.nn.functional as F


class SecretNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.25)

    def forward(self, x, t=None):
        out = self.fc2(self.drop(torch.tanh(self.fc1(x))))
        if t is None:
            return out
        return out, F.cross_entropy(out, t)
'''

_EXPORT = '''
import json, sys, torch, poptorch
sys.path.insert(0, {src!r})
from secret_model import SecretNet
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
x, t = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
model = SecretNet()
opts = poptorch.Options().randomSeed(3)
trainer = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1,
                                                                momentum=0.9))
trainer(x, t)
trainer.save({train!r})
inference = poptorch.inferenceModel(SecretNet().eval())
inference.compileAndExport({infer!r}, x)
expected = {{"train": [trainer(x, t)[1].item() for _ in range(2)],
            "infer": inference(x).flatten().tolist()}}
json.dump(expected, open({out!r}, "w"))
'''

_LOAD = '''
import importlib.util, json, sys, torch, poptorch
g = torch.Generator().manual_seed(1)
x, t = torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
if importlib.util.find_spec("secret_model") is not None:
    raise SystemExit("the model source is still importable")
trainer = poptorch.load({train!r})
inference = poptorch.load({infer!r})
got = {{"train": [trainer(x, t)[1].item() for _ in range(2)],
       "infer": inference(x).flatten().tolist()}}
json.dump(got, open({out!r}, "w"))
'''


@pytest.mark.slow
def test_exported_file_runs_in_a_process_without_the_model_source(tmp_path):
    """Beyond PopTorch: the stored program runs (inference and continued training)
    where the model's Python module does not exist."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "secret_model.py").write_text(_MODULE)
    files = {k: str(tmp_path / f"{k}.poptorch") for k in ("train", "infer")}
    env = {**os.environ, "POPTORCH_LOG_LEVEL": "ERR"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-c", textwrap.dedent(_EXPORT.format(
        src=str(src), out=str(tmp_path / "expected.json"), **files))],
        check=True, timeout=300, env=env, cwd=str(tmp_path))
    for item in list(src.iterdir()):
        if item.is_dir():
            for sub in item.iterdir():
                sub.unlink()
            item.rmdir()
        else:
            item.unlink()
    src.rmdir()
    subprocess.run([sys.executable, "-c", textwrap.dedent(_LOAD.format(
        out=str(tmp_path / "got.json"), **files))],
        check=True, timeout=300, env=env, cwd=str(tmp_path))
    expected = json.loads((tmp_path / "expected.json").read_text())
    got = json.loads((tmp_path / "got.json").read_text())
    assert got == expected


def test_tagged_json_rebuilds_only_poptorch_option_classes():
    opts = poptorch.Options().deviceIterations(3).randomSeed(4)
    opts.Training.gradientAccumulation(2)
    opts.setAvailableMemoryProportion({"IPU0": 0.5})
    back = _serialization.decode(json.loads(json.dumps(_serialization.encode(opts))))
    assert isinstance(back, poptorch.Options)
    assert back.device_iterations == 3 and back.random_seed == 4
    assert back.Training.gradient_accumulation == 2
    assert back.available_memory_proportion == {0: 0.5}
    for evil in ({"__object__": "os:system", "state": {"__dict__": []}},
                 {"__enum__": "subprocess:Popen", "name": "x"}):
        with pytest.raises(poptorch.Error, match="is not a poptorch option class"):
            _serialization.decode(evil)
    with pytest.raises(poptorch.Error, match="cannot be stored in an executable file"):
        _serialization.encode({"f": len})


def test_a_model_loaded_without_its_source_cannot_be_recaptured(exported):
    loaded = poptorch.load(str(exported))
    loaded.destroy()
    with pytest.raises(poptorch.Error, match="loaded from an exported file without its "
                                             "Python source"):
        loaded(torch.randn(8, 6))


def test_a_pipelined_training_model_keeps_its_placement_after_load(tmp_path):
    """Block placements recorded at capture travel with the program."""
    class TwoBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 4)

        def forward(self, x, t):
            with poptorch.Block("A", ipu_id=0):
                y = self.a(x)
            with poptorch.Block("B", ipu_id=1):
                y = self.b(y)
                loss = F.cross_entropy(y, t)
            return y, loss

    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    opts.setExecutionStrategy(poptorch.PipelinedExecution("A", "B"))
    trainer = poptorch.trainingModel(TwoBlocks(), opts)
    x, t = data()
    trainer.compileAndExport(str(tmp_path / "p.poptorch"), x, t)
    expected = [trainer(x, t)[1] for _ in range(2)]
    loaded = poptorch.load(str(tmp_path / "p.poptorch"))
    assert [loaded(x, t)[1] for _ in range(2)] == expected
    assert loaded.placementSummary() == trainer.placementSummary()


# -- every options group in a file; loaded models after destroy ------------------------

def test_every_options_group_can_be_stored_in_an_executable_file(tmp_path):
    """``Options.Backend`` lives in its own module: save() refused it and every
    save / compileAndExport failed (docs/api-sections.md api §5.4)."""
    opts = poptorch.Options()
    decoded = _serialization.decode(_serialization.encode(opts))
    assert decoded.Backend.compilerName == opts.Backend.compilerName
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    path = str(tmp_path / "linear.poptorch")
    poptorch.inferenceModel(model).compileAndExport(path, x)
    torch.testing.assert_close(poptorch.load(path)(x), model(x))


def test_calling_a_loaded_model_after_destroy_says_to_load_again(tmp_path):
    """The error told the user to use 'the executor returned by poptorch.load()',
    which is the one they were calling; it now says to load the file again."""
    x = torch.randn(3, 4)
    model = nn.Linear(4, 2)
    path = str(tmp_path / "linear.poptorch")
    poptorch.inferenceModel(model).compileAndExport(path, x)
    loaded = poptorch.load(path)
    loaded.destroy()
    with pytest.raises(poptorch.Error, match=r"after destroy\(\)\)\. Load the file "
                                             r"again with poptorch\.load\(\)"):
        loaded(x)
    torch.testing.assert_close(poptorch.load(path)(x), model(x))
