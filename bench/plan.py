"""poptorch.plan against Graphcore's published hand-tuned placements, side by side
under the same IPU Model estimate.

Each model is Graphcore's configuration (``bench/calibration_models.py``: random
weights on the ``meta`` device, the published options, replicas and batch) *without*
its placement: no ``BeginBlock``, no checkpoints, plain vocabulary projection.
``poptorch.plan`` places it; the published placement (layers per IPU, head on IPU 0,
available memory proportions, checkpoint per layer, serialisation factor, optimizer
state location) is estimated on the same captured program. Columns: plan and published
samples/s and their ratio, the fullest IPU of each, the plan's layers per IPU, the time
``poptorch.plan`` took (capture, costing and search; 2 threads), and whether compiling
the applied plan reports the plan's estimate (``verified``). ResNet-50 on one IPU: the
largest micro-batch that fits (the plan's recomputation checkpoints, one per
bottleneck when it checkpoints), against the published micro-batch 18 with Graphcore's
own checkpoints (compiled from ``bench/calibration.py``).

Run from the repository root: ``python bench/plan.py [--only NAME,...] [--no-verify]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import poptorch  # noqa: E402
from popart_compiler.planner.candidate import Candidate  # noqa: E402
from poptorch._plan import api  # noqa: E402

import calibration  # noqa: E402
import calibration_models as cm  # noqa: E402
import reference_models  # noqa: E402


@dataclasses.dataclass
class Published:
    """A published placement: the first unit of each IPU, the head's first unit (on
    IPU 0), proportions, serialisation factor of the vocabulary projection, optimizer
    state on chip."""
    starts: Sequence[str]
    head: Optional[str]
    proportions: Sequence[float]
    serialization: int
    on_chip: bool


@dataclasses.dataclass
class Row:
    name: str
    ipus: int
    build: Callable[[], Tuple]  # -> (model, inputs of one micro-batch, options, optimizer)
    global_batch: int
    published: Optional[Published] = None
    inputs_of: Optional[Callable] = None  # samples -> inputs (default: the model's)


def _bert_large():
    with torch.device("meta"):
        model = cm.BertPretraining(1024, 24, 16, [24], annotate=False).half()
    options = calibration._options(21, 4, 2048, [0.6])
    return model, model.example_inputs(8), options, calibration._lamb(model)


def _gpt2(hidden, layers, heads, replicas, accumulation):
    def build():
        with torch.device("meta"):
            model = cm.Gpt2Training(hidden, layers, heads, [layers], annotate=False).half()
        options = calibration._options(2, replicas, accumulation, [0.6])
        return model, model.example_inputs(1), options, calibration._adamw(model)
    return build


def _swin_tiny():
    """Swin-T 224 (float32, AdamW, mb 4, GA 64, 4 replicas, Bow) as
    ``vision/swin/pytorch`` builds it, without its placement: stages of blocks in
    nested ``ModuleList``\\ s."""
    import transformers
    import validation_models as vm
    config = transformers.SwinConfig(image_size=224, embed_dim=96, depths=[2, 2, 6, 2],
                                     num_heads=[3, 6, 12, 24], window_size=7,
                                     drop_path_rate=0.2, num_labels=1000)
    with torch.device("meta"):
        model = vm.ImageClassifier(transformers.SwinForImageClassification(config))
    options = calibration._options(21, 4, 64, [0.3] * 4, half_partials=False,
                                   optimizer_off_chip=False, sharded_state=False)
    adamw = poptorch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    return model, model.example_inputs(4, torch.float32), options, adamw


def _swin_inputs(samples):
    """``samples`` float32 images 224 x 224 and their labels (meta tensors)."""
    return (torch.zeros(samples, 3, 224, 224, dtype=torch.float32, device="meta"),
            torch.zeros(samples, dtype=torch.int64, device="meta"))


_SWIN = "model.swin.encoder.layers."
_BERT = "model.bert.encoder.layer."
_GPT = "model.transformer."
ROWS = [
    Row("BERT-Large ph1 SL128", 4, _bert_large, 8 * 2048 * 4,
        Published(["model.bert.embeddings", _BERT + "3", _BERT + "10", _BERT + "17"],
                  "model.bert.pooler", [0.15, 0.25, 0.25, 0.25], 2, False)),
    Row("BERT-Large ph1 SL128", 8, _bert_large, 8 * 2048 * 4),
    Row("GPT-2 small SL1024", 4, _gpt2(768, 12, 12, 4, 2048), 2048 * 4,
        Published([_GPT + "wte", _GPT + "wpe", _GPT + "h.4", _GPT + "h.8"], "model.lm_head",
                  [0.15] * 4, 4, False)),
    Row("GPT-2 small SL1024", 8, _gpt2(768, 12, 12, 4, 2048), 2048 * 4),
    Row("GPT-2 medium SL1024", 4, _gpt2(1024, 24, 16, 2, 4096), 4096 * 2),
    Row("GPT-2 medium SL1024", 8, _gpt2(1024, 24, 16, 2, 4096), 4096 * 2,
        Published([_GPT + "wte", _GPT + "wpe"] + [_GPT + f"h.{i}" for i in (3, 6, 9, 12, 16, 20)],
                  "model.lm_head", [0.30] + [0.15] * 7, 4, False)),
    # configs.yaml swin_tiny_224: layers_per_ipu [2, 3, 5, 2] over the 12 blocks
    Row("Swin-T 224", 4, _swin_tiny, 4 * 64 * 4,
        Published(["model.swin.embeddings", _SWIN + "1.blocks.0", _SWIN + "2.blocks.1",
                   _SWIN + "3.blocks.0"], None, [0.3] * 4, 1, True), _swin_inputs),
]


def _published_plan(row: Row, model, inputs, options, optimizer, plan) -> poptorch.plan.Plan:
    """The published placement estimated on the plan's units (its own capture)."""
    request, _ = api._request(model, *inputs, options=options, optimizer=optimizer,
                              ipus=row.ipus, global_batch=row.global_batch)
    planner = api._Planner(request)
    mb = plan.micro_batch
    planning = planner.planning(mb)
    names = [u.name for u in planning.problem.units]
    pub = row.published
    starts = [names.index(s) for s in pub.starts]
    head = names.index(pub.head) if pub.head else None
    end = head if head is not None else len(names)
    ranges = tuple((a, b - 1) for a, b in zip(starts, starts[1:] + [end]))
    checks = tuple([True] * row.ipus + ([False] if head is not None else []))
    serial = tuple((op, pub.serialization) for op in planning.head_ops.values())
    candidate = Candidate(ranges, head, checks, tuple(pub.proportions), serial, pub.on_chip)
    return api._plan_of(planner, mb, candidate)


