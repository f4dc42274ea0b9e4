"""Issue 29, item 1: state outside the model's attributes that ``forward`` reads never
gets another process's program: the environment and files (cache off), torch's process-wide
settings, tied weights and shared sub-modules, library functions the user replaced
(keyed), and a conjugate tensor attribute (keyed, never a failed compile). Three
processes (variant a fills the cache, b has other state, a again) run the cases of
``cache_key_attack_worker.py``; every output is compared with plain PyTorch."""
import json
import os
import subprocess
import sys

import pytest
import torch

import poptorch

_WORKER = os.path.join(os.path.dirname(__file__), "cache_key_attack_worker.py")

#: Cases whose state the key records: one entry per variant.
KEYED = ["default_dtype", "deterministic", "grad_mode", "tied_weights", "shared_module",
         "patched_chained", "patched_direct", "on_library_class", "conjugate",
         "enum_member"]
#: Cases that turn the cache off, and what the INFO line says.
UNKEYABLE = {
    "environ": "the global os read by Environ.forward (os.environ) holds the process "
               "environment",
    "getenv": "the global os read by Getenv.forward (os.getenv) holds the process "
              "environment",
    "helper": "the global ENV read by scaled_by_environment holds the process environment",
    "reads_file": "the global open read by ReadsFile.forward holds a function that reads "
                  "files",
    # the failing inputs of a fresh user's attack: a stale program was served
    "by_globals": "ByGlobals.forward holds code that reads variables by name at run time "
                  "(globals())",
    "by_eval": "ByEval.forward holds code that reads variables by name at run time (eval())",
    "by_frame": "scale_of_the_caller holds code that reads variables by name at run time "
                "(.currentframe)",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cache_key_state")
    env = {**os.environ, "POPTORCH_LOG_LEVEL": "ERR"}
    env.pop("POPTORCH_CACHE_DIR", None)
    results = []
    for i, variant in enumerate("aba"):
        result = tmp_path / f"{variant}{i}.json"
        done = subprocess.run([sys.executable, _WORKER, str(tmp_path / "cache"), variant,
                               str(result)], env=env, timeout=600, capture_output=True,
                              text=True, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(result.read_text()))
    return results, tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("case", KEYED + sorted(UNKEYABLE))
def test_state_outside_the_model_never_gets_the_cached_program(runs, case):
    results, tmp_path = runs
    for run in results:
        torch.testing.assert_close(torch.tensor(run[case]["out"]),
                                   torch.tensor(run[case]["expected"]))
    first, other, again = (r[case] for r in results)
    assert torch.tensor(first["out"]).ne(torch.tensor(other["out"])).any()
    assert first["captures"] == other["captures"] == 1
    folder = tmp_path / "cache" / case
    entries = [f for f in os.listdir(folder) if f.endswith(".poptorch")] \
        if folder.exists() else []
    if case in KEYED:
        assert again["captures"] == 0, again["log"]
        assert any("Loaded the executable from the cache" in m for m in again["log"])
        assert len(entries) == 2
    else:
        assert again["captures"] == 1 and entries == []
        for run in (first, other, again):
            lines = [m for m in run["log"] if m.startswith("Executable cache not used")]
            assert len(lines) == 1 and UNKEYABLE[case] in lines[0], run["log"]


def test_an_entry_is_not_used_under_autocast(tmp_path):
    """Autocast is part of the key: a bfloat16 autocast call in another process is
    refused as it is without the cache, never served the float32 entry."""
    code = ("import sys, torch, poptorch\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()\n"
            "x = torch.ones(2, 4)\n"
            "opts = poptorch.Options().enableExecutableCaching(sys.argv[1])\n"
            "ctx = torch.autocast('cpu', dtype=torch.bfloat16) if sys.argv[2] == 'on' \\\n"
            "    else torch.no_grad()\n"
            "with ctx:\n"
            "    try:\n"
            "        poptorch.inferenceModel(model, opts)(x)\n"
            "    except poptorch.Error as exc:\n"
            "        assert 'inside torch.autocast' in exc.message, exc.message\n"
            "        sys.exit(3)\n")
    env = {**os.environ, "POPTORCH_LOG_LEVEL": "ERR"}
    env.pop("POPTORCH_CACHE_DIR", None)
    codes = [subprocess.run([sys.executable, "-c", code, str(tmp_path), mode], env=env,
                            timeout=600, capture_output=True, check=False).returncode
             for mode in ("off", "on")]
    assert codes == [0, 3], codes


class _UserConfig:
    def __init__(self, scale):
        self.scale = scale


class _ReadsLinearConfig(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * self.cfg.scale


def test_a_user_object_put_on_a_library_class_turns_the_cache_off(monkeypatch):
    """``torch.nn.Linear.cfg = <user object>``, read as ``self.cfg``: the key cannot
    record it, so the model is not cached (it was left out of the key before)."""
    from poptorch._files.cache_key import model_description
    from poptorch._files.cache_values import Unkeyable
    monkeypatch.setattr(torch.nn.Linear, "cfg", _UserConfig(2.0), raising=False)
    with pytest.raises(Unkeyable, match="Linear.cfg holds a .*_UserConfig object"):
        model_description(_ReadsLinearConfig(4, 4))
