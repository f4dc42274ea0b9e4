"""The IPU Model's calibration set: Graphcore's published configurations as PopTorch
programs, compiled for an offline IPU target, with the published fit and throughput.

Each :class:`Case` builds its model (``calibration_models``, random weights on the
``meta`` device), the ``poptorch.Options`` and the optimizer of the published
configuration (graphcore/examples ``nlp/bert/pytorch/configs_pretraining.yml``,
``nlp/gpt2/pytorch/benchmarks.yml``, ``vision/vit/pytorch/configs.yml``,
``vision/cnns/pytorch/train/configs.yml``), and :func:`estimate` compiles it with
``useOfflineIpuTarget`` and returns the IPU Model's estimate. Throughput is per sample
as the model runs it: a packed BERT sequence (1.17 sequences per pack at SL128,
``packing_factor`` of ``configs_pretraining.yml``) is one sample.

``CALIBRATION`` holds the configurations the model was calibrated on (issue 21);
``IMPOSSIBLE`` physically impossible ones (weights plus accumulators alone exceed the
IPUs' memory); ``HELD_OUT`` published configurations the model was not calibrated on,
as a check of how it generalises.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import poptorch  # noqa: E402

import calibration_models as cm  # noqa: E402
import reference_models  # noqa: E402

__all__ = ["Case", "CALIBRATION", "IMPOSSIBLE", "HELD_OUT", "estimate", "CASES"]

#: Sequences per pack of packed BERT pre-training at SL128 (``packing_factor``).
PACKING_SL128 = 1.17


@dataclasses.dataclass(frozen=True)
class Case:
    """One published configuration.

    Attributes:
        name: short name.
        description: the configuration in words.
        fits: the published verdict (it ran on hardware, or it cannot fit).
        throughput: published samples per second of the whole system (as the model
            runs samples), or ``None``.
        source: where the published figure comes from.
        build: returns ``(model, options, optimizer or None, inputs)``.
        training: a training program.
    """
    name: str
    description: str
    fits: bool
    throughput: Optional[float]
    source: str
    build: Callable[[], Tuple]
    training: bool = True


def _options(target: int, replicas: int, accumulation: int, proportions: Sequence[float],
             half_partials: bool = True, device_iterations: int = 1,
             optimizer_off_chip: bool = True, sharded_state: bool = True,
             stage: str = "AutoIncrement", training: bool = True) -> poptorch.Options:
    """``poptorch.Options`` as the examples' ``ipu_options.py`` set them."""
    opts = poptorch.Options().useOfflineIpuTarget(target).showCompilationProgressBar(False)
    opts.replicationFactor(replicas).deviceIterations(device_iterations)
    opts.autoRoundNumIPUs(True)
    if training:
        opts.Training.gradientAccumulation(accumulation)
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings().useOnChipStorage(not optimizer_off_chip)
            .useReplicatedTensorSharding(sharded_state))
    if len(proportions) > 1:
        opts.setExecutionStrategy(poptorch.PipelinedExecution(
            getattr(poptorch.AutoStage, stage)))
    opts.setAvailableMemoryProportion({f"IPU{i}": p for i, p in enumerate(proportions)})
    if half_partials:
        opts.Precision.setPartialsType(torch.float16)
    opts.Precision.enableStochasticRounding(True)
    return opts


def _lamb(model, accum=torch.float16, moments=torch.float32):
    return poptorch.optim.LAMB(model.parameters(), lr=0.006, weight_decay=0.01,
                               accum_type=accum, first_order_momentum_accum_type=moments,
                               second_order_momentum_accum_type=moments)


def _adamw(model, accum=torch.float16, first=torch.float32):
    return poptorch.optim.AdamW(model.parameters(), lr=1.5e-4, weight_decay=0.01,
                                accum_type=accum, first_order_momentum_accum_type=first,
                                second_order_momentum_accum_type=torch.float32)


def _bert(hidden, layers, heads, layers_per_ipu, micro_batch, accumulation, proportions,
          sequence_length=128, mask_tokens=20, serialization=1, replicas=4):
    def build():
        with torch.device("meta"):
            model = cm.BertPretraining(hidden, layers, heads, layers_per_ipu,
                                       sequence_length, mask_tokens, serialization).half()
        opts = _options(21, replicas, accumulation, proportions)
        samples = micro_batch * accumulation * replicas
        return model, opts, _lamb(model), model.example_inputs(samples)
    return build


def _bert_large(**kw):
    return _bert(1024, 24, 16, **kw)


def _gpt2(hidden, layers, heads, layers_per_ipu, accumulation, proportions, replicas,
          sequence_length=1024, serialization=4, training=True, sharded=True):
    def build():
        with torch.device("meta"):
            model = cm.Gpt2Training(hidden, layers, heads, layers_per_ipu, sequence_length,
                                    serialization, training=training).half()
        opts = _options(2, replicas, accumulation, proportions, training=training,
                        sharded_state=sharded)
        # inference: PopTorch needs deviceIterations >= the forward stages (wte, wpe and
        # the head make more stages than IPUs)
        iterations = 2 * len(layers_per_ipu) + 2
        samples = accumulation * replicas if training else replicas * iterations
        if not training:
            opts.deviceIterations(iterations)
        optimizer = _adamw(model) if training else None
        return model, opts, optimizer, model.example_inputs(samples)
    return build