def _verify(model, plan, options, optimizer, inputs_of) -> str:
    """Compile the applied plan; ``yes`` when ``ipuModelEstimate()`` equals the plan's
    estimate (every figure of the profile report)."""
    opts = plan.apply(model, options.clone())
    wrapper = poptorch.trainingModel(model, opts, optimizer)
    wrapper.compile(*inputs_of(plan.global_batch))
    got = wrapper.ipuModelEstimate()
    wrapper.destroy()
    return "yes" if got == plan.estimate.summary() else "NO"


def _mb(values) -> str:
    return f"{max(values) / 1e6:,.0f}"


def run_rows(rows: List[Row], verify: bool) -> None:
    print(f"{'model':<21} {'IPUs':>4} {'plan/s':>9} {'pub/s':>9} {'ratio':>6} "
          f"{'plan MB':>8} {'pub MB':>7} {'plan layers per IPU':<26} {'plan s':>6} "
          f"{'verified':>8}")
    notes = []
    for row in rows:
        model, inputs, options, optimizer = row.build()
        start = time.perf_counter()
        try:
            plan = poptorch.plan(model, *inputs, options=options, optimizer=optimizer,
                                 ipus=row.ipus, global_batch=row.global_batch)
        except poptorch.Error as error:
            print(f"{row.name:<21} {row.ipus:>4} {'no fit':>9}  "
                  f"({time.perf_counter() - start:.1f} s) {error.message[:150]}...")
            continue
        seconds = time.perf_counter() - start
        pub_rate, pub_mb, ratio = "-", "-", "-"
        if row.published is not None:
            published = _published_plan(row, model, inputs, options, optimizer, plan)
            pub_rate = f"{published.samples_per_second:,.1f}"
            pub_mb = _mb(published.memory_per_ipu) + ("" if published.fits else "*")
            ratio = f"{plan.samples_per_second / published.samples_per_second:.2f}"
        ok = _verify(model, plan, options, optimizer, row.inputs_of or model.example_inputs) \
            if verify else "-"
        print(f"{row.name:<21} {row.ipus:>4} {plan.samples_per_second:>9,.1f} {pub_rate:>9} "
              f"{ratio:>6} {_mb(plan.memory_per_ipu):>8} {pub_mb:>7} "
              f"{str(plan.layers_per_ipu):<26} {seconds:>6.1f} {ok:>8}", flush=True)
        checks = plan.stage_checkpoints
        notes.append(f"  {row.name} on {row.ipus} IPUs: head on IPU {plan.head_ipu}; "
                     f"proportions {plan.available_memory_proportion}; checkpoints per stage "
                     f"{checks}; serialised {plan.serialization}; optimizer state "
                     f"{'on' if plan.optimizer_state_on_chip else 'off'} chip")
    print("\n".join(notes))


