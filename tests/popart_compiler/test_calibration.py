"""Calibration of the IPU Model's estimates against published configurations
(``shared/spec/ipu-hardware.md``): BERT-Large pre-training on 4 IPUs fits and on one
IPU does not; estimated throughputs are within a factor of 2 of the published figures.
The models are built on the ``meta`` device from their configurations (no weights)."""
import os
import sys

import pytest
import torch

from popart_compiler.cost import cost_model
from popart_compiler.cost.ipu_model import target_for
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.session_options import SessionOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import reference_models as models  # noqa: E402

pytestmark = pytest.mark.slow

#: Bow Pod16, PopTorch, BERT-Large phase 1 (SL128): sequences per second.
BERT_LARGE_POD16 = 5600
#: MLPerf v1.1, IPU-POD16 (GC200): ResNet-50 to target in 28.3 minutes; with the ~37
#: epochs of that round's large-batch recipes (our assumption, README) that is
#: 37 × 1,281,167 images in 1,698 s.
RESNET50_POD16 = 37 * 1281167 / (28.3 * 60)

LAMB = OptimizerDescription("LAMB", {}, [], {}, accum_type=torch.float16)
OFF_CHIP_SHARDED = {"onChip": 0, "useReplicatedTensorSharding": 1}


@pytest.fixture(scope="module")
def bert_large():
    with torch.device("meta"):
        model = models.BertForPreTraining(models.BERT_LARGE)
    return models.capture_for_estimate(model, model.example_inputs(8))


def bert_estimate(graph, layers_per_ipu, **raw):
    """The published pre-training configuration: replication 4, gradient accumulation
    2048, LAMB with its state off chip and sharded, matmul memory proportions."""
    options = SessionOptions(gradient_accumulation=2048, replication_factor=4, raw={
        "location_optimizer": OFF_CHIP_SHARDED,
        "available_memory_proportion": {0: 0.15, 1: 0.25, 2: 0.25, 3: 0.25}, **raw})
    return cost_model.estimate(graph, options, True, target_for("ipu21"), LAMB,
                               layers_per_ipu=layers_per_ipu, head_ipu=0)


def test_bert_large_published_configuration_fits_on_four_ipus(bert_large):
    est = bert_estimate(bert_large, [3, 7, 7, 7])
    assert [m.ipu for m in est.memory] == [0, 1, 2, 3]
    assert est.fits, [m.total for m in est.memory]
    for m in est.memory:
        assert m.total > 0.5 * m.capacity  # the configuration uses the IPUs well
        assert m.off_chip > 0  # LAMB state in streaming memory
    # IPU 0 holds the embeddings and the tied masked-LM head
    assert est.memory[0].largest[0][0] == "word.weight"


def test_bert_large_on_one_ipu_does_not_fit(bert_large):
    est = bert_estimate(bert_large, [24])
    assert not est.fits
    assert est.memory[0].total > 1.5 * est.memory[0].capacity
    # without recomputation the 4-IPU pipeline does not fit either (the stash grows)
    with torch.device("meta"):
        plain = models.BertForPreTraining(
            models.BertConfig(recompute_checkpoint_every_layer=False))
    graph = models.capture_for_estimate(plain, plain.example_inputs(8))
    assert not bert_estimate(graph, [3, 7, 7, 7]).fits


def test_bert_large_throughput_on_a_bow_pod16(bert_large):
    est = bert_estimate(bert_large, [3, 7, 7, 7])
    pod16 = est.samples_per_second * 16 / (4 * 4)  # 4 replicas of 4 IPUs
    assert BERT_LARGE_POD16 / 2 <= pod16 <= BERT_LARGE_POD16 * 2
    assert est.cycles.efficiency > 0.99  # 2048 micro-batches over 9 stages


def test_resnet50_throughput_on_a_pod16():
    with torch.device("meta"):
        model = models.ResNet50(checkpoint_stages=True)
    graph = models.capture_for_estimate(model, model.example_inputs(8))
    sgd = OptimizerDescription("SGD", {"momentum": 0.9}, [], {},
                               velocity_accum_type=torch.float16, accum_type=torch.float16)
    options = SessionOptions(gradient_accumulation=32, replication_factor=16)
    est = cost_model.estimate(graph, options, True, target_for("ipu2"), sgd)
    assert est.fits
    assert RESNET50_POD16 / 2 <= est.samples_per_second <= RESNET50_POD16 * 2
