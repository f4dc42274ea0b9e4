"""Tests of the block annotations and execution strategies (docs/api-sections.md api §9,
docs/semantics.md S-60…S-65) and of ``module_repr`` / ``print`` (docs/api-sections.md api §2.12)."""
import pickle

import pytest
import torch

from poptorch._options import execution_strategy as es
from poptorch import enums
from poptorch._options.execution_strategy import (NO_ACTIVE_BLOCK, BeginBlock, Block, BlockFunction,
                                          ParallelPhasedExecution, Phase, PipelinedExecution,
                                          SerialPhasedExecution, ShardedExecution, Stage,
                                          current_block, removeBlocks)
from poptorch._ops.printing import module_repr
from poptorch._ops.printing import print as pt_print
from popart_compiler.errors import Error


@pytest.fixture(autouse=True)
def _reset_state():
    es._reset_block_state(tracking=False)
    yield
    es._reset_block_state(tracking=False)


# ---------------------------------------------------------------------------
# Block state
# ---------------------------------------------------------------------------

def test_no_op_when_not_tracking():
    assert current_block() is None
    with Block("a", 1):
        assert current_block() is None
    Block.start("b", 0)
    assert current_block() is None
    assert es.block_history() == []


def test_block_scope_and_no_active_block():
    es._reset_block_state()
    assert current_block() is None  # ops before the first block: IPU 0 / stage 0
    assert not es.no_active_block()
    with Block("a", ipu_id=1) as blk:
        assert isinstance(blk, Block) and isinstance(blk, torch.nn.Module)
        assert current_block() == ("a", 1)
    assert current_block() is NO_ACTIVE_BLOCK
    assert es.no_active_block()
    assert repr(NO_ACTIVE_BLOCK) == "NO_ACTIVE_BLOCK"
    Block.start("b", 2)
    assert current_block() == ("b", 2)
    Block.start("c")
    assert current_block() == ("c", None)
    assert es.block_history() == [("a", 1), ("b", 2), ("c", None)]
    es._stop_block_tracking()
    assert current_block() is None
    es._reset_block_state()
    assert current_block() is None and es.block_history() == []


def test_nested_scope_exit_ends_block():
    es._reset_block_state()
    with Block("outer"):
        with Block("inner"):
            assert current_block() == ("inner", None)
        assert current_block() is NO_ACTIVE_BLOCK


def test_block_scope_exits_on_exception():
    es._reset_block_state()
    with pytest.raises(ValueError):
        with Block("a"):
            raise ValueError("boom")
    assert current_block() is NO_ACTIVE_BLOCK


def test_auto_ids():
    es._reset_block_state()
    Block.useAutoId()
    with Block():
        assert current_block() == ("0", None)
    with Block(ipu_id=3):
        assert current_block() == ("1", 3)
    Block.start()
    assert current_block() == ("2", None)
    Block.useAutoId()
    with Block():
        assert current_block() == ("0", None)


def test_block_capture_context_manager():
    with es.block_capture():
        assert es.is_tracking_blocks()
        Block.start("x", 0)
        assert current_block() == ("x", 0)
    assert not es.is_tracking_blocks()
    assert current_block() is None


def test_pickle_sentinel():
    assert pickle.loads(pickle.dumps(NO_ACTIVE_BLOCK)) is NO_ACTIVE_BLOCK


# ---------------------------------------------------------------------------
# BeginBlock / BlockFunction / removeBlocks
# ---------------------------------------------------------------------------

class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(2, 2)
        self.l2 = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.l2(self.l1(x))


