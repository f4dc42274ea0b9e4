"""ResNet-50 v1.5 written from its description, for the IPU Model's calibration
(``bench/calibration.py``; torchvision is not installable here).

He et al. (2016), v1.5 (stride on the 3×3 convolution of each bottleneck), with the
options of Graphcore's ``vision/cnns/pytorch`` configuration: recomputation
checkpoints on chosen residual adds (``poptorch.recomputationCheckpoint``), blocks
whose every output is a checkpoint, 8-bit input normalised on the device and label
smoothing. Meant to be built on the ``meta`` device: the estimates read shapes only.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

__all__ = ["ResNet50"]


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int, keep_all: bool = False):
        super().__init__()
        cout = width * 4
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))
        self.keep_all = keep_all

    def forward(self, x):
        keep = poptorch.recomputationCheckpoint if self.keep_all else (lambda t: t)
        y = F.relu(keep(self.bn1(keep(self.conv1(x)))))
        y = F.relu(keep(self.bn2(keep(self.conv2(y)))))
        y = keep(self.bn3(keep(self.conv3(y))))
        return F.relu(y + (x if self.down is None else keep(self.down(x))))


class ResNet50(nn.Module):
    """ResNet-50 v1.5 for 224×224 ImageNet images; ``forward(images, labels)`` returns
    the cross-entropy loss (``images``: ``[B, 3, 224, 224]`` float16, or uint8 with
    ``eight_bit_input``; ``labels``: ``[B]``).

    Args:
        classes: output classes.
        checkpoint_stages: a recomputation checkpoint after every bottleneck.
        checkpoint_blocks: bottlenecks (0 … 15) whose residual add is checkpointed.
        keep_blocks: bottlenecks whose every convolution and norm output is a
            checkpoint (nothing recomputed there).
        eight_bit_input: images arrive as uint8 and are normalised on the device
            (Graphcore's ``eight_bit_io`` with ``normalization_location: ipu``).
        label_smoothing: of the cross-entropy loss.
    """

    def __init__(self, classes: int = 1000, checkpoint_stages: bool = False,
                 checkpoint_blocks: Sequence[int] = (), keep_blocks: Sequence[int] = (),
                 eight_bit_input: bool = False, label_smoothing: float = 0.0):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks: List[nn.Module] = []
        cin = 64
        for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(_Bottleneck(cin, width, stride if i == 0 else 1,
                                          keep_all=len(blocks) in keep_blocks))
                cin = width * 4
        self.layers = nn.ModuleList(blocks)
        self.fc = nn.Linear(cin, classes)
        self.checkpointed = set(range(len(blocks))) if checkpoint_stages else \
            set(checkpoint_blocks) | set(keep_blocks)
        self.eight_bit_input = eight_bit_input
        self.label_smoothing = label_smoothing

    def forward(self, images, labels):
        if self.eight_bit_input:
            weight = self.fc.weight
            images = (images.to(weight.dtype) / 255.0 - 0.45) / 0.225
        x = self.stem(images)
        for index, block in enumerate(self.layers):
            x = block(x)
            if index in self.checkpointed:
                x = poptorch.recomputationCheckpoint(x)
        logits = self.fc(x.mean((2, 3)))
        return F.cross_entropy(logits.float(), labels, label_smoothing=self.label_smoothing)

    def example_inputs(self, micro_batch: int, dtype=torch.float16, device="meta"):
        dtype = torch.uint8 if self.eight_bit_input else dtype
        return (torch.zeros(micro_batch, 3, 224, 224, dtype=dtype, device=device),
                torch.zeros(micro_batch, dtype=torch.int64, device=device))
