"""``PopartOptions`` (popart_compiler/popart_options.py): the PopART options the IPU
Model's estimate and PopTorch's implicit defaults act on, read once from the option
dictionary; the estimate reads them, never the dictionary; the implicit defaults are
added to them, and a second pass adds none."""
import torch

from models import MLP, export
from popart_compiler.cost import cost_model
from popart_compiler.cost.ipu_model import target_for
from popart_compiler.implicit_defaults import ProgramFacts, implicit_defaults, with_defaults
from popart_compiler.popart_enums import RecomputationType
from popart_compiler.popart_options import PopartOptions, TensorLocation
from popart_compiler.session_options import SessionOptions


def test_an_empty_dictionary_sets_nothing():
    assert PopartOptions.from_raw({}) == PopartOptions()
    assert SessionOptions.from_dict({}).popart == PopartOptions()


def test_each_option_is_read_with_its_type():
    raw = {"autoRecomputation": 2, "explicitRecomputation": True, "enablePipelining": False,
           "enableLoadAndOffloadRNGState": False, "numIOTiles": 64,
           "location_weight": {"onChip": 0, "minElementsForOffChip": 128},
           "location_optimizer": {"useReplicatedTensorSharding": 1,
                                  "minElementsForReplicatedTensorSharding": 16},
           "available_memory_proportion": {"1": 0.25}, "partialsTypeMatMuls": "Half",
           "convolutionOptions": {"partialsType": "half"},
           "engineOptions": {"debug.retainDebugInformation": "true"}}
    p = SessionOptions.from_dict(raw).popart
    assert p.auto_recomputation is RecomputationType.NormOnly
    assert p.explicit_recomputation is True and p.enable_pipelining is False
    assert p.rng_state is False and p.io_tiles == 64
    assert p.location_weight == TensorLocation(on_chip=False, min_off_chip=128)
    assert p.location_optimizer == TensorLocation(sharded=True, min_sharding=16)
    assert p.location_activation == TensorLocation()
    assert p.available_memory == {1: 0.25}
    assert p.half_partials_matmul and p.half_partials_conv
    assert "autoRecomputation" in p.set_keys and "location_weight" in p.set_keys
    assert "engineOptions[debug.retainDebugInformation]" in p.set_keys


def test_the_estimate_reads_the_typed_options_not_the_dictionary():
    graph = export(MLP(), torch.randn(2, 4))
    typed = SessionOptions(popart=PopartOptions(io_tiles=32, explicit_recomputation=True))
    settings = cost_model.memory_settings(typed, True)
    assert settings.explicit_recomputation is True
    assert cost_model.cycle_settings(settings, typed, True, None, 2).io_tiles == 32
    only_raw = SessionOptions(raw={"numIOTiles": 32, "explicitRecomputation": True})
    settings = cost_model.memory_settings(only_raw, True)
    assert settings.explicit_recomputation is False
    assert cost_model.cycle_settings(settings, only_raw, True, None, 2).io_tiles == 0
    assert cost_model.estimate(graph, typed, False, target_for("ipu2")).fits


def test_defaults_are_added_to_the_typed_options_once():
    phased = SessionOptions.from_dict({"execution_mode": 2})
    facts = ProgramFacts(True, used_ipus=2)
    defaults = implicit_defaults(phased, facts)
    applied = with_defaults(phased, defaults)
    assert applied.popart.enable_pipelining is False and applied.popart.rng_state is True
    assert applied.popart.location_optimizer.on_chip is False
    assert phased.popart.location_optimizer.on_chip is None  # unchanged
    assert implicit_defaults(applied, facts) == ()
    pipelined = SessionOptions.from_dict({})
    over_four = with_defaults(pipelined, implicit_defaults(pipelined, ProgramFacts(True, 4)))
    assert over_four.popart.auto_recomputation is RecomputationType.Pipeline
    assert over_four.popart.enable_pipelining is True
