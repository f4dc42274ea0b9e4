"""Multi-IPU execution follows the stage schedule and computes what the unpartitioned
model computes (docs/semantics.md S-60, S-63, S-65): pipelined, sharded and phased models,
with replication, against plain PyTorch training on the same weights and data."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch
from popart_compiler.runtime import schedule


class TinyBert(nn.Module):
    """Embeddings, two encoder layers and a masked-LM head (tiny dimensions)."""

    def __init__(self, vocab=24, dim=16, seq=5):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(seq, dim) * 0.1)
        self.norm = nn.LayerNorm(dim)
        self.encoder = nn.ModuleList([
            nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
            for _ in range(2)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, labels):
        x = self.norm(self.embeddings(tokens) + self.positions)
        for layer in self.encoder:
            x = layer(x)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def train_plain(model, batches, lr):
    """Plain PyTorch: one SGD step per combined batch (the mean loss over all the
    micro-batches of a weight update equals the mean over the combined batch)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for args in batches:
        opt.zero_grad()
        loss = model(*args)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def train_ipu(model, opts, batches, lr):
    wrapper = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=lr))
    for args in batches:
        wrapper(*args)
    return wrapper


def assert_same_weights(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def bert_batches(steps, rows, vocab=24, seq=5):
    return [(torch.randint(0, vocab, (rows, seq)), torch.randint(0, vocab, (rows, seq)))
             for _ in range(steps)]


def test_four_ipu_bert_pipeline_trains_like_plain_pytorch():
    model = TinyBert()
    ref = copy.deepcopy(model)
    poptorch.BeginBlock(model.embeddings, "embeddings", ipu_id=0)
    poptorch.BeginBlock(model.encoder[0], "encoder0", ipu_id=1)
    poptorch.BeginBlock(model.encoder[1], "encoder1", ipu_id=2)
    poptorch.BeginBlock(model.head, "head", ipu_id=3)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(7)
    batches = bert_batches(2, 7 * 2)
    wrapper = train_ipu(model, opts, batches, lr=0.05)
    exe = wrapper._state.executable
    assert exe.staged and exe.placement.pipelined and exe.placement.pipeline_stages == 7
    assert exe.num_ipus == 4
    train_plain(ref, batches, lr=0.05)
    assert_same_weights(model, ref)


def test_two_ipu_named_block_pipeline_with_replication():
    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
            self.decoder = nn.Linear(8, 3)

        def forward(self, x, t):
            with poptorch.Block("encoder", ipu_id=0):
                h = self.encoder(x)
            with poptorch.Block("decoder", ipu_id=1):
                return F.cross_entropy(self.decoder(h), t)

    model = EncoderDecoder()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().replicationFactor(2).setExecutionStrategy(
        poptorch.PipelinedExecution("encoder", "decoder"))
    opts.Training.gradientAccumulation(3)
    batches = [(torch.randn(3 * 2 * 4, 6), torch.randint(0, 3, (24,))) for _ in range(3)]
    wrapper = train_ipu(model, opts, batches, lr=0.1)
    assert wrapper._state.executable.num_ipus == 4  # 2 IPUs per replica × 2 replicas
    train_plain(ref, batches, lr=0.1)
    assert_same_weights(model, ref)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])

    def forward(self, x, t):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, t)


@pytest.mark.parametrize("strategy", [
    lambda: poptorch.ShardedExecution(),
    lambda: poptorch.SerialPhasedExecution(["b0"], ["b1"], ["b2"]),
    lambda: poptorch.ParallelPhasedExecution(
        poptorch.Phase(poptorch.Stage("b0").ipu(0)), poptorch.Phase(poptorch.Stage("b1").ipu(1)),
        poptorch.Phase(poptorch.Stage("b2").ipu(2))),
], ids=["sharded", "serial_phased", "parallel_phased"])
def test_sharded_and_phased_training_with_replication(strategy):
    model = Chain()
    ref = copy.deepcopy(model)
    for i, layer in enumerate(model.layers):
        poptorch.BeginBlock(layer, f"b{i}", ipu_id=[0, 1, 0][i])
    opts = poptorch.Options().replicationFactor(2).setExecutionStrategy(strategy())
    opts.Training.gradientAccumulation(2)
    batches = [(torch.randn(2 * 2 * 3, 6), torch.randn(12, 6)) for _ in range(2)]
    wrapper = train_ipu(model, opts, batches, lr=0.1)
    assert wrapper._state.executable.staged and not wrapper._state.executable.placement.pipelined
    train_plain(ref, batches, lr=0.1)
    assert_same_weights(model, ref)


def test_pipelined_inference_matches_the_model():
    model = nn.Sequential(*[nn.Linear(5, 5) for _ in range(3)])
    for i, layer in enumerate(model):
        poptorch.BeginBlock(layer, f"s{i}", ipu_id=i)
    opts = poptorch.Options().deviceIterations(4).replicationFactor(2)
    x = torch.randn(4 * 2 * 3, 5)
    out = poptorch.inferenceModel(model, opts)(x)
    torch.testing.assert_close(out, model(x))


def test_pipeline_schedule_order():
    """Clock t runs stage s on micro-batch t − s (fill, steady state, drain)."""
    assert schedule.stage_order(3, 4, True) == [
        (0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0), (0, 3), (1, 2), (2, 1),
        (1, 3), (2, 2), (2, 3)]
    assert schedule.stage_order(2, 2, False) == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_micro_batches_flow_through_the_stages_in_pipeline_order(monkeypatch):
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    for i, layer in enumerate(model):
        poptorch.BeginBlock(layer, f"s{i}", ipu_id=i)
    wrapper = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(3))
    x = torch.randn(3, 4)
    wrapper.compile(x)
    staged = wrapper._state.session._staged
    visits = []
    run_stage = staged._run_stage

    def record(env, rank):
        micro = env[staged._placeholders[-1]]
        visits.append((rank, next(k for k in range(3) if torch.equal(micro, x[k:k + 1]))))
        run_stage(env, rank)
    monkeypatch.setattr(staged, "_run_stage", record)
    torch.testing.assert_close(wrapper(x), model(x))
    assert visits == schedule.stage_order(3, 3, True)
