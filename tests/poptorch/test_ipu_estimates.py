"""The IPU Model as a target through the public API: out-of-memory errors on the small
IPU Model, cycle counts and throughput estimates, the profile report (docs/semantics.md S-82, S-85,
docs/api-sections.md api §5.17) and its page rendered in headless Chromium."""
import json
import logging
import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn as nn

import poptorch
from popart_compiler.cost.host_model import HOST_COPY_BYTES_PER_S, STEP_SYNC_SECONDS
from models import Classifier as TwoLayerClassifier, SingleLinear


class Classifier(nn.Module):
    def __init__(self, width=1024):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.out = nn.Linear(width, 10)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, labels=None):
        y = self.out(torch.relu(self.fc(x)))
        return y if labels is None else (y, self.loss(y, labels))


def poptorch_style_net():
    """The shape of PopTorch's own test models: two linear layers (784 → 1024 → 10) and
    a cross-entropy loss."""
    return TwoLayerClassifier((784, 1024, 10))


def quiet():
    return poptorch.Options().showCompilationProgressBar(False)


def test_small_ipu_model_out_of_memory_is_an_error_in_strict_mode(monkeypatch):
    monkeypatch.setenv("POPTORCH_SMALL_IPU_MODEL", "1")
    monkeypatch.setenv("POPTORCH_IPU_MODEL_STRICT_MEMORY", "1")
    model = poptorch.inferenceModel(Classifier(), quiet())
    with pytest.raises(poptorch.Error) as info:
        model(torch.randn(4, 1024))
    err = info.value
    assert err.type == "poplar_out_of_memory"
    text = err.message
    needed = int(re.search(r"the program needs ([\d,]+) bytes", text).group(1).replace(",", ""))
    assert needed > 1024 * 1024 * 4  # at least fc.weight
    assert "Out of memory on IPU 0" in text
    assert "has 2,555,904 bytes" in text and "4 tiles × 624 KiB" in text
    assert "Largest consumers: weights" in text and "fc.weight (weights, 4.2 MB)" in text
    assert "more IPUs" in text
    assert not model.isCompiled()
    # the same model fits on a full-size IPU
    monkeypatch.delenv("POPTORCH_SMALL_IPU_MODEL")
    assert model(torch.randn(4, 1024)).shape == (4, 10)


def test_small_ipu_model_training_error_names_the_options_that_help(monkeypatch):
    monkeypatch.setenv("POPTORCH_SMALL_IPU_MODEL", "1")
    model = Classifier(512)
    opts = quiet().ipuModelStrictMemory(True)
    opts.Training.gradientAccumulation(2)
    training = poptorch.trainingModel(model, opts, poptorch.optim.Adam(model.parameters()))
    with pytest.raises(poptorch.Error, match="Out of memory on IPU 0") as info:
        training(torch.randn(64, 512), torch.randint(0, 10, (64,)))
    text = info.value.message
    for fix in ("more IPUs", "recomputation", "useOnChipStorage(False)",
                "a smaller micro-batch (now 32)"):
        assert fix in text
    assert "optimizer state" in text and "gradient accumulators" in text
    # a tiny model still fits on the 4-tile IPU
    tiny = poptorch.inferenceModel(nn.Linear(2, 2), quiet().ipuModelStrictMemory(True))
    assert tiny(torch.ones(1, 2)).shape == (1, 2)


def test_small_ipu_model_runs_a_program_that_does_not_fit(monkeypatch, poptorch_logs):
    """Poplar's IPU Model reports a program that exceeds its memory and still runs it
    (issue 21): upstream-style tests on the 4-tile IPU Model compile and run."""
    monkeypatch.setenv("POPTORCH_SMALL_IPU_MODEL", "1")
    torch.manual_seed(0)
    model = poptorch_style_net()
    reference = poptorch_style_net()
    reference.load_state_dict(model.state_dict())
    opts = quiet().outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(2)
    training = poptorch.trainingModel(model, opts,
                                      poptorch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 784), torch.randint(0, 10, (8,))
    out, loss = training(x, y)
    # it ran: same loss as PyTorch on the same weights, and the weights changed
    expected = float(nn.functional.cross_entropy(reference(x), y).detach())
    assert loss.shape == (2,)
    assert float(loss.detach().mean()) == pytest.approx(expected, rel=1e-5)
    assert not torch.equal(model.fc1.weight, reference.fc1.weight)
    estimate = training.ipuModelEstimate()
    assert estimate["fits"] is False and estimate["memory"][0]["fits"] is False
    m = estimate["memory"][0]
    warnings = [r.getMessage() for r in poptorch_logs.records
                if r.levelno == logging.WARNING and "does not fit" in r.getMessage()]
    assert len(warnings) == 1
    text = warnings[0]
    assert f"Out of memory on IPU 0: the program needs {m['total']:,} bytes" in text
    assert f"has {m['capacity']:,} bytes" in text and "Largest consumers: " in text
    assert "ipuModelStrictMemory(True)" in text
    assert "POPTORCH_IPU_MODEL_STRICT_MEMORY=1" in text
    inference = poptorch.inferenceModel(poptorch_style_net(), quiet())
    assert inference(torch.randn(4, 784)).shape == (4, 10)


