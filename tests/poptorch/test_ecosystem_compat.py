"""The layer around the public API that PopTorch's clients import (issue 22 §1): the
``popart`` module, PopTorch's private names (``poptorch._impl``, ``poptorch_core``,
``_utils``, ``_poplar_executor``), logging, errors as PopTorch users read them, PyG."""
import importlib.util
import logging
import pickle
import subprocess
import sys
import traceback
import types
import warnings

import pytest
import torch

import popart
import poptorch
import poptorch._impl as _impl
import poptorch._poplar_executor as _poplar_executor
import poptorch._utils as _utils
from poptorch import poptorch_core
from popart_compiler.popart_enums import OPTION_ENUMS


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y=None):
        out = self.fc(x)
        if y is None:
            return out
        return out, torch.nn.functional.mse_loss(out, y)


def _options():
    """Options ready for toDict() (an output mode must be picked first, as in PopTorch)."""
    return poptorch.Options().outputMode(poptorch.OutputMode.All)


# -- popart -------------------------------------------------------------------------

def test_popart_enums_have_poparts_names_and_values():
    assert int(popart.AccumulateOuterFragmentSchedule.OverlapMemoryOptimized) == 3
    assert int(popart.SubgraphCopyingStrategy.JustInTime) == 1
    assert int(popart.RecomputationType.Pipeline) == 3
    assert int(getattr(popart.MergeVarUpdateType, "None")) == 0
    assert int(popart.SyntheticDataMode.RandomNormal) == 2
    assert popart.ReductionType.Mean == poptorch.ReductionType.Mean


@pytest.mark.parametrize("key", sorted(set(OPTION_ENUMS) - set(
    poptorch.Options().outputMode(poptorch.OutputMode.All).toDict())))
def test_every_popart_enum_value_is_accepted_by_popart_set(key):
    """Each member of the enum a backend option takes validates; one past the last is
    refused naming the enum (batchSchedule=OverlapOnCompute (3) used to be refused)."""
    enum_cls = OPTION_ENUMS[key]
    for member in enum_cls:
        opts = _options()
        opts._Popart.set(key, int(member))
        poptorch_core._validateOptions(opts.toDict())
    opts = _options()
    opts._Popart.set(key, len(enum_cls))
    with pytest.raises(poptorch.Error, match=f"Value for {enum_cls.__name__} out of range"):
        poptorch_core._validateOptions(opts.toDict())


def test_a_popart_api_not_provided_raises_an_error_naming_it():
    assert not hasattr(popart, "Builder")
    with pytest.raises(poptorch.Error, match=r"popart\.Builder is not provided") as info:
        popart.Builder()
    assert isinstance(info.value, AttributeError)
    with pytest.raises(ImportError, match="InferenceSession"):
        from popart import InferenceSession  # noqa: F401


def test_popart_imports_in_a_fresh_interpreter():
    out = subprocess.run([sys.executable, "-c", "import popart; print(popart.__version__)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3.4.0"


# -- poptorch._impl -----------------------------------------------------------------

def test_unwrap_and_rewrap_a_training_models_parameters():
    model = _Linear()
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.1))
    x, y = torch.randn(2, 4), torch.randn(2, 3)
    training(x, y)
    weight = model.fc.weight
    assert _impl.isWrapped(weight) and not _impl.isWrapped(torch.zeros(1))
    _impl.unwrapModelIfNecessary(model)
    assert type(weight) is torch.nn.Parameter and not _impl.isWrapped(weight)
    _impl.rewrapModelIfNecessary(model)
    assert _impl.isWrapped(weight)
    # still connected to the device: a second run updates what the host reads
    before = weight.detach().clone()
    training(x, y)
    assert not torch.equal(before, model.fc.weight.detach())
    # unwrapIfWrapped forgets the wrapper; _restoreWrapperIfNecessary leaves it plain
    plain = _impl.unwrapIfWrapped(model.fc.bias)
    assert type(plain) is torch.nn.Parameter
    assert _impl._restoreWrapperIfNecessary(plain) is plain and not _impl.isWrapped(plain)


