"""Issue 29, item 1: the executable cache never serves another model's program. Three
processes (variant a fills the cache, b has other non-tensor state, a again) run the
cases of ``cache_key_worker.py``; every output is compared with plain PyTorch in the
same process. A value the key records gives its own entry (b captures, the second a
loads); one it cannot record turns the cache off with one INFO line naming it."""
import json
import os
import subprocess
import sys

import pytest
import torch

import poptorch

_WORKER = os.path.join(os.path.dirname(__file__), "cache_key_worker.py")

#: Cases whose state the key records: cached, one entry per variant.
KEYED = ["dict", "function", "lambda", "partial", "tensor_in_list", "global_float"]
#: Cases the key cannot record, and what the INFO line says.
UNKEYABLE = {
    "namespace": "Namespace.cfg holds a types.SimpleNamespace object",
    "module_in_dict": "ModuleInDict.parts['lin'] holds a torch.nn.Module (Linear) that is "
                      "not a registered sub-module",
    "global_namespace": "the global CONFIG read by GlobalNamespace.forward holds a "
                        "types.SimpleNamespace object",
}


def _run(tmp_path, variant, name):
    result = tmp_path / f"{name}.json"
    env = {**os.environ, "POPTORCH_LOG_LEVEL": "ERR"}
    env.pop("POPTORCH_CACHE_DIR", None)
    done = subprocess.run([sys.executable, _WORKER, str(tmp_path / "cache"), variant,
                           str(result)], env=env, timeout=600, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cache_key")
    return [_run(tmp_path, v, f"{v}{i}") for i, v in enumerate("aba")], tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("case", KEYED + sorted(UNKEYABLE))
def test_other_state_never_gets_the_cached_program(runs, case):
    results, tmp_path = runs
    for run in results:
        got = torch.tensor(run[case]["out"])
        torch.testing.assert_close(got, torch.tensor(run[case]["expected"]))
    first, other, again = (r[case] for r in results)
    assert torch.tensor(first["out"]).ne(torch.tensor(other["out"])).any()
    assert first["captures"] == other["captures"] == 1
    entries = [f for f in os.listdir(tmp_path / "cache" / case)
               if f.endswith(".poptorch")] if (tmp_path / "cache" / case).exists() else []
    if case in KEYED:
        assert again["captures"] == 0  # variant a's entry is used again
        assert any("Loaded the executable from the cache" in m for m in again["log"])
        assert len(entries) == 2
    else:
        assert again["captures"] == 1 and entries == []
        for run in (first, other, again):
            lines = [m for m in run["log"] if m.startswith("Executable cache not used")]
            assert len(lines) == 1 and UNKEYABLE[case] in lines[0], run["log"]


# -- in one process: what the key records, what turns the cache off ----------------------

def _key(model):
    from poptorch._files import cache_key
    try:
        return cache_key.model_description(model)["code"], None
    except Exception as exc:  # noqa: BLE001 - the Unkeyable the test looks at
        return None, exc


class _Holder(torch.nn.Module):
    def __init__(self, value):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.value = value

    def forward(self, x):
        return self.fc(x)


class _Config:
    scale = 2.0


@pytest.mark.parametrize("value, keyable", [
    ({"a": [1, 2.0, "s", None, (True, b"x")]}, True),
    (torch.float16, True), (torch.Size([2, 3]), True), (torch.device("cpu"), True),
    (poptorch.OutputMode.All, True), (torch.nn.functional.gelu, True), (torch.relu, True),
    (torch.no_grad(), True), (frozenset({1, 2}), True), (range(3), True),
    (_Config(), False), (sys.modules[__name__], False), (object(), False),
    (torch.empty(2, device="meta"), False), (torch.ones(2).to_sparse(), False),
    ([torch.nn.ReLU()], False), (poptorch.CPU(lambda t: t, "Id"), False),
    (lambda t, _cell=object(): t, False),
])
def test_which_attribute_values_the_key_records(value, keyable):
    from poptorch._files.cache_values import Unkeyable
    digest, error = _key(_Holder(value))
    if keyable:
        assert error is None and digest is not None
    else:
        assert isinstance(error, Unkeyable), error
        assert error.where.startswith("_Holder.value") or \
            error.where.startswith("the defaults of") and "<lambda>" in error.where


def test_equal_values_give_equal_keys_and_different_ones_differ():
    from poptorch._files.cache_key import model_description
    torch.manual_seed(0)
    one = model_description(_Holder({"s": 2.0}))
    torch.manual_seed(1)  # other weights: the key records their shapes only
    assert model_description(_Holder({"s": 2.0})) == one
    assert model_description(_Holder({"s": 2})) != one  # an int is not a float
    assert model_description(_Holder({"s": 3.0})) != one


def test_a_no_grad_forward_and_a_registered_sub_module_reference_are_cached(
        tmp_path, captures):
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.lookup = {"fc": self.fc}  # a registered sub-module: keyed by its path

        @torch.no_grad()
        def forward(self, x):
            return self.lookup["fc"](x)

    x = torch.randn(2, 4)
    for _ in range(2):
        model = Net().eval()
        opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
        torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x), model(x))
    assert len(captures) == 1
