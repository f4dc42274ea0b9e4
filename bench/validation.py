"""The IPU Model's validation set: published configurations of model families that the
calibration set (``bench/calibration.py``) does not hold, each with its source.

Every :class:`Check` builds its model the way Graphcore's code builds it
(``validation_models``, Hugging Face ``transformers``; random weights on the ``meta``
device), with the options and optimizer of the published configuration, and says how
the published throughput was measured: ``device`` (cycles on the device),
``loop`` (a Python loop of calls timed on the host) or ``loop+loader`` (the same
with a ``DataLoader`` whose own rate the source gives). ``fitted`` marks the two
cases a constant was fitted on (:data:`~popart_compiler.cost.host_model.STEP_SYNC_SECONDS`
on ``cnn-r1-synthetic``,
:data:`~popart_compiler.cost.host_model.HOST_COPY_BYTES_PER_S` on ``cnn-r1-real``),
``seen`` the three looked at while choosing
:data:`~popart_compiler.cost.op_classes.COMPUTE_SET_CYCLES`; every other case is held
out.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable, Dict, Optional, Tuple

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import poptorch  # noqa: E402
from popart_compiler.cost.host_model import HostSettings, host_time  # noqa: E402
from popart_compiler.enums import OutputMode  # noqa: E402

import validation_models as vm  # noqa: E402
from calibration import _options  # noqa: E402

__all__ = ["Check", "CHECKS", "loop_throughput"]

EXAMPLES = "github.com/graphcore/examples"
PERF = "graphcore.ai performance results (Bow Pod16, SDK 3.0, PyTorch)"
TUTORIAL = f"{EXAMPLES} tutorials/tutorials/pytorch/efficient_data_loading/README.md"
CONFORMER = f"{EXAMPLES} speech/conformer/pytorch/README.md (global batch 16128)"
# the Pod64 runs: scripts/run_wenet_conformer_globalbs_16128_pod64.sh, poprun
# --num-instances=4 (host_processes below)


@dataclasses.dataclass(frozen=True)
class Check:
    """One published configuration of the validation set.

    Attributes:
        name / family / description: what it is.
        fits: it ran on hardware (or physics says it cannot fit).
        throughput: the published samples per second, or ``None``.
        measured: ``"device"``, ``"loop"`` or ``"loop+loader"`` (module docstring).
        source: where the figures come from.
        build: returns ``(model, options, optimizer, inputs)``.
        loader: the ``DataLoader``'s own samples per second (``loop+loader``).
        fitted: a constant was fitted on this case (else held out).
        seen: looked at while choosing
            :data:`~popart_compiler.cost.op_classes.COMPUTE_SET_CYCLES` from three
            values (so not strictly held out for it).
        training: a training program.
        host_processes: host processes the source ran the replicas in
            (``poprun --num-instances``), each copying its replicas' inputs.
    """
    name: str
    family: str
    description: str
    fits: bool
    throughput: Optional[float]
    measured: str
    source: str
    build: Callable[[], Tuple]
    loader: Optional[float] = None
    fitted: bool = False
    seen: bool = False
    training: bool = True
    host_processes: int = 1


def loop_throughput(summary: Dict, loader: Optional[float] = None,
                    processes: int = 1) -> float:
    """Samples per second of a Python loop of calls from an ``ipuModelEstimate()``
    (:func:`~popart_compiler.cost.host_model.host_time` of its host settings, with a
    ``DataLoader`` of ``loader`` samples per second and the replicas spread over
    ``processes`` host processes)."""
    host = summary["host"]
    settings = dict(host["settings"], output_mode=OutputMode(host["settings"]["output_mode"]),
                    loader_samples_per_s=loader, host_processes=processes)
    return host_time(host["device"], summary["micro_batch"],
                     HostSettings(**settings)).loop_samples_per_second


def _cnn(replicas: int, synthetic: bool):
    def build():
        with torch.device("meta"):
            model = vm.TutorialCnn()
        opts = poptorch.Options().useOfflineIpuTarget(2).showCompilationProgressBar(False)
        opts.deviceIterations(50).replicationFactor(replicas)
        opts.enableSyntheticData(synthetic)
        sgd = poptorch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9,
                                 use_combined_accum=False)
        return model, opts, sgd, model.example_inputs(16 * 50 * replicas)
    return build


def _adam_half(model):
    return poptorch.optim.Adam(model.parameters(), lr=0.002, accum_type=torch.float16)


def _conformer(target: int, replicas: int, accumulation: int, dtype=torch.float16):
    def build():
        with torch.device("meta"):
            model = vm.Conformer().to(dtype)
        opts = _options(target, replicas, accumulation, [0.3] * 4,
                        half_partials=dtype == torch.float16, optimizer_off_chip=False,
                        sharded_state=False, stage="SameAsIpu")
        opts.outputMode(poptorch.OutputMode.Final)
        opts.broadcastBuffers(False)  # the batch norms' statistics, per replica
        return model, opts, _adam_half(model), \
            model.example_inputs(4 * accumulation * replicas, dtype)
    return build


def _swin(embed, depths, heads, layers_per_ipu, replicas, accumulation, size=224,
          micro_batch=4):
    def build():
        config = transformers.SwinConfig(image_size=size, embed_dim=embed, depths=depths,
                                         num_heads=heads, window_size=7 if size == 224 else 12,
                                         drop_path_rate=0.2, num_labels=1000)
        with torch.device("meta"):
            net = transformers.SwinForImageClassification(config)
            blocks = torch.nn.ModuleList(b for layer in net.swin.encoder.layers
                                         for b in layer.blocks)
            vm.hf_pipelined(blocks, layers_per_ipu)
            i = 0
            for layer in net.swin.encoder.layers:
                for j in range(len(layer.blocks)):
                    layer.blocks[j] = blocks[i]
                    i += 1
            model = vm.ImageClassifier(net, size)
        # vision/swin/pytorch/options.py: available memory proportion 0.15 on every IPU,
        # AutoStage.SameAsIpu, float32 partials, optimizer state on chip without RTS
        opts = _options(21, replicas, accumulation, [0.15] * len(layers_per_ipu),
                        half_partials=False, optimizer_off_chip=False, sharded_state=False,
                        stage="SameAsIpu")
        adamw = poptorch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
        return model, opts, adamw, model.example_inputs(
            micro_batch * accumulation * replicas, torch.float32)
    return build


def _vit_finetune(accumulation: int, micro_batch: int = 17, classes: int = 1000):
    def build():
        config = transformers.ViTConfig(num_labels=classes, attn_implementation="eager")
        with torch.device("meta"):
            net = transformers.ViTForImageClassification(config)
            layers = net.vit.layers if hasattr(net.vit, "layers") else net.vit.encoder.layer
            vm.hf_pipelined(layers, [3, 3, 3, 3])
            model = vm.ImageClassifier(net).half()
        # vision/vit/pytorch args.py / configs.yml: float16 partials, optimizer state on
        # chip with RTS (enable_rts), separate gradient accumulator and velocity
        # (use_combined_accum false), device_iterations 8 for ImageNet-1k, 1 for CIFAR-10
        iterations = 8 if classes == 1000 else 1
        opts = _options(21, 4, accumulation, [0.3] * 4, optimizer_off_chip=False,
                        sharded_state=True, device_iterations=iterations, stage="SameAsIpu")
        sgd = poptorch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9,
                                 use_combined_accum=False)
        return model, opts, sgd, model.example_inputs(
            micro_batch * accumulation * 4 * iterations)
    return build


def _efficientnet(variant, group_dim, expand, splits, checkpoints, micro_batch,
                  replicas, accumulation, proportion, iterations=1):
    def build():
        with torch.device("meta"):
            model = vm.EfficientNet(variant, group_dim, expand, splits=splits,
                                    checkpoints=checkpoints).half()
        opts = _options(21, replicas, accumulation, [proportion] * (len(splits) + 1),
                        device_iterations=iterations, optimizer_off_chip=False,
                        sharded_state=group_dim == 16, stage="SameAsIpu")
        rmsprop = poptorch.optim.RMSprop(model.parameters(), lr=0.1, alpha=0.953125,
                                         eps=1e-3, momentum=0.9, weight_decay=1e-5)
        return model, opts, rmsprop, model.example_inputs(
            micro_batch * accumulation * replicas * iterations)
    return build


def _clip():
    with torch.device("meta"):
        model = vm.Clip().half()
    opts = _options(2, 1, 15, [0.2, 0.1, 0.2, 0.2, 0.6, 0.2, 0.4, 0.3],
                    optimizer_off_chip=False, sharded_state=False, stage="SameAsIpu")
    adamw = poptorch.optim.AdamW(model.parameters(), lr=1.1e-3, betas=(0.9, 0.98),
                                 eps=1e-6, weight_decay=0.2)
    return model, opts, adamw, model.example_inputs(46 * 15)


def _gcn():
    with torch.device("meta"):
        model = vm.ClusterGcn()
    opts = poptorch.Options().useOfflineIpuTarget(2).showCompilationProgressBar(False)
    opts.deviceIterations(4)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.005)
    return model, opts, adamw, model.example_inputs(4)


def _bert_mlm():
    import calibration_models as cm
    with torch.device("meta"):
        model = cm.BertPretraining(768, 12, 12, [1, 3, 4, 4], 128, 20).half()
    opts = _options(2, 4, 1640, [0.22] * 4)
    lamb = poptorch.optim.LAMB(model.parameters(), lr=1e-3, accum_type=torch.float16)
    return model, opts, lamb, model.example_inputs(10 * 1640 * 4)


def _impossible_swin():
    model, opts, _adamw, inputs = _swin(128, [2, 2, 18, 2], [4, 8, 16, 32], [24], 1, 8)()
    return model, opts, poptorch.optim.AdamW(model.parameters(), lr=1e-3), inputs


CHECKS = (
    Check("cnn-r1-synthetic", "small CNN", "tutorial CNN, float32, mb 16, 50 device "
          "iterations, synthetic data", True, 46739, "loop", TUTORIAL, _cnn(1, True),
          fitted=True),
    Check("cnn-r2-synthetic", "small CNN", "the same, 2 replicas", True, 46384, "loop",
          TUTORIAL, _cnn(2, True)),
    Check("cnn-r1-real", "small CNN", "the same, real data from an async DataLoader "
          "(37,710 samples/s alone)", True, 17956, "loop+loader", TUTORIAL,
          _cnn(1, False), loader=37710, fitted=True),
    Check("cnn-r2-real", "small CNN", "2 replicas, real data (DataLoader 42,605/s alone)",
          True, 14974, "loop+loader", TUTORIAL, _cnn(2, False), loader=42605),
    Check("conformer-m2000-pod4", "speech", "Conformer-medium, 4 IPUs, mb 4, GA 4032, "
          "IPU-M2000", True, 819, "loop", CONFORMER, _conformer(2, 1, 4032)),
    Check("conformer-m2000-pod16", "speech", "the same, 4 replicas, GA 1008", True, 3163,
          "loop", CONFORMER, _conformer(2, 4, 1008)),
    Check("conformer-bow-pod4", "speech", "Conformer-medium, 4 IPUs, GA 4032, Bow", True,
          1126, "loop", CONFORMER, _conformer(21, 1, 4032)),
    Check("conformer-bow-pod16", "speech", "the same, 4 replicas, GA 1008, Bow", True,
          4302, "loop", CONFORMER, _conformer(21, 4, 1008)),
    Check("conformer-m2000-pod64", "speech", "16 replicas, GA 252, IPU-M2000", True,
          11689, "loop", CONFORMER, _conformer(2, 16, 252),
          host_processes=4),
    Check("conformer-bow-pod64", "speech", "16 replicas, GA 252, Bow", True, 15815,
          "loop", CONFORMER, _conformer(21, 16, 252),
          host_processes=4),
    Check("conformer-train", "speech", "configs/train.yaml: 1 replica, GA 72, mb 4", True,
          None, "loop", f"{EXAMPLES} speech/conformer/pytorch/configs/train.yaml",
          _conformer(2, 1, 72)),
    Check("conformer-fp32", "speech", "float32, GA 72, mb 4 (run_wenet_conformer_fp32.sh)",
          True, None, "loop", f"{EXAMPLES} speech/conformer/pytorch/scripts",
          _conformer(2, 1, 72, torch.float32)),
    Check("swin-tiny", "Swin", "Swin-T 224, float32, [2,3,5,2], mb 4, GA 64, 4 replicas",
          True, 3779, "loop", f"{PERF}; {EXAMPLES} vision/swin/pytorch/configs/configs.yaml",
          _swin(96, [2, 2, 6, 2], [3, 6, 12, 24], [2, 3, 5, 2], 4, 64), seen=True),
    Check("swin-base", "Swin", "Swin-B 224, float32, 8 IPUs, mb 4, GA 128, 2 replicas",
          True, 1447, "loop", f"{PERF}; configs.yaml SWIN_BASE_LINEAR",
          _swin(128, [2, 2, 18, 2], [4, 8, 16, 32], [2, 2, 3, 3, 5, 5, 2, 2], 2, 128)),
    Check("swin-base-384", "Swin", "Swin-B 384, float32, 8 IPUs, mb 1, GA 512", True, None,
          "loop", f"{EXAMPLES} vision/swin/pytorch/configs/configs.yaml SWIN_BASE_384",
          _swin(128, [2, 2, 18, 2], [4, 8, 16, 32], [2, 2, 3, 3, 5, 5, 2, 2], 2, 512,
                size=384, micro_batch=1)),
    Check("swin-base-1ipu", "Swin", "Swin-B float32 on one IPU with AdamW (weights, "
          "moments: 88 M x 12 bytes)", False, None, "loop",
          "physics: 1.05 GB of weights and optimizer state > 0.94 GB", _impossible_swin),
    # configurations Graphcore moved to more IPUs or a smaller micro-batch: their
    # published layout next to the one that did not fit
    Check("swin-base-384-mb4", "Swin", "Swin-B 384 at the 224 run's micro-batch 4, 8 IPUs",
          False, None, "loop", f"{EXAMPLES} vision/swin/pytorch/configs/configs.yaml: "
          "SWIN_BASE_384 moved to micro-batch 1 (BATCH_SIZE 1, GA 512)",
          _swin(128, [2, 2, 18, 2], [4, 8, 16, 32], [2, 2, 3, 3, 5, 5, 2, 2], 2, 128,
                size=384, micro_batch=4)),
    Check("swin-large-fp32", "Swin", "Swin-L 224 fine-tuning, float32, 8 IPUs "
          "[3,4,4,4,4,3,1,1], mb 1, GA 2048, 2 replicas", True, None, "loop",
          f"{EXAMPLES} vision/swin/pytorch/configs/configs.yaml "
          "SWIN_LARGE_224_22K_FINETUNE_1K_FP32_POD16",
          _swin(192, [2, 2, 18, 2], [6, 12, 24, 48], [3, 4, 4, 4, 4, 3, 1, 1], 2, 2048,
                micro_batch=1)),
    Check("swin-large-fp32-mb6", "Swin", "the same at the float16 run's micro-batch 6",
          False, None, "loop", f"{EXAMPLES} vision/swin/pytorch/configs/configs.yaml: the "
          "float32 fine-tuning moved from the float16 run's BATCH_SIZE 6 to 1",
          _swin(192, [2, 2, 18, 2], [6, 12, 24, 48], [3, 4, 4, 4, 4, 3, 1, 1], 2, 683,
                micro_batch=6)),
    Check("vit-finetune", "ViT", "ViT-B/16 fine-tuning ImageNet-1k, mb 17, GA 30, "
          "4 replicas, SGD", True, 7319, "loop",
          f"{PERF}; {EXAMPLES} vision/vit/pytorch/configs.yml b16_imagenet1k",
          _vit_finetune(30), seen=True),
    Check("vit-cifar10", "ViT", "ViT-B/16 fine-tuning CIFAR-10, mb 17, GA 128", True,
          None, "loop", f"{EXAMPLES} vision/vit/pytorch/configs.yml b16_cifar10",
          _vit_finetune(128, classes=10)),
    Check("clip-b32", "multimodal", "CLIP ViT-B/32 on cc3m, 8 IPUs, mb 46, GA 15, AdamW",
          True, None, "loop", f"{EXAMPLES} multimodal/CLIP/pytorch/configs.yml, model.py",
          _clip),
    Check("cluster-gcn", "GNN", "Cluster-GCN GraphSAGE on Reddit, 1 IPU, 6 clusters a "
          "batch (taken as 1,000 nodes, 200,000 edges), 4 device iterations", True, None,
          "loop", f"{EXAMPLES} gnn/cluster_gcn/pytorch_geometric (tutorial)", _gcn),
    Check("bert-base-mlm", "BERT (optimum)", "BERT-Base MLM SL128, [1,3,4,4], mb 10, "
          "GA 1640, 4 replicas, matmul proportion 0.22", True, None, "loop",
          "github.com/huggingface/optimum-graphcore examples/language-modeling/README.md",
          _bert_mlm),
    Check("effnet-b4-g16", "EfficientNet", "EfficientNet-B4 G16 GN, 2 IPUs, mb 4, GA 64, "
          "8 replicas, 4 device iterations", True, 8263, "loop",
          f"{PERF}; {EXAMPLES} vision/cnns/pytorch/train/configs.yml",
          _efficientnet("b4", 16, 4, [(3, 0)], (1, 3), 4, 8, 64, 0.1, 4), seen=True,
          host_processes=2),  # benchmarks.yml: poprun --num-instances=2
    Check("effnet-b0-g16", "EfficientNet", "EfficientNet-B0 G16 GN, 2 IPUs, mb 20, GA 5, "
          "8 replicas", True, None, "loop", f"{EXAMPLES} vision/cnns/pytorch/train/configs.yml",
          _efficientnet("b0", 16, 4, [(3, 0)], (), 20, 8, 5, 0.15),
          host_processes=4),  # benchmarks.yml: poprun --num-instances=4
    Check("effnet-b4-g1", "EfficientNet", "EfficientNet-B4 depthwise (G1), 4 IPUs, mb 4, "
          "GA 48, 4 replicas", True, None, "loop",
          f"{EXAMPLES} vision/cnns/pytorch/train/configs.yml efficientnet-b4-g1-gn-pod16",
          _efficientnet("b4", 0, 6, [(1, 1), (3, 0), (4, 5)], (), 4, 4, 48, 0.15)),
)