def _vit():
    with torch.device("meta"):
        model = cm.VitPretraining([3, 3, 3, 3]).half()
    opts = _options(21, 4, 2048, [0.3] * 4, half_partials=False, optimizer_off_chip=False,
                    stage="SameAsIpu")
    optimizer = _lamb(model, accum=torch.float32)
    return model, opts, optimizer, model.example_inputs(8 * 2048 * 4)


#: ``recompute_checkpoints`` of ``resnet50`` in ``vision/cnns/pytorch/train/configs.yml``:
#: the residual adds ``add`` … ``add_12`` listed there, every output of layer 4.
_RESNET_ADDS = (0, 1, 2, 3, 5, 6, 7, 9, 11, 12)
_RESNET_LAYER4 = (13, 14, 15)


def _resnet(target=21, micro_batch=18, accumulation=57, replicas=16):
    def build():
        with torch.device("meta"):
            model = reference_models.ResNet50(checkpoint_blocks=_RESNET_ADDS,
                                              keep_blocks=_RESNET_LAYER4,
                                              eight_bit_input=True,
                                              label_smoothing=0.1).half()
        opts = _options(target, replicas, accumulation, [0.16], optimizer_off_chip=False,
                        sharded_state=False)
        opts.broadcastBuffers(False)  # each replica keeps its batch-norm statistics
        # recompute_mode "manual" of utils/ipu_settings.py: checkpoints count only
        # with recomputation on, which PopTorch does not turn on for one IPU
        opts._Popart.set("explicitRecomputation", True)
        opts._Popart.set("autoRecomputation", 4)  # RecomputationType.RecomputeAll
        sgd = poptorch.optim.SGD(model.parameters(), lr=2.0, momentum=0.9,
                                 weight_decay=1e-4, use_combined_accum=True)
        return model, opts, sgd, model.example_inputs(micro_batch * accumulation * replicas)
    return build


def _squad(training=True):
    def build():
        with torch.device("meta"):
            model = cm.BertSquad(1024, 24, 16, [2, 3, 3, 3, 3, 3, 3, 4]).half()
        proportions = [0.08, 0.28, 0.32, 0.32, 0.36, 0.38, 0.4, 0.32]
        if training:
            opts = _options(21, 2, 32, proportions, device_iterations=2,
                            optimizer_off_chip=False)
            return model, opts, _adamw(model, first=torch.float16), \
                model.example_inputs(4 * 32 * 2 * 2)
        opts = _options(21, 2, 1, proportions, device_iterations=8, training=False)
        return model, opts, None, model.example_inputs(4 * 8 * 2, training=False)
    return build


CALIBRATION = (
    Case("bert-large-ph1", "BERT-Large phase 1 SL128 packed, Bow Pod16, [3,7,7,7], mb 8, "
         "GA 2048, 4 replicas, LAMB off chip + RTS", True, 5600 / PACKING_SL128,
         "graphcore.ai performance results: 5,600 sequences/s at 1.17 sequences per pack",
         _bert_large(layers_per_ipu=[3, 7, 7, 7], micro_batch=8, accumulation=2048,
                     proportions=[0.15, 0.25, 0.25, 0.25], serialization=2)),
    Case("bert-base-ph1", "BERT-Base phase 1 SL128, Bow Pod16, [0,4,4,4], mb 32, GA 512, "
         "4 replicas", True, 15911,
         "graphcore.ai performance results: 15,911 sequences/s",
         _bert(768, 12, 12, layers_per_ipu=[0, 4, 4, 4], micro_batch=32, accumulation=512,
               proportions=[0.25] * 4)),
    Case("bert-large-1ipu", "BERT-Large SL128 with all 24 layers on one IPU", False, None,
         "ipu-hardware.md: does not fit in 900 MB for training",
         _bert_large(layers_per_ipu=[24], micro_batch=8, accumulation=2048,
                     proportions=[0.15], serialization=2)),
    Case("gpt2-small", "GPT-2 small SL1024, GC200 Pod16, [0,4,4,4], mb 1, GA 2048, "
         "4 replicas, AdamW off chip + RTS", True, None,
         "graphcore/examples nlp/gpt2/pytorch/benchmarks.yml (runs on hardware)",
         _gpt2(768, 12, 12, [0, 4, 4, 4], 2048, [0.15] * 4, 4)),
    Case("vit-b16", "ViT-B/16 pre-training, Bow Pod16, [3,3,3,3], mb 8, GA 2048, "
         "4 replicas, LAMB", True, 7615, "graphcore.ai performance results: 7,615 images/s",
         _vit),
    Case("resnet50", "ResNet-50 v1.5, Bow Pod16, 16 replicas x 1 IPU, mb 18, GA 57, "
         "SGD combined, 8-bit input", True, 37061,
         "graphcore.ai performance results: 37,061 images/s", _resnet()),
)