def test_begin_block_module():
    net = _Net()
    assert BeginBlock(net.l1, "first", ipu_id=0) is net.l1
    assert BeginBlock(net.l2, ipu_id=1) is net.l2
    hooks = [h for h in net.l2._forward_pre_hooks.values()]
    assert repr(hooks[0]) == "BeginBlock(user_id=None, ipu_id=1)"
    # outside a capture the hooks do nothing (and keep user_id unassigned)
    net(torch.ones(1, 2))
    assert repr(hooks[0]) == "BeginBlock(user_id=None, ipu_id=1)"
    es._reset_block_state()
    Block.useAutoId()
    seen = []
    net.l2.register_forward_hook(lambda *_: seen.append(current_block()))
    net.l1.register_forward_hook(lambda *_: seen.append(current_block()))
    net(torch.ones(1, 2))
    assert seen == [("first", 0), ("0", 1)]
    assert repr(hooks[0]) == "BeginBlock(user_id=0, ipu_id=1)"
    # the assigned id is kept on later runs and the block never ends implicitly
    Block.useAutoId()
    net(torch.ones(1, 2))
    assert current_block() == ("0", 1)


def test_begin_block_errors():
    net = _Net()
    BeginBlock(net.l1, "a")
    with pytest.raises(Error, match=r"module has already been assigned to a block\."):
        BeginBlock(net.l1, "b")
    with pytest.raises(Error, match=r"module is not an instance of torch.nn.Module or "
                       r"function\."):
        BeginBlock(42, "c")
    try:
        BeginBlock("not callable")
    except Error as err:
        assert err.type == "poptorch_py_error"


def test_begin_block_function():
    def f(x):
        return x + 1

    wrapped = BeginBlock(f, "fn", ipu_id=2)
    assert wrapped is not f and callable(wrapped)
    assert wrapped(1) == 2
    es._reset_block_state()
    assert wrapped(2) == 3
    assert current_block() == ("fn", 2)
    assert repr(wrapped) == "BeginBlock(user_id=fn, ipu_id=2)"


def test_block_function_decorator():
    @BlockFunction("dec", ipu_id=1)
    def g(x):
        """doc"""
        g.inside = current_block()
        return x * 2

    assert g.__name__ == "g" and g.__doc__ == "doc"
    es._reset_block_state()
    assert g(3) == 6
    assert g.inside == ("dec", 1)
    assert current_block() is NO_ACTIVE_BLOCK


def test_remove_blocks():
    net = _Net()
    BeginBlock(net.l1, "a")
    BeginBlock(net, "top")
    other = net.l2.register_forward_pre_hook(lambda *_: None)
    removeBlocks(net)
    for m in net.modules():
        assert not any(isinstance(h, es._BeginBlockHook) for h in m._forward_pre_hooks.values())
    assert other.id in net.l2._forward_pre_hooks
    BeginBlock(net.l1, "again")  # can be annotated again
    with pytest.raises(AssertionError):
        removeBlocks(lambda x: x)


def test_begin_block_model_pickles():
    net = _Net()
    BeginBlock(net.l1, "a", 1)
    clone = pickle.loads(pickle.dumps(net))
    assert "BeginBlock(user_id=a, ipu_id=1) Linear" in module_repr(clone)


# ---------------------------------------------------------------------------
# module_repr / print
# ---------------------------------------------------------------------------

def test_module_repr_without_blocks_matches_torch():
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(),
                              torch.nn.ModuleList([torch.nn.ReLU(), torch.nn.ReLU()]))
    assert module_repr(net) == repr(net)
    assert module_repr(3) == "3"


def test_module_repr_with_blocks():
    net = _Net()
    BeginBlock(net.l2, "b1", ipu_id=1)
    assert module_repr(net) == (
        "_Net(\n"
        "  (l1): Linear(in_features=2, out_features=2, bias=True)\n"
        "  (l2): BeginBlock(user_id=b1, ipu_id=1) Linear(in_features=2, out_features=2, "
        "bias=True)\n"
        ")")
    BeginBlock(net, "top", ipu_id=0)
    assert module_repr(net).startswith("BeginBlock(user_id=top, ipu_id=0) _Net(\n")


def test_print(capsys):
    net = _Net()
    BeginBlock(net.l1, "x", 0)
    pt_print(net)
    out = capsys.readouterr().out
    assert out == module_repr(net) + "\n" + repr(net) + "\n"
    pt_print("hello")
    assert capsys.readouterr().out == "hello\n"


# ---------------------------------------------------------------------------
# Stage / Phase
# ---------------------------------------------------------------------------