def test_dispatch_tracing_flags_are_true_only_inside_the_capture():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((_impl.isDispatchTracing(),
                         poptorch_core.isCompilingWithDispatcher()))
            return x * 2

    assert not _impl.isDispatchTracing()
    poptorch.inferenceModel(Probe())(torch.ones(2))
    assert seen == [(True, True)]
    assert not poptorch_core.isCompilingWithDispatcher()

    class Fails(torch.nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        poptorch.inferenceModel(Fails())(torch.ones(2))
    assert not poptorch_core.isCompilingWithDispatcher()  # cleaned up after a failure


# -- poptorch_core ------------------------------------------------------------------

_KINDS = {
    "Poptorch": (poptorch.Error, "poptorch_cpp_error"),
    "Popart": (poptorch.Error, "popart_exception"),
    "PopartInternal": (poptorch.Error, "popart_internal_exception"),
    "Poplibs": (poptorch.Error, "poplibs_exception"),
    "PoplarUnrecoverable": (poptorch.UnrecoverableError, "poplar_unrecoverable_runtime_error"),
    "PoplarUnknown": (poptorch.Error, "poplar_unknown_runtime_error"),
    "PoplarRecoverableFullReset": (poptorch.RecoverableError,
                                   "poplar_recoverable_runtime_error"),
    "PoplarLinkError": (poptorch.Error, "poplar_link_error"),
}


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_throw_test_error_raises_each_kind(kind):
    cls, type_ = _KINDS[kind]
    with pytest.raises(poptorch.Error) as info:
        poptorch_core._throwTestError(poptorch_core.TestErrorType[kind])
    err = info.value
    assert type(err) is cls and err.type == type_
    assert err.location.count("throwTestError::topLevel") == 1
    assert err.location.count("throwTestError::bottomLevel") == 1
    assert "throwTestError" not in err.message
    assert "throwTestError::bottomLevel" in err.args[0]
    if cls is poptorch.RecoverableError:
        assert err.recovery_action == "FULL_RESET"
    if kind == "PoplarLinkError":
        assert "-lfoo not found" in err.message


def test_error_handling_catch_order_of_the_user_guide():
    """The pattern of Graphcore's error_handling.py: a model whose constructor raises
    each kind, caught as RecoverableError, UnrecoverableError, then Error."""
    class Model(torch.nn.Module):
        def __init__(self, error):
            super().__init__()
            if error is not None:
                poptorch_core._throwTestError(error)

        def forward(self, x, y):
            return x + y

    def run(error):
        try:
            model = poptorch.inferenceModel(Model(error))
            assert model(torch.tensor([1.]), torch.tensor([2.])) == 3.0
            return "ok"
        except poptorch.RecoverableError as e:
            return f"reset:{e.recovery_action}"
        except poptorch.UnrecoverableError:
            return "offline"
        except poptorch.Error as e:
            assert e.message and e.type and e.location
            return "error"

    assert run(None) == "ok"
    got = {kind.name: run(kind) for kind in poptorch_core.TestErrorType}
    assert got["PoplarRecoverableFullReset"] == "reset:FULL_RESET"
    assert got["PoplarUnrecoverable"] == "offline"
    assert {v for k, v in got.items()
            if k not in ("PoplarRecoverableFullReset", "PoplarUnrecoverable")} == {"error"}


@pytest.mark.parametrize("key, value, message", [
    ("asdfasdf", True, r"Unknown bool option asdfasdf"),
    ("dotChecks", torch.empty(1, 1), r"Unknown value type .*Tensor.* for option dotChecks"),
])
def test_validate_options_refuses_unknown_keys_and_types(key, value, message):
    opts = _options()
    opts.deviceIterations(2).replicationFactor(1)
    poptorch_core._validateOptions(opts.toDict())
    opts._Popart.set(key, value)
    with pytest.raises(poptorch.Error, match=message):
        poptorch_core._validateOptions(opts.toDict())


def test_variable_attributes_list_the_allowed_attributes():
    opt = poptorch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.5)
    allowed = opt.variable_attrs._allowed_attributes
    assert {"lr", "momentum", "loss_scaling"} <= set(allowed)
    for attr in allowed:
        opt.variable_attrs.markAsConstant(attr)
        assert opt.variable_attrs.isConstant(attr)


# -- poptorch._utils and _poplar_executor ----------------------------------------------