IMPOSSIBLE = (
    Case("bert-large-fp32-2ipu", "BERT-Large float32, [12,12] on 2 IPUs, Adam state on "
         "chip (weights + moments + accumulators: 5.4 GB over 2 IPUs)", False, None,
         "physics: 340 M parameters x 16 bytes / 2 IPUs > 900 MB",
         lambda: _float32(_bert_large(layers_per_ipu=[12, 12], micro_batch=1,
                                      accumulation=8, proportions=[0.6, 0.6]))),
    Case("gpt2-medium-1ipu", "GPT-2 medium on one IPU, float16 weights and float16 "
         "accumulators (1.4 GB)", False, None,
         "physics: 355 M parameters x 4 bytes > 900 MB",
         _gpt2(1024, 24, 16, [24], 8, [0.6], 1, sequence_length=128)),
)

HELD_OUT = (
    Case("bert-large-ph2-384", "BERT-Large phase 2 SL384, Bow Pod16, [3,7,7,7], mb 2, "
         "GA 2048", True, None, "configs_pretraining.yml pretrain_large_384 (runs)",
         _bert_large(layers_per_ipu=[3, 7, 7, 7], micro_batch=2, accumulation=2048,
                     proportions=[0.15, 0.25, 0.25, 0.25], serialization=2,
                     sequence_length=384, mask_tokens=56)),
    Case("bert-large-ph2-512", "BERT-Large phase 2 SL512, Bow Pod16, [3,7,7,7], mb 2, "
         "GA 2048", True, None, "configs_pretraining.yml pretrain_large_512 (runs)",
         _bert_large(layers_per_ipu=[3, 7, 7, 7], micro_batch=2, accumulation=2048,
                     proportions=[0.10, 0.15, 0.15, 0.15], serialization=2,
                     sequence_length=512, mask_tokens=76)),
    Case("bert-large-squad", "BERT-Large SQuAD SL384 fine-tuning, Bow Pod16, 8 IPUs x 2 "
         "replicas, mb 4, GA 32, AdamW on chip + RTS", True, 1000,
         "ipu-hardware.md: about 1,000 sequences/s on a Bow Pod16", _squad()),
    Case("bert-large-squad-infer", "BERT-Large SQuAD SL384 inference, Bow, 8 IPUs x 2 "
         "replicas, mb 4", True, None, "configs_squad.yml (runs)", _squad(False),
         training=False),
    Case("gpt2-medium", "GPT-2 medium SL1024, GC200, 8 IPUs x 2 replicas, GA 4096",
         True, None, "nlp/gpt2/pytorch/benchmarks.yml (runs)",
         _gpt2(1024, 24, 16, [0, 3, 3, 3, 3, 4, 4, 4], 4096,
               [0.30] + [0.15] * 7, 2)),
    Case("gpt2-large-512", "GPT-2 large SL512, GC200, 8 IPUs x 2 replicas, GA 4096",
         True, None, "nlp/gpt2/pytorch/benchmarks.yml (runs)",
         _gpt2(1280, 36, 20, [1, 5, 5, 5, 5, 5, 5, 5], 4096,
               [0.15, 0.12] + [0.15] * 6, 2, sequence_length=512, serialization=8)),
    Case("gpt2-large-infer", "GPT-2 large SL1024 inference, GC200, 8 IPUs x 2 replicas",
         True, None, "nlp/gpt2/pytorch/benchmarks.yml (runs)",
         _gpt2(1280, 36, 20, [1, 5, 5, 5, 5, 5, 5, 5], 1, [0.2] * 8, 2, training=False),
         training=False),
    Case("resnet50-gc200", "ResNet-50 v1.5, GC200 IPU-POD16 (MLPerf v1.1), mb 18", True,
         37 * 1281167 / (28.3 * 60),
         "MLPerf v1.1: 28.3 min to target on an IPU-POD16, about 37 epochs (assumed)",
         _resnet(target=2)),
)

CASES: Dict[str, Case] = {c.name: c for c in CALIBRATION + IMPOSSIBLE + HELD_OUT}


def _float32(build):
    model, opts, _optimizer, inputs = build()
    model = model.float()
    adam = poptorch.optim.Adam(model.parameters(), lr=1e-4)
    opts._Popart.set("partialsTypeMatMuls", "float")
    opts.TensorLocations.setOptimizerLocation(
        poptorch.TensorLocationSettings().useOnChipStorage(True))
    return model, opts, adam, inputs


def estimate(case: Case) -> Tuple[Dict, float]:
    """Compile ``case`` for its offline target; returns ``(ipuModelEstimate(), seconds
    to build, capture, compile and estimate)``."""
    start = time.perf_counter()
    model, opts, optimizer, inputs = case.build()
    if case.training:
        wrapper = poptorch.trainingModel(model, opts, optimizer)
    else:
        wrapper = poptorch.inferenceModel(model, opts)
    wrapper.compile(*inputs)
    result = wrapper.ipuModelEstimate()
    seconds = time.perf_counter() - start
    wrapper.destroy()
    return result, seconds
