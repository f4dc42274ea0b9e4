"""Executable caching (spec S-61, S-28): ``enableExecutableCaching`` /
``POPTORCH_CACHE_DIR`` skip capture and compilation in later processes, key on
everything that changes the program, use the current host weights, and survive
concurrent fills, killed writers and corrupted entries."""
import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import poptorch


try:
    from .test_precompilation import Net as Mlp
except ImportError:  # imported by the child processes below, outside the package
    from test_precompilation import Net as Mlp


def entries(directory):
    return sorted(glob.glob(os.path.join(str(directory), "*.poptorch")))


def cached(directory, **setters):
    opts = poptorch.Options().enableExecutableCaching(str(directory))
    for name, args in setters.items():
        getattr(opts, name)(*args)
    return opts


def test_second_wrapper_loads_from_the_cache_and_uses_current_weights(tmp_path, captures):
    x = torch.randn(4, 6)
    model = Mlp().eval()
    first = poptorch.inferenceModel(model, cached(tmp_path))
    torch.testing.assert_close(first(x), model(x), rtol=0, atol=0)
    assert len(captures) == 1 and len(entries(tmp_path)) == 1
    other = Mlp().eval()  # other weights: the cached program holds none
    second = poptorch.inferenceModel(other, cached(tmp_path))
    torch.testing.assert_close(second(x), other(x), rtol=0, atol=0)
    assert len(captures) == 1


def test_the_key_covers_inputs_options_and_model(tmp_path, captures):
    model = Mlp().eval()
    poptorch.inferenceModel(model, cached(tmp_path))(torch.randn(4, 6))
    poptorch.inferenceModel(model, cached(tmp_path))(torch.randn(2, 6))  # shape
    poptorch.inferenceModel(model, cached(tmp_path, deviceIterations=(2,)))(
        torch.randn(4, 6))  # an option
    poptorch.inferenceModel(Mlp(p=0.5).eval(), cached(tmp_path))(
        torch.randn(4, 6))  # a module attribute
    model.train()
    poptorch.inferenceModel(model, cached(tmp_path))(torch.randn(4, 6))  # train mode
    assert len(captures) == 5 and len(entries(tmp_path)) == 5
    poptorch.inferenceModel(Mlp().eval(), cached(tmp_path))(torch.randn(2, 6))
    assert len(captures) == 5