def test_combine_batch_tensors_concatenates_along_dim0():
    batches = [[torch.full((2, 3), float(b)), torch.arange(2) + 10 * b] for b in range(3)]
    combined = list(_utils.combine_batch_tensors_gen(batches))
    assert [t.shape for t in combined] == [(6, 3), (6,)]
    assert combined[1].tolist() == [0, 1, 10, 11, 20, 21]
    loader = [{"x": torch.full((2,), float(i)), "y": (torch.tensor([i]),)} for i in range(5)]
    groups = list(_utils.combined_batch_generator(iter(loader), 2, drop_last=False))
    assert [g["x"].tolist() for g in groups] == [[0, 0, 1, 1], [2, 2, 3, 3], [4, 4]]
    assert groups[1]["y"][0].tolist() == [2, 3]
    assert len(list(_utils.combined_batch_generator(iter(loader), 2))) == 2


_library = types.ModuleType("graph_library")  # stands for torch_geometric.utils
_library.aggregate = lambda x: x.sum(0)


class _SubstituteAggregate:
    """A substitution manager of the kind PopTorch Geometric registers: swaps a
    library function for an IPU-friendly one while the model is captured."""
    calls = []

    def replace(self):
        self.saved = _library.aggregate
        _library.aggregate = lambda x: x.sum(0) * 10
        _SubstituteAggregate.calls.append("replace")

    def restore(self):
        _library.aggregate = self.saved
        _SubstituteAggregate.calls.append("restore")


def test_substitution_managers_apply_during_the_capture_only():
    original = _library.aggregate
    types_ = _poplar_executor._OverwriteContextManager._subsitution_manager_types
    # registered through a re-executed shim module, as PopTorch Geometric does it
    spec = importlib.util.find_spec("poptorch._poplar_executor")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._OverwriteContextManager.registerSubsitutionManager(_SubstituteAggregate)
    module._OverwriteContextManager.registerSubsitutionManager(_SubstituteAggregate)

    class Model(torch.nn.Module):
        def forward(self, x):
            return _library.aggregate(x)

    try:
        assert types_.count(_SubstituteAggregate) == 1
        x = torch.ones(2, 3)
        assert poptorch.inferenceModel(Model())(x).tolist() == [20.0] * 3
        assert _SubstituteAggregate.calls == ["replace", "restore"]
        assert _library.aggregate is original and Model()(x).tolist() == [2.0] * 3
    finally:
        types_.remove(_SubstituteAggregate)


# -- logging ------------------------------------------------------------------------

def test_poptorch_records_reach_the_root_loggers_handlers(caplog):
    caplog.set_level(logging.WARNING)
    poptorch.logger.warning("from poptorch %d", 1)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("poptorch::python", "from poptorch 1")]


def test_logger_warn_is_warning_without_a_deprecation_warning(caplog):
    caplog.set_level(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        poptorch.logger.warn("old spelling")
    assert caplog.records[-1].levelno == logging.WARNING
    assert caplog.records[-1].getMessage() == "old spelling"


# -- errors as PopTorch users read them ------------------------------------------------

def test_errors_show_as_poptorch_error_without_internal_files():
    model = poptorch.trainingModel(torch.nn.Linear(2, 2))  # no loss: a compiler check
    with pytest.raises(poptorch.Error) as info:
        model(torch.ones(1, 2))
    err = info.value
    assert err.type == "poptorch_cpp_error"
    assert str(err).startswith("'poptorch_cpp_error': Couldn't find a loss")
    assert ".py" not in str(err)
    first = traceback.format_exception_only(type(err), err)[0]
    assert first.startswith("poptorch.Error: 'poptorch_cpp_error'")
    assert repr(type(err)) == "<class 'poptorch.Error'>"
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is poptorch.Error and str(again) == str(err)


def test_bfloat16_autocast_of_the_caller_is_named():
    model = poptorch.inferenceModel(torch.nn.Linear(4, 3))
    with pytest.raises(poptorch.Error, match=r"inside torch\.autocast\(\"cpu\", "
                                             r"dtype=torch\.bfloat16\)"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 4))
    assert model(torch.randn(2, 4)).dtype == torch.float32  # usable after the error


# -- PyTorch Geometric ---------------------------------------------------------------

def test_pyg_gcnconv_self_loops_error_and_add_self_loops_false():
    pyg = pytest.importorskip("torch_geometric.nn")

    class Net(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.conv = pyg.GCNConv(4, 3, **kwargs)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index)

    x = torch.randn(5, 4)
    edge_index = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])
    with pytest.raises(poptorch.Error, match=r"add_self_loops=False"):
        poptorch.inferenceModel(Net())(x, edge_index)
    net = Net(add_self_loops=False)
    torch.testing.assert_close(poptorch.inferenceModel(net)(x, edge_index),
                               net(x, edge_index))