def test_strict_memory_option_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("POPTORCH_SMALL_IPU_MODEL", "1")
    monkeypatch.setenv("POPTORCH_IPU_MODEL_STRICT_MEMORY", "1")
    lenient = poptorch.inferenceModel(Classifier(), quiet().ipuModelStrictMemory(False))
    assert lenient(torch.randn(4, 1024)).shape == (4, 10)
    with pytest.raises(AssertionError, match="ipuModelStrictMemory"):
        poptorch.Options().ipuModelStrictMemory(1)


def test_cycle_count_and_estimated_throughput(poptorch_logs):
    opts = quiet().logCycleCount(True).deviceIterations(2)
    model = poptorch.inferenceModel(Classifier(64), opts)
    with pytest.raises(poptorch.Error, match="Please run the model at least once"):
        model.cycleCount()
    model(torch.randn(8 * 2, 64))
    estimate = model.ipuModelEstimate()
    cycles = model.cycleCount()
    assert cycles == estimate["cycles"]["run"] > 0
    # deviceIterations micro-batches of 8 samples in `cycles` cycles at 1.33 GHz
    assert model.estimatedThroughput() == pytest.approx(8 * 2 / (cycles / 1.33e9), rel=1e-3)
    assert any("samples/s" in r.getMessage() and "IPU Model estimate" in r.getMessage()
               for r in poptorch_logs.records if r.levelno == logging.INFO)
    more = poptorch.inferenceModel(Classifier(64), quiet().logCycleCount(True)
                                   .deviceIterations(4))
    more(torch.randn(8 * 4, 64))
    assert more.cycleCount() > cycles
    bow = poptorch.inferenceModel(Classifier(64), quiet().deviceIterations(2))
    os.environ["POPTORCH_IPU_MODEL_VERSION"] = "ipu21"
    try:
        bow(torch.randn(8 * 2, 64))
    finally:
        del os.environ["POPTORCH_IPU_MODEL_VERSION"]
    assert bow.ipuModelEstimate()["target"]["name"] == "ipu21"
    assert bow.estimatedThroughput() > model.estimatedThroughput()


def test_training_cycle_count_covers_every_weight_update():
    model = Classifier(64)
    opts = quiet().logCycleCount(True).deviceIterations(3)
    opts.Training.gradientAccumulation(4)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    with pytest.raises(poptorch.Error, match="Cycle count logging is disabled"):
        poptorch.inferenceModel(Classifier(64)).cycleCount()
    training(torch.randn(2 * 4 * 3, 64), torch.randint(0, 10, (2 * 4 * 3,)))
    c = training.ipuModelEstimate()["cycles"]
    assert training.cycleCount() == c["run"]
    # each device iteration: pipeline, weight update and its host synchronisation
    # (docs/ipu-model-estimates.md, "Host time per call"); figures are rounded down
    sync = STEP_SYNC_SECONDS * training.ipuModelEstimate()["target"]["clock_hz"]
    assert c["run"] == pytest.approx(3 * (c["pipeline"] + c["weight_update"] + sync), abs=6)


def test_host_loop_throughput_counts_the_host_copies_of_every_replica():
    # the IPU Model's loop view of a call (docs/ipu-model-estimates.md, "Host time per
    # call"): 2 replicas of one process, inputs copied on one host thread at
    # HOST_COPY_BYTES_PER_S, the second replica's step syncs on that thread too
    opts = quiet().deviceIterations(50).replicationFactor(2)
    model = poptorch.inferenceModel(Classifier(4096), opts)
    model(torch.randn(8 * 50 * 2, 4096))
    host = model.ipuModelEstimate()["host"]
    assert host["settings"]["replicas"] == 2 and host["settings"]["host_processes"] == 1
    assert host["sync"] == pytest.approx(50 * STEP_SYNC_SECONDS)
    step = 2 * host["settings"]["input_bytes"] / HOST_COPY_BYTES_PER_S
    assert host["settings"]["input_bytes"] == 8 * 4096 * 4
    device_step = host["device"] / 50
    assert host["inputs"] == pytest.approx(step + 49 * max(0.0, step - device_step))
    assert model.estimatedThroughput(host_loop=True) == pytest.approx(
        800 / host["seconds_per_call"], rel=1e-3)
    assert model.estimatedThroughput(host_loop=True) < model.estimatedThroughput()


