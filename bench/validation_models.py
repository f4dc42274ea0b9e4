"""Models of the IPU Model's validation set (``bench/validation.py``), built the way
Graphcore's code builds them, on the ``meta`` device (the estimates read shapes).

* :class:`TutorialCnn`: the small CNN of Graphcore's "Efficient data loading"
  tutorial (``tutorials/tutorials/pytorch/efficient_data_loading``), float32.
* :class:`Conformer`: WeNet's Conformer as ``speech/conformer/pytorch`` trains it
  (12 macaron encoder blocks with relative-position attention and a depthwise 1-D
  convolution module, a 6-layer attention decoder, CTC and attention losses), placed
  by ``ipu_options.pipeline`` of its ``configs/train.yaml``. Graphcore's CTC loss is a
  custom op; here it is the log-softmax over the frames and a gather of the targets
  (the same tensors and work up to the loss's own recursion, which is small).
* :class:`EfficientNet`: EfficientNet with Graphcore's ``efficientnet_group_dim``
  (grouped instead of depthwise 3×3 / 5×5 convolutions, 16 channels per group),
  ``efficientnet_expand_ratio`` and group norm (``vision/cnns/pytorch``).
* :class:`Clip`: CLIP ViT-B/32 placed as ``multimodal/CLIP/pytorch`` places it.
* :class:`ClusterGcn`: the two-layer GraphSAGE of the Cluster-GCN tutorial.
* :func:`hf_pipelined`: a Hugging Face model (Swin, ViT) split by
  ``layers_per_ipu`` with one ``poptorch.BeginBlock`` per layer and a
  recomputation checkpoint on each layer's output, as Graphcore's ``pipeline_model``
  helpers do.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

from calibration_models import checkpoint_outputs, layer_ipus

__all__ = ["TutorialCnn", "Conformer", "EfficientNet", "hf_pipelined", "ImageClassifier",
           "Clip", "ClusterGcn"]


class TutorialCnn(nn.Module):
    """The tutorial's ``ClassificationModel`` (128 × 128 single-channel images, 10
    classes); ``forward(x, labels)`` returns the log-probabilities and the loss."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 5, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(5, 12, 5)
        self.norm = nn.GroupNorm(3, 12)
        self.fc1 = nn.Linear(41772, 100)
        self.fc2 = nn.Linear(100, 10)

    def forward(self, x, labels):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.norm(F.relu(self.conv2(x)))
        x = F.relu(self.fc1(torch.flatten(x, start_dim=1)))
        x = F.log_softmax(self.fc2(x), dim=0)
        return x, F.nll_loss(x, labels)

    @staticmethod
    def example_inputs(samples: int):
        return (torch.zeros(samples, 1, 128, 128, device="meta"),
                torch.zeros(samples, dtype=torch.int64, device="meta"))


# -- Conformer ---------------------------------------------------------------------

class _FeedForward(nn.Sequential):
    def __init__(self, d: int, hidden: int):
        super().__init__(nn.Linear(d, hidden), nn.SiLU(), nn.Dropout(0.1),
                         nn.Linear(hidden, d))


