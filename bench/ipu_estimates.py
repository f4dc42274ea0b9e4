"""IPU Model estimates for BERT-Large and ResNet-50 next to the published figures.

Prints, for each model: memory per IPU (MB) and fit / no-fit, estimated samples per
second and pipeline efficiency against ``gradientAccumulation`` (4 … 256), the ratio to
the published throughput (``shared/spec/ipu-hardware.md``), and how long the capture
and the estimate itself take. The models are built on the ``meta`` device: estimates
come from shapes, no kernel runs at full size.

Run from the repository root: ``python bench/ipu_estimates.py [--report DIR]``
(``--report`` also writes the profile report of BERT-Large with gradient accumulation
16 into ``DIR``: the README's screenshot).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from popart_compiler.cost import cost_model  # noqa: E402
from popart_compiler.cost.ipu_model import target_for  # noqa: E402
from popart_compiler.optim.description import OptimizerDescription  # noqa: E402
from popart_compiler.session_options import SessionOptions  # noqa: E402

import reference_models as models  # noqa: E402

ACCUMULATION = (4, 8, 16, 32, 64, 128, 256)
BERT_PUBLISHED = 5600  # sequences/s, Bow Pod16, BERT-Large phase 1 (SL128)
RESNET_PUBLISHED = 37 * 1281167 / (28.3 * 60)  # MLPerf v1.1 POD16, 37 epochs assumed


def _memory_line(est) -> str:
    return "  ".join(f"IPU {m.ipu}: {m.total / 1e6:,.0f}/{m.capacity / 1e6:,.0f} MB "
                     f"{'fits' if m.fits else 'DOES NOT FIT'}" for m in est.memory)


def _sweep(name, estimate_for, ipus_per_replica, published, minimum_accumulation):
    print(f"  {'gradientAccumulation':>20} {'samples/s (Pod16)':>18} {'efficiency':>10} "
          f"{'ratio to published':>18}")
    for accumulation in ACCUMULATION:
        start = time.perf_counter()
        est = estimate_for(accumulation)
        seconds = time.perf_counter() - start
        pod16 = est.samples_per_second * 16 / (ipus_per_replica * est.replicas)
        note = "" if accumulation >= minimum_accumulation else \
            f"  (PopTorch needs >= {minimum_accumulation})"
        print(f"  {accumulation:>20} {pod16:>18,.0f} {est.cycles.efficiency:>10.3f} "
              f"{pod16 / published:>18.2f}   estimate {seconds:.2f} s{note}")


def bert(report_dir=None) -> None:
    start = time.perf_counter()
    with torch.device("meta"):
        model = models.BertForPreTraining(models.BERT_LARGE)
    graph = models.capture_for_estimate(model, model.example_inputs(8))
    capture = time.perf_counter() - start
    lamb = OptimizerDescription("LAMB", {}, [], {}, accum_type=torch.float16)

    def estimate_for(accumulation, layers=(3, 7, 7, 7)):
        options = SessionOptions(gradient_accumulation=accumulation, replication_factor=4,
                                 raw={"location_optimizer": {"onChip": 0,
                                                             "useReplicatedTensorSharding": 1},
                                      "available_memory_proportion":
                                          {0: 0.15, 1: 0.25, 2: 0.25, 3: 0.25}})
        return cost_model.estimate(graph, options, True, target_for("ipu21"), lamb,
                                   layers_per_ipu=list(layers), head_ipu=0)

    start = time.perf_counter()
    est = estimate_for(2048)
    seconds = time.perf_counter() - start
    print("BERT-Large pre-training, SL128, micro-batch 8, layers [3, 7, 7, 7] (embeddings "
          "and MLM head on IPU 0), recomputation, LAMB off chip + RTS, Bow, 4 replicas")
    print(f"  capture on the meta device: {capture:.2f} s; estimate: {seconds:.2f} s; "
          f"total {capture + seconds:.2f} s (target < 10 s)")
    print(f"  memory: {_memory_line(est)}")
    pod16 = est.samples_per_second
    print(f"  gradientAccumulation 2048 (published): {pod16:,.0f} sequences/s on a Bow Pod16 "
          f"vs published {BERT_PUBLISHED:,} (ratio {pod16 / BERT_PUBLISHED:.2f}), pipeline "
          f"efficiency {est.cycles.efficiency:.3f}")
    _sweep("BERT-Large", estimate_for, 4, BERT_PUBLISHED, 2 * 5 - 1)
    one = estimate_for(2048, layers=(24,))
    print(f"  all 24 layers on one IPU: {_memory_line(one)}")
    if report_dir:
        from popart_compiler.cost.profile_report import write_report
        path = write_report(report_dir, estimate_for(16), "bert-large", True)
        print(f"  profile report (gradientAccumulation 16): {path}")


def resnet() -> None:
    start = time.perf_counter()
    with torch.device("meta"):
        model = models.ResNet50(checkpoint_stages=True)
    graph = models.capture_for_estimate(model, model.example_inputs(8))
    capture = time.perf_counter() - start
    sgd = OptimizerDescription("SGD", {"momentum": 0.9}, [], {},
                               velocity_accum_type=torch.float16, accum_type=torch.float16)

    def estimate_for(accumulation):
        options = SessionOptions(gradient_accumulation=accumulation, replication_factor=16)
        return cost_model.estimate(graph, options, True, target_for("ipu2"), sgd)

    start = time.perf_counter()
    est = estimate_for(32)
    seconds = time.perf_counter() - start
    print("\nResNet-50 training, 224x224, micro-batch 8, recomputation per block, SGD, "
          "GC200, 16 replicas of 1 IPU (IPU-POD16)")
    print(f"  capture on the meta device: {capture:.2f} s; estimate: {seconds:.2f} s")
    print(f"  memory: {_memory_line(est)}")
    print(f"  published: MLPerf v1.1 28.3 min to target = about {RESNET_PUBLISHED:,.0f} "
          f"images/s (37 epochs assumed)")
    _sweep("ResNet-50", estimate_for, 1, RESNET_PUBLISHED, 1)


if __name__ == "__main__":
    torch.set_num_threads(2)
    bert(sys.argv[sys.argv.index("--report") + 1] if "--report" in sys.argv else None)
    resnet()