def read_report(directory):
    with open(os.path.join(directory, "profile.json"), encoding="utf-8") as f:
        return json.load(f)


def test_enable_profiling_writes_the_report(tmp_path):
    opts = quiet().enableProfiling(str(tmp_path)).modelName("classifier")
    model = poptorch.inferenceModel(Classifier(64), opts)
    model(torch.randn(8, 64))
    directory = tmp_path / "classifier"
    report = read_report(directory)
    assert report["format"] == "poptorch-ipu-model-profile/1"
    assert report["model_name"] == "classifier" and report["training"] is False
    # the estimate's figures, and the options PopTorch's compiler set by itself
    assert report["implicit_defaults"]["enablePipelining"] == "false"
    assert report == json.loads(json.dumps({**model.ipuModelEstimate(),
                                            "format": report["format"],
                                            "model_name": "classifier",
                                            "training": False,
                                            "implicit_defaults":
                                                report["implicit_defaults"]}))
    assert (directory / "profile.pop").read_text() == (directory / "profile.json").read_text()
    page = (directory / "profile.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_poplar_engine_options_write_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_ENGINE_OPTIONS", json.dumps(
        {"autoReport.all": "true", "autoReport.directory": str(tmp_path)}))
    model = Classifier(64)
    opts = quiet()
    opts.Training.gradientAccumulation(2)
    training = poptorch.trainingModel(model, opts, poptorch.optim.Adam(model.parameters()))
    training(torch.randn(4, 64), torch.randint(0, 10, (4,)))
    report = read_report(tmp_path / "training")
    assert report["training"] is True
    categories = report["memory"][0]["categories"]
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert categories["weights"] == weights
    assert categories["optimizer state"] == 2 * weights
    assert categories["gradient accumulators"] == weights


def test_profiling_allows_out_of_memory(tmp_path, monkeypatch, poptorch_logs):
    monkeypatch.setenv("POPTORCH_SMALL_IPU_MODEL", "1")
    opts = quiet().enableProfiling(str(tmp_path)).ipuModelStrictMemory(True)
    model = poptorch.inferenceModel(Classifier(), opts)
    # debug.allowOutOfMemory (set by enableProfiling) wins over the strict mode
    assert model(torch.randn(4, 1024)).shape == (4, 10)
    report = read_report(tmp_path / "inference")
    assert report["fits"] is False and report["memory"][0]["fits"] is False
    assert report["target"]["tiles"] == 4
    assert any("does not fit" in r.getMessage() for r in poptorch_logs.records)
    assert "does not fit" in (tmp_path / "inference" / "profile.html").read_text()


def chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("chromium is required in CI (.ci/run installs it)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


def render(page, tmp_path, *extra):
    profile = tmp_path / "chromium-profile"
    result = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", *extra, page.as_uri()],
        capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.slow
def test_profile_page_renders_in_headless_chromium(tmp_path):
    stages = [nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)]
    model = nn.Sequential(*stages)
    opts = quiet().enableProfiling(str(tmp_path)).modelName("mlp").deviceIterations(4)
    inference = poptorch.inferenceModel(model, opts)
    inference(torch.randn(4 * 8, 64))
    directory = tmp_path / "mlp"
    report = read_report(directory)
    dom = render(directory / "profile.html", tmp_path, "--dump-dom")
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
    c = report["cycles"]
    assert f"{c['run']:,}" in text
    assert f"{c['samples_per_second']:,.1f}" in text
    for m in report["memory"]:
        assert f"IPU {m['ipu']}" in text
        assert f"total {m['total']:,} bytes of {m['capacity']:,} bytes" in text
        for value in m["categories"].values():
            assert f"{value:,}" in text
        for tensor in m["largest"]:
            assert tensor["name"] in text and f"{tensor['bytes']:,}" in text
    for stage in c["stages"]:
        assert stage["name"] in text and f"{stage['cycles']:,}" in text
    # one rectangle per stage and micro-batch; two (forward and backward) for a stage
    # that does both
    assert dom.count("<rect") == sum(
        1 + (0 < w["forward_cycles"] < w["cycles"]) for p in c["schedule"]
        for w in p["work"])
    shot = tmp_path / "shot.png"
    render(directory / "profile.html", tmp_path, f"--screenshot={shot}",
           "--window-size=1100,900", "--hide-scrollbars")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def estimate_of(opts, model=None, training=False, batch=16):
    model = model or Classifier(512)
    if training:
        wrapper = poptorch.trainingModel(model, opts, poptorch.optim.Adam(model.parameters()))
    else:
        wrapper = poptorch.inferenceModel(model, opts)
    n = batch * opts.device_iterations * opts.Training.gradient_accumulation
    wrapper.compile(torch.randn(n, 512), torch.randint(0, 10, (n,))) if training else \
        wrapper.compile(torch.randn(n, 512))
    return wrapper.ipuModelEstimate()