class _RelPosAttention(nn.Module):
    """WeNet's ``RelPositionMultiHeadedAttention``: scores ``(q + u) kᵀ + (q + v) pᵀ``."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.h, self.dk = heads, d // heads
        self.q, self.k, self.v, self.out = (nn.Linear(d, d) for _ in range(4))
        self.pos = nn.Linear(d, d, bias=False)
        self.u = nn.Parameter(torch.zeros(heads, self.dk))
        self.w = nn.Parameter(torch.zeros(heads, self.dk))

    def _heads(self, x):
        return x.view(x.shape[0], -1, self.h, self.dk)

    def forward(self, x, pos, mask):
        q = self._heads(self.q(x))
        k, v = (self._heads(f(x)).transpose(1, 2) for f in (self.k, self.v))
        p = self._heads(self.pos(pos)).transpose(1, 2)
        ac = torch.matmul((q + self.u).transpose(1, 2), k.transpose(-2, -1))
        bd = torch.matmul((q + self.w).transpose(1, 2), p.transpose(-2, -1))
        scores = (ac + bd) / math.sqrt(self.dk) + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.out(out.transpose(1, 2).reshape(x.shape))


class _ConvModule(nn.Module):
    """Pointwise conv → GLU → depthwise 1-D conv → batch norm → swish → pointwise."""

    def __init__(self, d: int, kernel: int):
        super().__init__()
        self.pw1 = nn.Conv1d(d, 2 * d, 1)
        self.dw = nn.Conv1d(d, d, kernel, padding=kernel // 2, groups=d)
        self.norm = nn.BatchNorm1d(d)
        self.pw2 = nn.Conv1d(d, d, 1)

    def forward(self, x):
        x = F.glu(self.pw1(x.transpose(1, 2)), dim=1)
        x = self.pw2(F.silu(self.norm(self.dw(x))))
        return x.transpose(1, 2)


class _ConformerBlock(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int, kernel: int):
        super().__init__()
        self.ff1, self.ff2 = _FeedForward(d, hidden), _FeedForward(d, hidden)
        self.att = _RelPosAttention(d, heads)
        self.conv = _ConvModule(d, kernel)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(5))

    def forward(self, x, pos, mask):
        n = self.norms
        x = x + 0.5 * self.ff1(n[0](x))
        x = x + self.att(n[1](x), pos, mask)
        x = x + self.conv(n[2](x))
        x = x + 0.5 * self.ff2(n[3](x))
        return n[4](x)


class _DecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.self_att = nn.MultiheadAttention(d, heads, batch_first=True)
        self.src_att = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ff = _FeedForward(d, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(3))

    def forward(self, y, memory, causal):
        n = self.norms
        h = n[0](y)
        y = y + self.self_att(h, h, h, attn_mask=causal, need_weights=False)[0]
        h = n[1](y)
        y = y + self.src_att(h, memory, memory, need_weights=False)[0]
        return y + self.ff(n[2](y))


class _Encoder(nn.Module):
    def __init__(self, d, heads, hidden, kernel, blocks, features):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.ReLU(), nn.Conv2d(d, d, 3, 2),
                                  nn.ReLU())
        sub = ((features - 1) // 2 - 1) // 2
        self.embed = nn.Linear(d * sub, d)
        self.pos = nn.Parameter(torch.zeros(1, 1, d))
        self.encoders = nn.ModuleList(_ConformerBlock(d, heads, hidden, kernel)
                                      for _ in range(blocks))

    def forward(self, x):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.embed(x.transpose(1, 2).reshape(b, t, c * f)) * math.sqrt(c)
        pos = self.pos.expand(1, t, c)
        mask = torch.zeros(b, 1, 1, t, dtype=x.dtype, device=x.device)
        for block in self.encoders:
            x = block(x, pos, mask)
        return x


class Conformer(nn.Module):
    """WeNet's Conformer-medium of Graphcore's ``configs/train.yaml`` (256 wide, 4
    heads, 2048 hidden, kernel 15, 12 encoder and 6 decoder blocks, 4233 tokens,
    80 filter banks × 1220 frames, 48 target tokens, CTC weight 0.3).
    ``pipeline``: ``(encoder block index, IPU)`` start points, as
    ``ipu_options.pipeline``. ``forward(features, tokens, targets)`` returns the
    loss."""

    def __init__(self, pipeline: Sequence = ((2, 1), (6, 2), (11, 3)), d: int = 256,
                 heads: int = 4, hidden: int = 2048, kernel: int = 15, blocks: int = 12,
                 decoder_blocks: int = 6, vocab: int = 4233, features: int = 80,
                 frames: int = 1220, tokens: int = 48):
        super().__init__()
        self.frames, self.features, self.tokens = frames, features, tokens
        self.encoder = _Encoder(d, heads, hidden, kernel, blocks, features)
        self.ctc = nn.Linear(d, vocab)
        self.embed = nn.Embedding(vocab, d)
        self.decoders = nn.ModuleList(_DecoderLayer(d, heads, hidden)
                                      for _ in range(decoder_blocks))
        self.out = nn.Linear(d, vocab)
        last = 0
        starts = dict(pipeline)
        for index in range(blocks):
            last = starts.get(index, last)
            self.encoder.encoders[index] = poptorch.BeginBlock(
                self.encoder.encoders[index], f"encoder{index}", ipu_id=last)
        self.embed = poptorch.BeginBlock(self.embed, "decoder", ipu_id=last)

    def forward(self, features, tokens, targets):
        memory = self.encoder(features)
        ctc = F.log_softmax(self.ctc(memory).float(), dim=-1)
        ctc_loss = -ctc.gather(-1, targets[:, :1, None].expand(-1, ctc.shape[1], 1)).mean()
        y = self.embed(tokens)
        t = tokens.shape[1]
        causal = torch.triu(torch.full((t, t), -1e4, dtype=y.dtype, device=y.device), 1)
        for layer in self.decoders:
            y = layer(y, memory, causal)
        logits = self.out(y).float()
        att_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   label_smoothing=0.1)
        return poptorch.identity_loss(0.3 * ctc_loss + 0.7 * att_loss, reduction="none")

    def example_inputs(self, samples: int, dtype=torch.float16):
        ints = lambda: torch.zeros(samples, self.tokens, dtype=torch.int64,  # noqa: E731
                                   device="meta")
        return (torch.zeros(samples, self.frames, self.features, dtype=dtype, device="meta"),
                ints(), ints())


# -- EfficientNet ------------------------------------------------------------------

#: EfficientNet-B0's stages: (expand, kernel, stride, channels, repeats).
_B0 = ((1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
       (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1))
#: (width, depth, resolution) of each variant.
EFFICIENTNET = {"b0": (1.0, 1.0, 224), "b4": (1.4, 1.8, 380)}


def _round(channels: float, divisor: int = 8) -> int:
    return max(divisor, int(channels + divisor / 2) // divisor * divisor)


class _MBConv(nn.Module):
    def __init__(self, cin, cout, expand, kernel, stride, group_dim, groups_norm):
        super().__init__()
        mid = cin * expand
        self.expand = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False),
                                    nn.GroupNorm(groups_norm, mid), nn.SiLU()) \
            if expand != 1 else nn.Identity()
        groups = mid // group_dim if group_dim else mid
        self.conv = nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=groups,
                              bias=False)
        self.bn2 = nn.GroupNorm(groups_norm, mid)
        squeeze = max(1, cin // 4)
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(mid, squeeze, 1),
                                nn.SiLU(), nn.Conv2d(squeeze, mid, 1), nn.Sigmoid())
        self.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False),
                                     nn.GroupNorm(groups_norm, cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = F.silu(self.bn2(self.conv(self.expand(x))))
        y = self.project(y * self.se(y))
        return x + y if self.residual else y


class EfficientNet(nn.Module):
    """EfficientNet ``variant`` with Graphcore's options: ``group_dim`` channels per
    group of the spatial convolutions (0: depthwise), ``expand`` instead of the
    stages' 6, group norm with ``norm_groups``; ``splits``: the ``(stage, block)``
    where each next IPU starts (``pipeline_splits``); ``checkpoints``: indices of the residual
    adds that are recomputation checkpoints; uint8 images normalised on the IPU."""

    def __init__(self, variant: str = "b4", group_dim: int = 16, expand: int = 4,
                 norm_groups: int = 4, splits: Sequence = ((3, 0),),
                 checkpoints: Sequence[int] = (), classes: int = 1000):
        super().__init__()
        width, depth, self.resolution = EFFICIENTNET[variant]
        stem = _round(32 * width)
        self.stem = nn.Sequential(nn.Conv2d(3, stem, 3, 2, 1, bias=False),
                                  nn.GroupNorm(norm_groups, stem), nn.SiLU())
        blocks: List[nn.Module] = []
        cin, adds = stem, 0
        self.checkpointed: List[int] = []
        for stage, (e, k, s, c, n) in enumerate(_B0):
            cout = _round(c * width)
            for i in range(int(math.ceil(n * depth))):
                block = _MBConv(cin, cout, expand if e != 1 else 1, k, s if i == 0 else 1,
                                group_dim, norm_groups)
                if block.residual:
                    if adds in checkpoints:
                        checkpoint_outputs(block)
                    adds += 1
                if (stage, i) in [tuple(x) for x in splits]:
                    ipu = [tuple(x) for x in splits].index((stage, i)) + 1
                    block = poptorch.BeginBlock(block, f"split{ipu}", ipu_id=ipu)
                blocks.append(block)
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        head = _round(1280 * width)
        self.head = nn.Sequential(nn.Conv2d(cin, head, 1, bias=False),
                                  nn.GroupNorm(norm_groups, head), nn.SiLU())
        self.fc = nn.Linear(head, classes)

    def forward(self, images, labels):
        x = (images.to(self.fc.weight.dtype) / 255.0 - 0.45) / 0.225
        x = self.head(self.blocks(self.stem(x))).mean((2, 3))
        loss = F.cross_entropy(self.fc(x).float(), labels, label_smoothing=0.1)
        return poptorch.identity_loss(loss, reduction="none")

    def example_inputs(self, samples: int):
        r = self.resolution
        return (torch.zeros(samples, 3, r, r, dtype=torch.uint8, device="meta"),
                torch.zeros(samples, dtype=torch.int64, device="meta"))


# -- Hugging Face models, pipelined ------------------------------------------------

def hf_pipelined(layers: nn.ModuleList, layers_per_ipu: Sequence[int],
                 checkpoint: bool = True) -> None:
    """One ``BeginBlock`` per layer of ``layers`` on the IPU ``layers_per_ipu`` gives
    it, a recomputation checkpoint on each layer's output (Graphcore's
    ``recompute_checkpoint_every_layer``)."""
    ipus = layer_ipus(layers_per_ipu)
    for index, layer in enumerate(layers):
        if checkpoint:
            checkpoint_outputs(layer)
        layers[index] = poptorch.BeginBlock(layer, f"layer{index}", ipu_id=ipus[index])


class ImageClassifier(nn.Module):
    """A Hugging Face image classifier (``...ForImageClassification``) whose
    ``forward(images, labels)`` returns the loss (computed in float32, as Graphcore's
    wrappers do)."""

    def __init__(self, model: nn.Module, image_size: int = 224):
        super().__init__()
        self.model = model
        self.image_size = image_size

    def forward(self, images, labels):
        logits = self.model(pixel_values=images, return_dict=False)[0]
        loss = F.cross_entropy(logits.float(), labels)
        return poptorch.identity_loss(loss, reduction="none")

    def example_inputs(self, samples: int, dtype=torch.float16):
        s = self.image_size
        return (torch.zeros(samples, 3, s, s, dtype=dtype, device="meta"),
                torch.zeros(samples, dtype=torch.int64, device="meta"))


class Clip(nn.Module):
    """CLIP ViT-B/32 as ``multimodal/CLIP/pytorch`` places it (``parallelize``): the
    image encoder's 12 layers on IPUs 0-4 as ``[1, 3, 3, 3, 2]``, the token
    embedding and text layer 0 on IPU 5, text layers 1-5 on IPU 6, 6-11 and the
    contrastive loss on IPU 7, a checkpoint after every layer.
    ``forward(images, texts)`` returns the loss."""

    def __init__(self, context: int = 77):
        super().__init__()
        import transformers
        config = transformers.CLIPConfig(
            text_config={"hidden_size": 512, "num_hidden_layers": 12,
                         "num_attention_heads": 8, "intermediate_size": 2048,
                         "max_position_embeddings": context, "vocab_size": 49408},
            vision_config={"hidden_size": 768, "num_hidden_layers": 12,
                           "num_attention_heads": 12, "intermediate_size": 3072,
                           "patch_size": 32, "image_size": 224},
            projection_dim=512)
        config._attn_implementation = "eager"
        self.model = transformers.CLIPModel(config)
        self.context = context
        vision = self.model.vision_model.encoder.layers
        hf_pipelined(vision, [1, 3, 3, 3, 2])
        text = self.model.text_model
        text.embeddings = poptorch.BeginBlock(text.embeddings, "embedding", ipu_id=5)
        ipus = [5] + [6] * 5 + [7] * 6
        for index, layer in enumerate(text.encoder.layers):
            checkpoint_outputs(layer)
            text.encoder.layers[index] = poptorch.BeginBlock(layer, f"text{index}",
                                                             ipu_id=ipus[index])

    def forward(self, images, texts):
        m = self.model  # the image encoder first, as Graphcore's model runs it
        image = m.visual_projection(m.vision_model(pixel_values=images).pooler_output)
        t = m.text_model
        hidden = t.embeddings(input_ids=texts)
        length = hidden.shape[1]
        causal = torch.full((length, length), -1e4, dtype=hidden.dtype,
                            device=hidden.device).triu(1)[None, None]
        hidden = t.final_layer_norm(t.encoder(inputs_embeds=hidden, attention_mask=causal
                                              ).last_hidden_state)
        # Graphcore's pooling: the output at the end-of-text token, the largest id
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        text = m.text_projection(hidden[rows, texts.argmax(dim=-1)])
        image = image / image.norm(dim=-1, keepdim=True)
        text = text / text.norm(dim=-1, keepdim=True)
        logits = (m.logit_scale.exp() * text @ image.t()).float()
        labels = torch.arange(logits.shape[0], device=logits.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        return poptorch.identity_loss(loss, reduction="none")

    def example_inputs(self, samples: int):
        return (torch.zeros(samples, 3, 224, 224, dtype=torch.float16, device="meta"),
                torch.zeros(samples, self.context, dtype=torch.int64, device="meta"))


class ClusterGcn(nn.Module):
    """The two ``SAGEConv`` layers (mean aggregation) of Graphcore's Cluster-GCN
    tutorial (``gnn/cluster_gcn/pytorch_geometric``: Reddit, 602 features, 41 classes,
    128 hidden), written with ``index_select`` / ``index_add`` as PyG's message
    passing runs them, on a fixed-size batch of ``nodes`` and ``edges``.
    ``forward(x, edges, mask, target)`` (``edges``: ``[E, 2]``, the batch dimension
    first) returns the log-probabilities and the loss."""

    def __init__(self, features: int = 602, hidden: int = 128, classes: int = 41,
                 nodes: int = 1000, edges: int = 200_000):
        super().__init__()
        self.nodes, self.edges, self.features = nodes, edges, features
        self.lin_l1, self.lin_r1 = nn.Linear(features, hidden), nn.Linear(features, hidden,
                                                                          bias=False)
        self.lin_l2, self.lin_r2 = nn.Linear(hidden, classes), nn.Linear(hidden, classes,
                                                                         bias=False)

    def _sage(self, x, edge_index, lin_l, lin_r):
        messages = x.index_select(0, edge_index[0])
        summed = torch.zeros_like(x).index_add(0, edge_index[1], messages)
        count = torch.zeros(x.shape[0], 1, dtype=x.dtype, device=x.device).index_add(
            0, edge_index[1], torch.ones(edge_index.shape[1], 1, dtype=x.dtype,
                                         device=x.device))
        return lin_l(summed / count.clamp(min=1)) + lin_r(x)

    def forward(self, x, edges, mask, target):
        edge_index = edges.t()  # [edges, 2]: the batch dimension first
        x = F.relu(self._sage(x, edge_index, self.lin_l1, self.lin_r1))
        x = F.log_softmax(self._sage(x, edge_index, self.lin_l2, self.lin_r2), dim=-1)
        target = torch.where(mask, target, torch.full_like(target, -100))
        return x, F.nll_loss(x, target)

    def example_inputs(self, samples: int = 1):
        n, e = self.nodes * samples, self.edges * samples
        return (torch.zeros(n, self.features, device="meta"),
                torch.zeros(e, 2, dtype=torch.int64, device="meta"),
                torch.zeros(n, dtype=torch.bool, device="meta"),
                torch.zeros(n, dtype=torch.int64, device="meta"))