def test_stage():
    s = Stage("a", "b")
    assert s.blocks == ("a", "b")
    assert s.ipu(3) is s
    assert s._ipu == 3
    with pytest.raises(AssertionError):
        s.ipu("1")
    with pytest.raises(AssertionError):
        Stage("a", 1)
    assert repr(Stage("a").ipu(1)) == "Stage('a').ipu(1)"


def test_phase():
    p = Phase(Stage("a"), Stage("b"))
    assert len(p.stages) == 2 and p.stage(1).blocks == ("b",)
    assert p.ipus(0, 2) is None
    assert p.stage(0)._ipu == 0 and p.stage(1)._ipu == 2
    with pytest.raises(AssertionError, match="2 stages"):
        p.ipus(1)
    q = Phase("a", "b")
    assert len(q.stages) == 1 and q.stages[0].blocks == ("a", "b")
    with pytest.raises(AssertionError):
        Phase("a", Stage("b"))
    with pytest.raises(AssertionError):
        Phase(1)


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

def test_pipelined_arguments():
    default = PipelinedExecution()
    assert default._auto_stage is enums.AutoStage.SameAsIpu
    assert default.backendOptions() == {"execution_mode": 0}
    auto = PipelinedExecution(enums.AutoStage.AutoIncrement)
    assert auto._auto_stage is enums.AutoStage.AutoIncrement
    explicit = PipelinedExecution(Stage("a").ipu(2), "b", ["c", "d"], ("e",))
    assert explicit.stage("a").blocks == ("a",)
    assert explicit.stage("d").blocks == ("c", "d")
    assert explicit.stage("c") is explicit.stage("d")
    assert explicit.stage("e").blocks == ("e",)
    with pytest.raises(AssertionError, match="Unknown block zz"):
        explicit.stage("zz")
    with pytest.raises(AssertionError, match="a associated with more than one stage"):
        PipelinedExecution("a", ["b", "a"])
    with pytest.raises(AssertionError):
        PipelinedExecution("a", 3)
    with pytest.raises(AssertionError):
        PipelinedExecution(enums.AutoStage.SameAsIpu, "a")


def test_sharded():
    s = ShardedExecution("a", "b")
    assert isinstance(s, PipelinedExecution)
    assert s.backendOptions() == {"execution_mode": 1}
    assert s.stage("b").blocks == ("b",)
    with pytest.raises(AssertionError, match="more than one stage"):
        ShardedExecution("a", "a")


def test_placement_same_as_ipu():
    strategy = PipelinedExecution()
    strategy._onStartCapture()
    assert [strategy._blockPlacement(b, i) for b, i in (("0", 0), ("1", 1), ("2", 0))] == \
        [(0, 0), (1, 1), (0, 0)]
    with pytest.raises(AssertionError, match="SameAsIpu was selected but no IPU was "
                       "specified for block x"):
        strategy._blockPlacement("x", None)


def test_placement_auto_increment():
    strategy = PipelinedExecution(enums.AutoStage.AutoIncrement)
    strategy._onStartCapture()
    assert [strategy._blockPlacement(b, i) for b, i in (("0", 0), ("1", 1), ("2", 0))] == \
        [(0, 0), (1, 1), (2, 0)]
    assert strategy._blockPlacement("1", 1) == (1, 1)
    assert strategy._blockPlacement("n", None) == (3, 3)
    strategy._onStartCapture()
    assert strategy._blockPlacement("2", 0) == (0, 0)


def test_placement_explicit_stages():
    strategy = PipelinedExecution(Stage("a", "b"), Stage("c").ipu(5), "d")
    assert strategy._blockPlacement("a", None) == (0, 0)
    assert strategy._blockPlacement("b", 3) == (0, 3)
    assert strategy._blockPlacement("c", 1) == (1, 5)  # explicit stage IPU wins
    assert strategy._blockPlacement("d", None) == (2, 2)
    with pytest.raises(AssertionError, match=r"Unknown Block 'x' list of expected Blocks: "
                       r"\['a', 'b', 'c', 'd'\]"):
        strategy._blockPlacement("x", 0)