def test_options_change_the_estimate():
    base = estimate_of(quiet())["memory"][0]["categories"]
    capped = estimate_of(quiet().setAvailableMemoryProportion({"IPU0": 0.001}))
    # the proportion caps the temporaries of every tile the product uses
    assert 0 < capped["memory"][0]["categories"]["temporaries"] <= \
        0.001 * capped["target"]["memory_per_ipu"]
    assert capped["memory"][0]["categories"]["temporaries"] < base["temporaries"]
    assert capped["cycles"]["run"] > estimate_of(quiet())["cycles"]["run"]

    def training(opts):
        opts.Training.gradientAccumulation(2)
        return estimate_of(opts, training=True)["memory"][0]

    on_chip = training(quiet())
    opts = quiet()
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(False))
    off = training(opts)
    assert off["off_chip"] == on_chip["categories"]["optimizer state"] > 0
    assert off["categories"]["optimizer state"] < on_chip["categories"]["optimizer state"]
    # on one IPU recomputation is on only when asked for (ResNet-50's way: RecomputeAll
    # with explicit recomputation); PopTorch turns it on by itself for a pipeline
    opts = quiet()
    opts._Popart.set("autoRecomputation", 4)
    opts._Popart.set("explicitRecomputation", True)
    recomputed = training(opts)
    assert recomputed["categories"]["activations"] < on_chip["categories"]["activations"]


def test_offline_target_version_selects_the_target():
    opts = quiet().useOfflineIpuTarget(21)
    assert estimate_of(opts)["target"]["name"] == "ipu21"
    assert estimate_of(quiet().useOfflineIpuTarget(1))["target"]["tiles"] == 1216


class Blocks(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x, labels):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x, nn.functional.cross_entropy(x, labels)


