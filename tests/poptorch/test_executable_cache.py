"""Executable caching (docs/semantics.md S-61, S-28): ``enableExecutableCaching`` /
``POPTORCH_CACHE_DIR`` skip capture and compilation in later processes, key on
everything that changes the program, use the current host weights, and survive
concurrent fills, killed writers and corrupted entries."""
import glob
import json
import os
import subprocess
import sys
import textwrap
import time

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
    """docs/semantics.md S-28: two processes filling the same entry at once capture once (the other
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
from poptorch._files import container
def dying_write(stream, blobs):
    stream.write(b"PK partial data")
    stream.flush()
    os.kill(os.getpid(), signal.SIGKILL)
container._write_blobs = dying_write
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
    """docs/semantics.md S-28: the process id is not part of the key, so every process of a run
    (here
    simulated in one process: inference needs no process group) uses one entry."""
    x = torch.randn(4, 6)
    for process in (0, 1):
        opts = cached(tmp_path)
        opts.Distributed.configureProcessId(process, 2)
        poptorch.inferenceModel(Mlp().eval(), opts).compile(x)
    assert len(captures) == 1 and len(entries(tmp_path)) == 1


# -- issue 19: bad entries, held locks, models without a source file ---------------------

def _rewrite_entry(entry, blob, edit):
    """Change ``blob`` (JSON) of a cache entry; checksums recomputed."""
    from poptorch._files import container as _serialization
    blobs = _serialization.read_container(str(entry))
    doc = json.loads(blobs[blob])
    doc = edit(doc) or doc
    blobs[blob] = json.dumps(doc).encode()
    _serialization.write_container(str(entry), blobs)


def test_a_wrong_entry_with_valid_checksums_is_discarded_and_rebuilt(tmp_path, captures,
                                                                      poptorch_logs):
    """Item 4: an entry whose checksums match but whose structure lacks ``state`` made
    every later compile fail with ``KeyError: 'state'``; now one warning, the entry is
    rebuilt and the next compile loads it."""
    x = torch.randn(4, 6)
    model = Mlp().eval()
    poptorch.inferenceModel(model, cached(tmp_path))(x)
    (entry,) = entries(tmp_path)
    _rewrite_entry(entry, "structure.json", lambda d: d.pop("state") and None)
    out = poptorch.inferenceModel(model, cached(tmp_path))(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    warnings = [r for r in poptorch_logs.records
                if "Discarding the unusable executable cache entry" in r.getMessage()]
    assert len(warnings) == 1 and "'state' is missing" in warnings[0].getMessage()
    assert len(captures) == 2
    poptorch.inferenceModel(model, cached(tmp_path))(x)  # the rebuilt entry is used
    assert len(captures) == 2


def test_an_entry_of_another_model_is_discarded(tmp_path, captures, poptorch_logs):
    """A well-formed entry holding another model's program (other weight shapes),
    placed under this model's key, is not used (issue 29, item 2: the entry records the
    key it was written for)."""
    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(6, 16)
            self.fc2 = torch.nn.Linear(16, 4)
            self.drop = torch.nn.Dropout(0.0)

        def forward(self, x, t=None):
            return self.fc2(self.fc1(x))

    x = torch.randn(4, 6)
    poptorch.inferenceModel(Wide().eval(), cached(tmp_path / "wide"))(x)
    model = Mlp().eval()
    poptorch.inferenceModel(model, cached(tmp_path / "mlp"))(x)
    (wide,), (mine,) = entries(tmp_path / "wide"), entries(tmp_path / "mlp")
    os.replace(wide, mine)
    out = poptorch.inferenceModel(model, cached(tmp_path / "mlp"))(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert f"Invalid file {mine}: it was written for the key" in poptorch_logs.text
    assert len(captures) == 3


_HOLD_LOCK = '''
import os, pathlib, signal, sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1])
lock.acquire()
pathlib.Path(sys.argv[2]).touch()
if sys.argv[3] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(600)
'''


def _emptied_entry(tmp_path, model, x):
    """Fill the cache in ``tmp_path`` for ``model`` and delete the entry: its path."""
    poptorch.inferenceModel(model, cached(tmp_path))(x)
    (entry,) = entries(tmp_path)
    os.unlink(entry)
    return entry


def _hold_lock(tmp_path, lock_path, mode):
    """A process that holds ``lock_path`` (``mode="hold"``: until killed; ``"die"``:
    killed with the lock held). Returns it once it holds the lock."""
    ready = tmp_path / f"ready-{mode}"
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(lock_path),
                             str(ready), mode])
    deadline = time.monotonic() + 120  # bounded wait for the child to start
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), "the lock-holding process did not start"
    return proc


def test_a_held_lock_is_waited_for_a_bounded_time(tmp_path, captures, poptorch_logs,
                                                  monkeypatch):
    """Item 5: another process holds the entry's lock (stuck while compiling): this
    process waits POPTORCH_CACHE_LOCK_TIMEOUT seconds, says which entry it waits for,
    then compiles without the cache (warning) and does not write the entry."""
    x = torch.randn(4, 6)
    model = Mlp().eval()
    entry = _emptied_entry(tmp_path, model, x)
    holder = _hold_lock(tmp_path, entry + ".lock", "hold")
    try:
        monkeypatch.setenv("POPTORCH_CACHE_LOCK_TIMEOUT", "0.2")
        poptorch.setLogLevel("INFO")
        out = poptorch.inferenceModel(model, cached(tmp_path))(x)
    finally:
        holder.kill()
        holder.wait()
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert len(captures) == 2
    assert f"holds the lock of the executable cache entry {entry}" in poptorch_logs.text
    assert f"The executable cache entry {entry} stayed locked by another process " \
        "for 0 s (POPTORCH_CACHE_LOCK_TIMEOUT): compiling without the cache." \
        in poptorch_logs.text
    assert entries(tmp_path) == []


def test_the_lock_of_a_dead_process_is_taken_over(tmp_path, captures, poptorch_logs,
                                                  monkeypatch):
    """Item 5: a process killed while holding the lock leaves no stale lock: with a
    timeout of 0 (no waiting at all) the next process still takes the lock and fills
    the entry."""
    x = torch.randn(4, 6)
    model = Mlp().eval()
    entry = _emptied_entry(tmp_path, model, x)
    holder = _hold_lock(tmp_path, entry + ".lock", "die")
    assert holder.wait() == -9
    monkeypatch.setenv("POPTORCH_CACHE_LOCK_TIMEOUT", "0")
    poptorch.inferenceModel(model, cached(tmp_path))(x)
    assert "stayed locked" not in poptorch_logs.text
    assert entries(tmp_path) == [entry]


def test_lock_timeout_from_the_environment(monkeypatch):
    from poptorch._files import cache as _executable_cache
    monkeypatch.delenv("POPTORCH_CACHE_LOCK_TIMEOUT", raising=False)
    assert _executable_cache.lock_timeout() == 300.0
    monkeypatch.setenv("POPTORCH_CACHE_LOCK_TIMEOUT", "2.5")
    assert _executable_cache.lock_timeout() == 2.5
    monkeypatch.setenv("POPTORCH_CACHE_LOCK_TIMEOUT", "-1")
    with pytest.raises(poptorch.Error, match="POPTORCH_CACHE_LOCK_TIMEOUT='-1'"):
        _executable_cache.lock_timeout()


_EXEC_MODEL = '''
def act(x):
    return {act}


class ExecNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        return act(self.fc(x))
'''


def _exec_model(act):
    """A model whose class (and helper) exists only in an ``exec`` namespace: no
    source file, as in a notebook cell."""
    namespace = {"nn": torch.nn, "torch": torch, "__name__": "__main__"}
    exec(textwrap.dedent(_EXEC_MODEL.format(act=act)), namespace)  # noqa: S102
    torch.manual_seed(0)
    return namespace["ExecNet"]().eval()


def test_a_model_defined_with_exec_is_cached(tmp_path, captures):
    """Item 8: the key is computed from byte code, not source files (a class defined
    by ``exec`` raised OSError: source code not available)."""
    x = torch.randn(4, 6)
    for _ in range(2):
        model = _exec_model("torch.relu(x)")
        out = poptorch.inferenceModel(model, cached(tmp_path))(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert len(captures) == 1 and len(entries(tmp_path)) == 1


def test_the_code_key_follows_edits_of_forward_and_of_helpers(tmp_path, captures):
    """Editing the helper ``forward`` calls changes the key: no stale program."""
    x = torch.randn(4, 6)
    for act in ("torch.relu(x)", "torch.sigmoid(x)", "x * 2", "x * 3"):
        model = _exec_model(act)
        out = poptorch.inferenceModel(model, cached(tmp_path))(x)
        torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    assert len(captures) == 4 and len(entries(tmp_path)) == 4


_PYTHON_C = '''
import json, sys, torch, poptorch
calls = []
real = torch.export.export
torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(6, 4)
    def forward(self, x):
        return torch.tanh(self.fc(x))
torch.manual_seed(0)
model = Net().eval()
x = torch.ones(4, 6)
out = poptorch.inferenceModel(model)(x)
assert torch.equal(out, model(x))
print(json.dumps({"captures": len(calls)}))
'''


@pytest.mark.slow
def test_a_model_defined_in_python_c_is_cached(tmp_path):
    """Item 8 with ``python -c`` (a notebook has no source file either)."""
    env = {**os.environ, "POPTORCH_CACHE_DIR": str(tmp_path), "POPTORCH_LOG_LEVEL": "ERR"}
    captures = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _PYTHON_C], env=env, timeout=300,
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        captures.append(json.loads(done.stdout.strip().splitlines()[-1])["captures"])
    assert captures == [1, 0]
    assert len(entries(tmp_path)) == 1


def test_the_code_key_covers_helpers_in_other_files(tmp_path, captures, monkeypatch):
    """A helper module the model calls through a module attribute is part of the key
    (the source-file hash of before only covered the model class's own file)."""
    import importlib
    (tmp_path / "helpers_mod.py").write_text("def act(x):\n    return x * 2\n")
    (tmp_path / "model_mod.py").write_text(textwrap.dedent('''
        import torch
        import helpers_mod

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(6, 4)

            def forward(self, x):
                return helpers_mod.act(self.fc(x))
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import helpers_mod
    import model_mod
    try:
        x = torch.randn(4, 6)
        for factor in (2, 10):  # sources of different sizes: no stale .pyc
            (tmp_path / "helpers_mod.py").write_text(
                f"def act(x):\n    return x * {factor}\n")
            importlib.reload(helpers_mod)
            model = model_mod.Net().eval()
            out = poptorch.inferenceModel(model, cached(tmp_path / "cache"))(x)
            torch.testing.assert_close(out, model.fc(x) * factor)
        assert len(captures) == 2 and len(entries(tmp_path / "cache")) == 2
    finally:
        sys.modules.pop("helpers_mod", None)
        sys.modules.pop("model_mod", None)


def test_an_entry_renamed_to_another_key_is_rebuilt_with_a_warning(tmp_path, captures,
                                                                    poptorch_logs):
    """Issue 29, item 2: an entry of the same model class with other code (here
    ``x * 3`` instead of ``x * 2``: same weights, other program), renamed to this key's
    name, was used silently (wrong outputs). Every entry records its key: a warning
    naming the entry, and it is rebuilt."""
    from poptorch._files.container import read_container
    x = torch.randn(4, 6)
    poptorch.inferenceModel(_exec_model("x * 2"), cached(tmp_path))(x)
    (first,) = entries(tmp_path)
    poptorch.inferenceModel(_exec_model("x * 3"), cached(tmp_path))(x)
    (second,) = [e for e in entries(tmp_path) if e != first]
    os.replace(second, first)  # the x * 3 program under the x * 2 key's name
    model = _exec_model("x * 2")
    out = poptorch.inferenceModel(model, cached(tmp_path))(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    warnings = [r.getMessage() for r in poptorch_logs.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert f"Invalid file {first}: it was written for the key" in warnings[0]
    assert "it is rebuilt" in warnings[0]
    assert len(captures) == 3
    meta = json.loads(read_container(first)["metadata.json"])
    assert meta["key"] == os.path.basename(first)[:-len(".poptorch")]