def run_resnet(verify: bool) -> None:
    """ResNet-50 v1.5 on one Bow IPU (16 replicas, GA 57, SGD with combined
    accumulators, 8-bit input): the largest micro-batch that fits."""
    with torch.device("meta"):
        model = reference_models.ResNet50(eight_bit_input=True, label_smoothing=0.1).half()
    options = calibration._options(21, 16, 57, [0.16], optimizer_off_chip=False,
                                   sharded_state=False)
    options.broadcastBuffers(False)
    # Graphcore's recompute_mode "manual" turns recomputation on (RecomputeAll):
    # PopTorch does not for one IPU, and without it checkpoints change nothing
    options._Popart.set("autoRecomputation", 4)
    sgd = poptorch.optim.SGD(model.parameters(), lr=2.0, momentum=0.9, weight_decay=1e-4,
                             use_combined_accum=True)
    candidates = [16, 18, 20, 22, 24, 26, 28, 32]
    start = time.perf_counter()
    plan = poptorch.plan(model, *model.example_inputs(1), options=options, optimizer=sgd,
                         micro_batch=candidates)
    seconds = time.perf_counter() - start
    fitting = [e["micro_batch"] for e in plan.explored if e["fits"]]
    largest = max(fitting) if fitting else None
    published, _ = calibration.estimate(calibration.CASES["resnet50"])
    print(f"\nResNet-50 on 1 IPU (16 replicas, GA 57): micro-batches tried {candidates}")
    for e in sorted(plan.explored, key=lambda e: e["micro_batch"]):
        text = "no fit"
        if e["fits"]:
            ck = e["checkpointed"]
            text = (f"fits, {e['samples_per_second']:,.0f} samples/s, "
                    f"{_mb(e['memory'])} MB, proportion {e['available_memory_proportion'][0]}, "
                    f"checkpoints: {len(ck)} bottleneck outputs"
                    + (f" ({ck[0]} .. {ck[-1]})" if ck else ""))
        print(f"  micro-batch {e['micro_batch']:>3}: {text}")
    print(f"  largest that fits: {largest}; fastest: micro-batch {plan.micro_batch} "
          f"({plan.samples_per_second:,.0f} samples/s); planned in {seconds:.1f} s")
    print(f"  published: micro-batch 18 with Graphcore's checkpoints (residual adds): "
          f"{published['cycles']['samples_per_second']:,.0f} samples/s, "
          f"{max(m['total'] for m in published['memory']) / 1e6:,.0f} MB; ratio "
          f"{plan.samples_per_second / published['cycles']['samples_per_second']:.2f}")
    if verify:
        print(f"  verified: {_verify(model, plan, options, sgd, model.example_inputs)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated: bert, gpt2, swin, resnet")
    parser.add_argument("--no-verify", action="store_true",
                        help="skip compiling the applied plans")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    poptorch.setLogLevel("ERR")
    only = {n for n in args.only.split(",") if n}
    rows = [r for r in ROWS if not only or r.name.split()[0].lower().replace("-", "")
            .replace("large", "") in only or r.name.lower().startswith(tuple(only))]
    if rows:
        run_rows(rows, not args.no_verify)
    if not only or "resnet" in only:
        run_resnet(not args.no_verify)


if __name__ == "__main__":
    main()