def test_estimate_follows_the_block_placement():
    model = Blocks()
    for i, layer in enumerate(model.layers):
        poptorch.BeginBlock(layer, f"b{i}", ipu_id=i // 2)
    opts = quiet()
    opts.Training.gradientAccumulation(8)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    training.compile(torch.randn(8 * 4, 256), torch.randint(0, 10, (8 * 4,)))
    estimate = training.ipuModelEstimate()
    assert [m["ipu"] for m in estimate["memory"]] == [0, 1]
    layer = (256 * 256 + 256) * 4
    for m in estimate["memory"]:
        assert m["categories"]["weights"] == 2 * layer
        assert m["categories"]["gradient accumulators"] == 2 * layer
    # forward stage 0 of 2 keeps 3 micro-batches in flight, the last stage one
    first, last = (m["categories"] for m in estimate["memory"])
    assert first["pipeline stash"] == 2 * first["activations"]
    assert last["pipeline stash"] == 0
    stages = [s["name"] for s in estimate["cycles"]["stages"]]
    assert stages == ["forward 0 (IPU 0)", "forward+backward 1 (IPU 1)", "backward 0 (IPU 0)"]
    assert 0 < estimate["cycles"]["pipeline_efficiency"] < 1


def test_profile_report_draws_a_merged_stage_in_both_colours(tmp_path):
    model = Blocks()
    for i, layer in enumerate(model.layers):
        poptorch.BeginBlock(layer, f"b{i}", ipu_id=i // 2)
    opts = quiet().enableProfiling(str(tmp_path))
    opts.Training.gradientAccumulation(4)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    training.compile(torch.randn(8 * 4, 256), torch.randint(0, 10, (8 * 4,)))
    report = read_report(tmp_path / "training")
    merged = next(s for s in report["cycles"]["stages"]
                  if s["name"] == "forward+backward 1 (IPU 1)")
    assert 0 < merged["forward_cycles"] < merged["cycles"]
    page = (tmp_path / "training" / "profile.html").read_text()
    rects = re.findall(r'<rect [^>]*fill="(#[0-9a-f]+)"[^>]*><title>([^<]*)</title>', page)
    colours = {fill for fill, title in rects if "forward+backward 1 (IPU 1)" in title}
    assert colours == {"#59a14f", "#e15759"}  # green forward, red backward
    assert {fill for fill, title in rects if title.startswith("forward 0")} == {"#59a14f"}
    assert {fill for fill, title in rects if title.startswith("backward 0")} == {"#e15759"}


class Steered(nn.Module):
    def __init__(self, checkpoint=False, proportion=None, factor=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(512, 512))
        self.checkpoint, self.proportion, self.factor = checkpoint, proportion, factor

    def forward(self, x, labels):
        for _ in range(3):
            if self.factor:
                x = poptorch.serializedMatMul(x, self.w,
                                              poptorch.MatMulSerializationMode.OutputChannels,
                                              self.factor)
            else:
                x = x @ self.w
            if self.proportion is not None:
                x = poptorch.set_available_memory(x, self.proportion)
            x = torch.relu(x)
            if self.checkpoint:
                x = poptorch.recomputationCheckpoint(x)
        return x, nn.functional.cross_entropy(x, labels)


def steered(recompute=False, **kwargs):
    model = Steered(**kwargs)
    opts = quiet()
    if recompute:  # checkpoints count only with recomputation on (one IPU: asked for)
        opts._Popart.set("autoRecomputation", 4)
        opts._Popart.set("explicitRecomputation", True)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(),
                                                                      lr=0.1))
    training.compile(torch.randn(64, 512), torch.randint(0, 10, (64,)))
    return training.ipuModelEstimate()["memory"][0]["categories"]


def test_poptorch_steering_ops_change_the_estimate():
    base = steered()
    assert steered(checkpoint=True, recompute=True)["activations"] < base["activations"]
    # PopART ignores checkpoints when recomputation is off
    assert steered(checkpoint=True)["activations"] == base["activations"]
    capped = steered(proportion=0.0001)
    assert capped["temporaries"] < base["temporaries"]
    assert steered(factor=4)["temporaries"] < base["temporaries"]


@pytest.mark.parametrize("name", ["../escaped", "a/b", ".."])
def test_model_name_with_a_path_cannot_move_the_report(tmp_path, name):
    """A fresh user's finding: modelName("../escaped") wrote the report outside the
    report directory."""
    opts = quiet().enableProfiling(str(tmp_path / "reports")).modelName(name)
    model = poptorch.inferenceModel(Classifier(64), opts)
    with pytest.raises(poptorch.Error, match="plain name without path separators"):
        model(torch.randn(8, 64))
    assert not (tmp_path / "escaped").exists()


# -- cycle counts and the profile report's directory -----------------------------------

def test_cycle_count_is_the_ipu_model_estimate():
    # Beyond PopTorch (whose IPU Model refuses logCycleCount): the estimate of the run.
    opts = poptorch.Options().logCycleCount(True)
    model = poptorch.inferenceModel(SingleLinear(), opts)
    model.compile(torch.randn(1, 6))
    with pytest.raises(poptorch.Error, match="run the model at least once"):
        model.cycleCount()
    model(torch.randn(1, 6))
    assert model.cycleCount() == model.ipuModelEstimate()["cycles"]["run"] > 0
    model = poptorch.inferenceModel(SingleLinear())
    with pytest.raises(poptorch.Error, match="Cycle count logging is disabled"):
        model.cycleCount()


def test_profile_report_directory_is_a_file_raises_poptorch_error(tmp_path):
    """enableProfiling pointing at a file: a poptorch.Error naming the directory, not a
    bare NotADirectoryError, and the model can be compiled again once fixed."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    model = torch.nn.Linear(4, 2)
    opts = poptorch.Options()
    opts.enableProfiling(str(blocker))
    ipu = poptorch.inferenceModel(model, opts)
    x = torch.randn(2, 4)
    with pytest.raises(poptorch.Error, match="Cannot write the profile report to"):
        ipu(x)
    good = poptorch.Options()
    good.enableProfiling(str(tmp_path / "reports"))
    out = poptorch.inferenceModel(model, good)(x)
    assert torch.allclose(out, model(x))
    assert (tmp_path / "reports" / "inference" / "profile.json").is_file()