def test_phased_requires_phases():
    for cls in (SerialPhasedExecution, ParallelPhasedExecution):
        with pytest.raises(AssertionError, match="There is currently no AutoStage for "
                           "PhasedExecution, please explicitly specify the phases"):
            cls()


def test_phased_arguments():
    s = SerialPhasedExecution(Phase(Stage("0"), Stage("1")), [Stage("2"), Stage("3")],
                              ["4", "5"], "6", Stage("7"))
    assert [len(s.phase(i).stages) for i in range(5)] == [2, 2, 1, 1, 1]
    assert s.phase(2).stage(0).blocks == ("4", "5")
    assert s.stage("5") is s.phase(2).stage(0)
    assert s._phaseId("3") == 1 and s._phaseId("7") == 4
    for bad in (-1, "0", 1.0):
        with pytest.raises(AssertionError):
            s.phase(bad)
    with pytest.raises(AssertionError, match="more than one stage"):
        SerialPhasedExecution(["0"], ["1", "0"])
    with pytest.raises(AssertionError):
        SerialPhasedExecution([Stage("0"), "1"])
    with pytest.raises(AssertionError, match="Unknown block"):
        s.stage("99")


def test_phased_options():
    s = SerialPhasedExecution(["0"], ["1"])
    assert s.backendOptions() == {"execution_mode": 2, "separate_backward_phase": False,
                                  "tensors_liveness": 0, "serial_phases_execution": True}
    assert s.useSeparateBackwardPhase() is s
    assert s.setTensorsLiveness(enums.Liveness.OffChipAfterFwdNoOverlap) is s
    assert s.backendOptions() == {"execution_mode": 2, "separate_backward_phase": True,
                                  "tensors_liveness": 2, "serial_phases_execution": True}
    with pytest.raises(AssertionError):
        s.setTensorsLiveness(1)
    with pytest.raises(AssertionError):
        s.useSeparateBackwardPhase(1)
    p = ParallelPhasedExecution(["0"], ["1"])
    assert p.backendOptions()["serial_phases_execution"] is False
    assert p.sendTensorsOffChipAfterFwd() is p
    assert p.backendOptions()["tensors_liveness"] == int(enums.Liveness.OffChipAfterFwd)
    p.sendTensorsOffChipAfterFwd(False)
    assert p.backendOptions()["tensors_liveness"] == int(enums.Liveness.AlwaysLive)
    with pytest.raises(AssertionError):
        p.sendTensorsOffChipAfterFwd("yes")
    assert not hasattr(p, "setTensorsLiveness")
    assert not hasattr(s, "sendTensorsOffChipAfterFwd")


def test_phased_ipus_and_backward_phase_numbering():
    strategy = ParallelPhasedExecution(Phase(Stage("0"), Stage("1")),
                                       Phase(Stage("2"), Stage("3")))
    strategy.phase(0).ipus(0, 2)
    strategy.phase(1).ipus(1, 3)
    assert strategy._blockPlacement("0", None)[1] == 0
    assert strategy._blockPlacement("1", None)[1] == 2
    assert strategy._blockPlacement("3", 0)[1] == 3
    assert [strategy._backwardPhase(p) for p in (0, 1)] == [2, 1]
    strategy.useSeparateBackwardPhase()
    assert [strategy._backwardPhase(p) for p in (0, 1)] == [4, 3]


def test_strategies_pickle_and_repr():
    for strategy in (PipelinedExecution(), ShardedExecution("a", Stage("b").ipu(1)),
                     SerialPhasedExecution(["0"], ["1"]).setTensorsLiveness(
                         enums.Liveness.OffChipAfterEachPhase),
                     ParallelPhasedExecution(Phase(Stage("0"), Stage("1")))):
        clone = pickle.loads(pickle.dumps(strategy))
        assert type(clone) is type(strategy)
        assert repr(clone) == repr(strategy)
        assert clone.backendOptions() == strategy.backendOptions()
