"""popart_compiler/enums.py: the one definition of every option enum keeps PopTorch
3.4's names and values (a PopTorch program's integers mean the same member), and
popart_enums.py reuses these classes where PopART shares the concept."""
import enum

import pytest

from popart_compiler import enums, popart_enums
from popart_compiler.errors import Error
from popart_compiler.session_options import Anchor, SessionOptions

#: PopTorch 3.4's enumerations (its ``poptorch.enums``): name -> {member: value}.
POPTORCH_3_4 = {
    "MeanReductionStrategy": {"Running": 0, "Post": 1, "PostAndLoss": 2},
    "DataLoaderMode": {"Sync": 0, "Async": 1, "AsyncRebatched": 2},
    "SharingStrategy": {"SharedMemory": 0, "FileSystem": 1, "Fork": 2, "ForkServer": 3},
    "OutputMode": {"Final": 0, "EveryN": 1, "All": 2, "Sum": 3, "Default": 4},
    "ConnectionType": {"Always": 0, "OnDemand": 1, "Never": 2},
    "HalfFloatCastingBehavior": {"FloatDowncastToHalf": 0, "HalfUpcastToFloat": 1,
                                 "Default": 2},
    "ReductionType": {"Sum": 0, "Mean": 1, "NoReduction": 2},
    "SyncPattern": {"Full": 0, "SinglePipeline": 1, "ReplicaAndLadder": 2},
    "MatMulSerializationMode": {"InputChannels": "input_channels",
                                "ReducingDim": "reducing_dim",
                                "OutputChannels": "output_channels", "Disabled": "none"},
    "Liveness": {"AlwaysLive": 0, "OffChipAfterFwd": 1, "OffChipAfterFwdNoOverlap": 2,
                 "OffChipAfterEachPhase": 3},
    "OverlapMode": {"NoOverlap": "no_overlap",
                    "OverlapAccumulationLoop": "overlap_accumulation_loop",
                    "OverlapDeviceIterationLoop": "overlap_device_iteration_loop"},
    "AutoStage": {"SameAsIpu": 0, "AutoIncrement": 1},
    "MultiConvPlanType": {"Parallel": 0, "Serial": 1},
    "CommGroupType": {"All": 0, "Consecutive": 1, "Orthogonal": 2, "NoGrouping": 3},
    "VariableRetrievalMode": {"OnePerGroup": 0, "AllReplicas": 2},
}


@pytest.mark.parametrize("name", sorted(POPTORCH_3_4))
def test_each_enum_keeps_poptorchs_members_and_values(name):
    cls = getattr(enums, name)
    assert {m.name: m.value for m in cls} == POPTORCH_3_4[name]
    integer = all(isinstance(v, int) for v in POPTORCH_3_4[name].values())
    assert issubclass(cls, enum.IntEnum) is integer


def test_the_module_defines_poptorchs_enums_and_the_execution_mode():
    assert set(enums.__all__) == set(POPTORCH_3_4) | {"ExecutionMode"}
    assert {m.name: m.value for m in enums.ExecutionMode} == {
        "Pipelined": 0, "Sharded": 1, "Phased": 2}
    # IntEnum members equal the integers a PopTorch program passes
    assert enums.OutputMode.EveryN == 1 and enums.CommGroupType(3).name == "NoGrouping"


def test_poparts_names_for_shared_concepts_are_the_same_classes():
    assert popart_enums.ENUMS["DeviceConnectionType"] is enums.ConnectionType
    for name in ("CommGroupType", "VariableRetrievalMode", "SyncPattern", "ReductionType",
                 "MeanReductionStrategy"):
        assert popart_enums.ENUMS[name] is getattr(enums, name)
    # PopART's spelling is an alias of PopTorch's member, not a fifth member
    assert enums.CommGroupType.Ungrouped is enums.CommGroupType.NoGrouping
    assert len(enums.CommGroupType) == 4
    assert popart_enums.OPTION_ENUMS["accumulationAndReplicationReductionType"] \
        is enums.ReductionType


def test_no_enum_is_defined_twice_in_the_compiler():
    defined = {}
    for module in (enums, popart_enums):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, enum.Enum) \
                    and value.__module__ == module.__name__:
                assert value.__name__ not in defined, (value.__name__, defined)
                defined[value.__name__] = module.__name__
    assert defined["OutputMode"] == "popart_compiler.enums"
    assert defined["RecomputationType"] == "popart_compiler.popart_enums"


def test_output_mode_default_is_refused_by_the_session_options():
    """``Default`` is resolved when a model is wrapped; the compiler never gets it."""
    with pytest.raises(Error, match="Invalid output mode Default"):
        SessionOptions(output_mode=4)
    with pytest.raises(Error, match="Invalid output mode Default"):
        SessionOptions.from_dict({"output_mode": 4})
    with pytest.raises(Error, match="Invalid output mode Default"):
        Anchor("Relu:0", enums.OutputMode.Default)
    assert SessionOptions.from_dict({"output_mode": 0}).output_mode is enums.OutputMode.Final