def test_training_from_the_cache_matches_training_without_it(tmp_path, captures):
    x, t = torch.randn(8, 6), torch.randint(0, 4, (8,))
    torch.manual_seed(1)
    reference_model = Mlp(p=0.5)
    state = {k: v.clone() for k, v in reference_model.state_dict().items()}
    reference = poptorch.trainingModel(reference_model, poptorch.Options().randomSeed(2))
    expected = [reference(x, t)[1] for _ in range(3)]
    poptorch.trainingModel(Mlp(p=0.5), cached(tmp_path, randomSeed=(2,)))(x, t)
    assert len(captures) == 2
    model = Mlp(p=0.5)
    model.load_state_dict(state)
    trainer = poptorch.trainingModel(model, cached(tmp_path, randomSeed=(2,)))
    got = [trainer(x, t)[1] for _ in range(3)]
    assert len(captures) == 2
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_a_corrupt_entry_is_ignored_with_a_warning_and_rebuilt(tmp_path, captures,
                                                              poptorch_logs):
    x = torch.randn(4, 6)
    model = Mlp().eval()
    poptorch.inferenceModel(model, cached(tmp_path))(x)
    (entry,) = entries(tmp_path)
    raw = open(entry, "rb").read()
    with open(entry, "wb") as f:
        f.write(raw[: len(raw) // 3])
    out = poptorch.inferenceModel(model, cached(tmp_path))(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert len(captures) == 2
    assert "Discarding the unusable executable cache entry" in poptorch_logs.text
    assert os.path.getsize(entry) == len(raw)  # rebuilt
    poptorch.inferenceModel(model, cached(tmp_path))(x)
    assert len(captures) == 2


def test_caching_from_the_environment(tmp_path, monkeypatch, captures):
    monkeypatch.setenv("POPTORCH_CACHE_DIR", str(tmp_path))
    model = Mlp().eval()
    poptorch.inferenceModel(model)(torch.randn(4, 6))
    poptorch.inferenceModel(model)(torch.randn(4, 6))
    assert len(captures) == 1 and len(entries(tmp_path)) == 1


_CHILD = '''
import json, os, sys, time, torch, poptorch
sys.path.insert(0, {tests!r})
from test_precompilation import Net as Mlp
calls = []
real = torch.export.export
def counting(*args, **kwargs):
    calls.append(1)
    return real(*args, **kwargs)
torch.export.export = counting
{patch}
torch.manual_seed(0)
model = Mlp().eval()
x = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 10
out = poptorch.inferenceModel(model)(x)
json.dump({{"captures": len(calls), "out": out.flatten().tolist(),
           "expected": model(x).flatten().tolist()}}, open({result!r}, "w"))
'''


def run_children(tmp_path, names, patch=""):
    """Start one child process per name at once; return their results."""
    env = {**os.environ, "POPTORCH_CACHE_DIR": str(tmp_path / "cache"),
           "POPTORCH_LOG_LEVEL": "ERR"}
    procs = []
    for name in names:
        script = textwrap.dedent(_CHILD.format(
            tests=os.path.dirname(__file__), patch=patch,
            result=str(tmp_path / f"{name}.json")))
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env,
                                      stderr=subprocess.PIPE))
    codes = [(p.wait(timeout=300), p.stderr.read().decode()[-2000:]) for p in procs]
    results = {}
    for name in names:
        path = tmp_path / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else None
    return codes, results


@pytest.mark.slow
def test_processes_compile_once_and_later_processes_skip_capture(tmp_path):
    """S-28: two processes filling the same entry at once capture once (the other
    waits for the lock and loads the entry); a later process captures nothing."""
    codes, results = run_children(tmp_path, ["a", "b"])
    assert all(code == 0 for code, _ in codes), codes
    assert sorted(r["captures"] for r in results.values()) == [0, 1]
    codes, later = run_children(tmp_path, ["later"])
    assert codes[0][0] == 0, codes[0][1]
    assert later["later"]["captures"] == 0
    for r in list(results.values()) + [later["later"]]:
        assert r["out"] == r["expected"]
    assert len(entries(tmp_path / "cache")) == 1


_KILL_MID_WRITE = '''
import signal
from poptorch import _serialization
def dying_write(stream, blobs):
    stream.write(b"PK partial data")
    stream.flush()
    os.kill(os.getpid(), signal.SIGKILL)
_serialization._write_blobs = dying_write
'''


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path, captures):
    codes, results = run_children(tmp_path, ["killed"], patch=_KILL_MID_WRITE)
    assert codes[0][0] == -9
    assert results["killed"] is None
    assert entries(tmp_path / "cache") == []  # only a stray temporary file at most
    torch.manual_seed(0)
    model = Mlp().eval()
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 10
    opts = poptorch.Options().enableExecutableCaching(str(tmp_path / "cache"))
    torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x), model(x))
    assert len(captures) == 1 and len(entries(tmp_path / "cache")) == 1


def test_the_key_covers_the_backend(tmp_path, captures):
    """Issue 11: the compiler choice is part of the key (compile() only: the Inductor
    backend compiles lazily at the first run, so no Inductor compile happens here)."""
    x = torch.randn(4, 6)
    for compiler in ("eager", "inductor", "eager"):
        opts = cached(tmp_path)
        opts.Backend.compiler(compiler)
        poptorch.inferenceModel(Mlp().eval(), opts).compile(x)
    assert len(captures) == 2 and len(entries(tmp_path)) == 2


def test_processes_of_one_distributed_run_share_one_entry(tmp_path, captures):
    """S-28: the process id is not part of the key, so every process of a run (here
    simulated in one process: inference needs no process group) uses one entry."""
    x = torch.randn(4, 6)
    for process in (0, 1):
        opts = cached(tmp_path)
        opts.Distributed.configureProcessId(process, 2)
        poptorch.inferenceModel(Mlp().eval(), opts).compile(x)
    assert len(captures) == 1 and len(entries(tmp_path)) == 1
