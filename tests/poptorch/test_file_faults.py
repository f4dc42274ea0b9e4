"""Issue 29, items 3, 5 and 6: programs with ``poptorch.CPU`` host ops are never stored
(``save`` refuses, the cache says so once), a loaded file never chooses where the
loading process writes, hyper-parameters beyond float32 and inputs the program cannot
take are a ``poptorch.Error``."""
import json
import os

import pytest
import torch

import poptorch
from poptorch._files import container

try:
    from .test_precompilation import Net, data
except ImportError:
    from test_precompilation import Net, data


class WithHostOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.double = poptorch.CPU(lambda t: t * 2, "Double")

    def forward(self, x):
        return self.double(self.fc(x)) + 1


class HostOpInForward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return poptorch.CPU(torch.neg, "Negate")(self.fc(x)) * 3


def test_save_refuses_a_program_with_a_host_op(tmp_path):
    model = WithHostOp().eval()
    x = torch.randn(2, 4)
    wrapper = poptorch.inferenceModel(model)
    torch.testing.assert_close(wrapper(x), model(x))
    with pytest.raises(poptorch.Error, match="calls the poptorch.CPU host op.s. 'Double', "
                                             "and a file holds data only"):
        wrapper.save(str(tmp_path / "host.poptorch"))
    assert not os.path.exists(tmp_path / "host.poptorch")
    with pytest.raises(poptorch.Error, match="'Double'"):
        poptorch.inferenceModel(WithHostOp().eval()).compileAndExport(
            str(tmp_path / "host2.poptorch"), x)
    assert not os.path.exists(tmp_path / "host2.poptorch")


def test_the_cache_never_stores_a_host_op_program_and_says_so_once(tmp_path, captures,
                                                                   poptorch_logs):
    poptorch.setLogLevel("INFO")
    x = torch.randn(2, 4)
    for _ in range(3):
        model = HostOpInForward().eval()
        opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
        torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x), model(x))
    assert len(captures) == 3
    assert [f for f in os.listdir(tmp_path) if f.endswith(".poptorch")] == []
    lines = [r.getMessage() for r in poptorch_logs.records
             if "host op" in r.getMessage()]
    assert len(lines) == 1 and "'Negate'" in lines[0], lines
    assert not [r for r in poptorch_logs.records if r.levelname == "WARNING"
                and "cache" in r.getMessage()]
    # a CPU op held as an attribute turns the pre-capture key off (it names the op)
    opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
    model = WithHostOp().eval()
    torch.testing.assert_close(poptorch.inferenceModel(model, opts)(x), model(x))
    assert "WithHostOp.double holds a poptorch.CPU host op" in poptorch_logs.text


def test_a_loaded_file_does_not_choose_where_the_loader_writes(tmp_path, monkeypatch):
    """Item 5: a file saved with enableProfiling(dir), a log directory and a cache
    makes the loading process write nothing there."""
    saver = tmp_path / "saver"
    x, _ = data()
    opts = poptorch.Options().enableProfiling(str(saver / "profile")).modelName("m")
    opts.logDir(str(saver / "logs")).enableExecutableCaching(str(saver / "cache"))
    path = tmp_path / "net.poptorch"
    poptorch.inferenceModel(Net().eval(), opts).compileAndExport(str(path), x)
    before = sorted(str(p) for p in saver.rglob("*"))
    assert any("profile" in p for p in before)  # the saver did write its report
    for p in sorted(saver.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    monkeypatch.chdir(tmp_path)
    loaded = poptorch.load(str(path))
    model = Net().eval()
    assert loaded(x).shape == model(x).shape
    assert not saver.exists() or list(saver.rglob("*")) == []
    stored = loaded.options._Popart.options
    assert "autoReport.directory" not in stored.get("engineOptions", {})
    assert not stored.get("enableEngineCaching", False)
    assert loaded.options.log_dir == "."
    # the loading process's own options still apply
    mine = tmp_path / "mine"
    poptorch.load(str(path), edit_opts_fn=lambda o: o.enableProfiling(str(mine)))(x)
    assert any(mine.rglob("*"))


def _training_file(tmp_path):
    model = Net()
    x, t = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "train.poptorch"
    poptorch.trainingModel(model, optimizer=optimizer).compileAndExport(str(path), x, t)
    return path, x, t


def _set_lr(node, value):
    """Every ``"lr"`` number in a (tagged) JSON document set to ``value``."""
    if isinstance(node, dict):
        for key, child in node.items():
            if key == "lr" and isinstance(child, (int, float)):
                node[key] = value
            else:
                _set_lr(child, value)
    elif isinstance(node, list):
        if len(node) == 2 and node[0] == "lr" and isinstance(node[1], (int, float)):
            node[1] = value
        for child in node:
            _set_lr(child, value)


def test_hyper_parameters_beyond_float32_are_refused_at_load(tmp_path):
    path, x, t = _training_file(tmp_path)
    blobs = container.read_container(str(path))
    meta = json.loads(blobs["metadata.json"])
    _set_lr(meta["optimizer"], 1e308)
    assert "1e+308" in json.dumps(meta["optimizer"])
    blobs["metadata.json"] = json.dumps(meta).encode()
    container.write_container(str(path), blobs)
    with pytest.raises(poptorch.Error, match=r"Invalid file .*lr = 1e\+308 is out of "
                                             "float32 range"):
        poptorch.load(str(path))


@pytest.mark.parametrize("lr", [1e308, 1e39])
def test_hyper_parameters_beyond_float32_are_refused_at_set_up(lr):
    model = Net()
    x, t = data()
    with pytest.raises(poptorch.Error, match="lr = .* is out of float32 range"):
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(),
                                                                lr=lr))(x, t)
    model = Net()
    trainer = poptorch.trainingModel(model, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1))
    trainer(x, t)
    with pytest.raises(poptorch.Error, match="out of float32 range"):
        trainer.setOptimizer(torch.optim.SGD(model.parameters(), lr=lr))


@pytest.mark.parametrize("make, what", [
    (lambda: torch.empty(8, 6, device="meta"), "is on the meta device"),
    (lambda: torch.ones(8, 6).to_sparse(), "has layout torch.sparse_coo"),
    (lambda: torch.quantize_per_tensor(torch.ones(8, 6), 0.1, 0, torch.quint8),
     "is a quantized tensor"),
])
def test_inputs_the_program_cannot_take_are_an_error(make, what):
    model = Net().eval()
    wrapper = poptorch.inferenceModel(model)
    with pytest.raises(poptorch.Error, match=f"The input 'x' {what}"):
        wrapper(make())
    x, _ = data()
    torch.testing.assert_close(wrapper(x), model(x))  # nothing broken
