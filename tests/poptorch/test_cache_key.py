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


class _Colour(__import__("enum").Enum):
    RED = 1
    BLUE = 2


class _Reads(torch.nn.Module):
    """``forward`` reads a value stored on a library module and a builtin."""

    def forward(self, x):
        return x * torch.cache_key_test_scale * cache_key_test_builtin


@pytest.mark.parametrize("a, b", [(_Colour.RED, _Colour.BLUE), (1, 1.0), (1, True),
                                  ((1, 2), [1, 2]), (torch.ones(2), torch.ones(2) * 2),
                                  (torch.ones(2), torch.ones(2, dtype=torch.float16))])
def test_values_that_differ_give_different_keys(a, b):
    from poptorch._files.cache_key import model_description
    assert model_description(_Holder(a)) != model_description(_Holder(b))
    assert model_description(_Holder(a)) == model_description(_Holder(a))


def test_values_stored_on_library_modules_and_builtins_are_keyed(monkeypatch):
    import builtins
    from poptorch._files.cache_key import model_description
    from poptorch._files.cache_values import Unkeyable
    monkeypatch.setattr(torch, "cache_key_test_scale", 2.0, raising=False)
    monkeypatch.setattr(builtins, "cache_key_test_builtin", 3.0, raising=False)
    first = model_description(_Reads())
    monkeypatch.setattr(torch, "cache_key_test_scale", 5.0)
    assert model_description(_Reads()) != first
    monkeypatch.setattr(builtins, "cache_key_test_builtin", object())
    with pytest.raises(Unkeyable, match="the global cache_key_test_builtin read by "
                                        "_Reads.forward holds a builtins.object object"):
        model_description(_Reads())


def test_a_bound_method_of_the_model_is_keyed_by_its_path_and_code():
    from poptorch._files.cache_key import model_description

    class Net(torch.nn.Module):
        def __init__(self, factor):
            super().__init__()
            self.factor = factor
            self.act = self.scaled

        def scaled(self, x):
            return x * self.factor

        def forward(self, x):
            return self.act(x)

    assert model_description(Net(2.0)) == model_description(Net(2.0))
    assert model_description(Net(2.0)) != model_description(Net(3.0))


def test_a_transformers_model_is_keyed_by_its_configuration():
    """An installed package's configuration object (a Python class, its whole state a
    plain ``__dict__``) is keyed by value; its class body's own state is the package's."""
    transformers = pytest.importorskip("transformers")
    from poptorch._files.cache_key import model_description

    def bert(eps):
        config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=16,
                                         vocab_size=32, layer_norm_eps=eps)
        torch.manual_seed(0)
        return transformers.BertModel(config)

    assert model_description(bert(1e-12)) == model_description(bert(1e-12))
    assert model_description(bert(1e-12)) != model_description(bert(1e-5))


def test_objects_that_refer_to_each_other_are_bounded():
    """A library object graph with cycles cannot make the key walk without end."""
    import argparse  # a standard-library Python class with a plain __dict__
    from poptorch._files.cache_key import model_description
    from poptorch._files.cache_values import Unkeyable
    nodes = [argparse.Namespace() for _ in range(6)]
    for node in nodes:
        for i, other in enumerate(nodes):
            setattr(node, f"n{i}", other)
    with pytest.raises(Unkeyable):
        model_description(_Holder(nodes[0]))
    assert model_description(_Holder(argparse.Namespace(scale=2.0))) != \
        model_description(_Holder(argparse.Namespace(scale=3.0)))


def test_plain_data_put_on_a_library_base_class_is_keyed(monkeypatch):
    from poptorch._files.cache_key import model_description

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * self.factor

    monkeypatch.setattr(torch.nn.Linear, "factor", 2.0, raising=False)
    first = model_description(Scaled(4, 4))
    monkeypatch.setattr(torch.nn.Linear, "factor", 3.0)
    assert model_description(Scaled(4, 4)) != first
