"""Replication with input replica groups and replica-grouped weights
(docs/api-sections.md api §5.22; docs/semantics.md S-25…S-27, S-36, S-41)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

CGT = poptorch.CommGroupType
VRM = poptorch.VariableRetrievalMode


def replica_groups(kind, shards, r):
    """Group index of each replica per docs/semantics.md S-27."""
    if kind == CGT.All:
        return [0] * r
    if kind == CGT.NoGrouping:
        return list(range(r))
    if kind == CGT.Consecutive:
        return [i // shards for i in range(r)]
    return [i % (r // shards) for i in range(r)]


# -- input replica grouping (docs/semantics.md S-26)
# --------------------------------------------------------

class RowSums(nn.Module):
    def forward(self, x):
        return x.sum()


@pytest.mark.parametrize("kind", [CGT.Consecutive, CGT.Orthogonal])
def test_input_replica_groups_share_streams(kind):
    """docs/semantics.md S-26 example scaled to R=4, groups of 2, B=3: the input has 2×3 rows; each
    replica sums the rows of its stream; a scalar output returns one value per
    replica."""
    opts = poptorch.Options().replicationFactor(4).inputReplicaGrouping(2, kind)
    x = torch.arange(6.).reshape(6, 1)
    out = poptorch.inferenceModel(RowSums(), opts)(x)
    streams = [x[:3].sum(), x[3:].sum()]
    stream_of = [0, 0, 1, 1] if kind == CGT.Consecutive else [0, 1, 0, 1]
    assert out.tolist() == [streams[s].item() for s in stream_of]


def test_training_with_input_groups_matches_plain_pytorch():
    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x, t):
            return F.mse_loss(self.fc(x), t)

    model = Lin()
    ref = copy.deepcopy(model)
    opts = poptorch.Options().replicationFactor(4).inputReplicaGrouping(
        2, CGT.Orthogonal)
    opts.Training.gradientAccumulation(2)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                   lr=0.1))
    x, t = torch.randn(2 * 2 * 2, 3), torch.randn(8, 1)  # A × G × B rows
    training(x, t)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        for rep in range(4):
            row = (step * 2 + rep % 2) * 2
            (F.mse_loss(ref.fc(x[row:row + 2]), t[row:row + 2]) / 8).backward()
    opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


# -- replica-grouped weights (docs/semantics.md S-27)
# --------------------------------------------------------

class Grouped(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.W = nn.Parameter(w)
        self.fc = nn.Linear(w.shape[-1], 1)

    def forward(self, x, t=None):
        out = self.fc(x @ self.W)
        if t is None:
            return out
        return out, F.mse_loss(out, t)


def test_proxy_and_per_replica_params():
    model = Grouped(torch.randn(2, 3, 4))
    inference = poptorch.inferenceModel(model, poptorch.Options().replicationFactor(4))
    proxy = inference.W
    assert not isinstance(proxy, torch.Tensor)
    assert proxy.shape == (2, 3, 4) and proxy.requires_grad
    assert isinstance(inference.fc.weight, torch.nn.Parameter)  # nested: a real one
    assert not hasattr(inference.fc.weight, "replicaGrouping")
    proxy.replicaGrouping(CGT.Consecutive, 2, VRM.OnePerGroup)
    assert inference.per_replica_params == {"W": (CGT.Consecutive, 2, VRM.OnePerGroup)}
    with pytest.raises(AssertionError, match="CommGroupType"):
        proxy.replicaGrouping(2, 2, VRM.OnePerGroup)
    inference(torch.randn(4, 3))
    with pytest.raises(poptorch.Error, match="before the model is compiled"):
        inference.W.replicaGrouping(CGT.Orthogonal, 2, VRM.OnePerGroup)


@pytest.mark.parametrize("kind,shards,groups", [
    (CGT.Consecutive, 2, 2), (CGT.Orthogonal, 2, 2), (CGT.All, 4, 1),
    (CGT.NoGrouping, 1, 4)])
def test_inference_uses_each_groups_value(kind, shards, groups):
    r = 4
    w = torch.randn(groups, 3, 4)
    model = Grouped(w.clone())
    inference = poptorch.inferenceModel(model, poptorch.Options().replicationFactor(r))
    inference.W.replicaGrouping(kind, shards, VRM.OnePerGroup)
    x = torch.randn(r * 2, 3)
    out = inference(x)
    with torch.no_grad():
        expected = torch.cat([model.fc(x[2 * i:2 * i + 2] @ w[g])
                              for i, g in enumerate(replica_groups(kind, shards, r))])
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("kind", [CGT.Consecutive, CGT.Orthogonal])
def test_training_reduces_within_groups_and_divides_by_a_times_r(kind):
    """docs/semantics.md S-27/S-41: W_g gets Σ over its replicas' micro-batches / (A × R); the
    ungrouped fc is reduced over all replicas. OnePerGroup brings [G, ...] back; the optimizer state
    has the group dimension."""
    r, a, shards = 4, 2, 2
    w = torch.randn(2, 3, 4)
    model = Grouped(w.clone())
    ref_w = [w[g].clone().requires_grad_() for g in range(2)]
    ref_fc = copy.deepcopy(model.fc)
    opts = poptorch.Options().replicationFactor(r)
    opts.Training.gradientAccumulation(a)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    training = poptorch.trainingModel(model, opts, opt)
    training.W.replicaGrouping(kind, shards, VRM.OnePerGroup)
    ref_opt = torch.optim.SGD(ref_w + list(ref_fc.parameters()), lr=0.1, momentum=0.9)
    groups = replica_groups(kind, shards, r)
    for call in range(3):
        x, t = torch.randn(a * r * 2, 3), torch.randn(a * r * 2, 1)
        training(x, t)
        ref_opt.zero_grad()
        for step in range(a):
            for rep in range(r):
                row = (step * r + rep) * 2
                out = ref_fc(x[row:row + 2] @ ref_w[groups[rep]])
                (F.mse_loss(out, t[row:row + 2]) / (a * r)).backward()
        ref_opt.step()
    assert model.W.shape == (2, 3, 4)
    torch.testing.assert_close(model.W.detach(), torch.stack(ref_w).detach(),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.fc.weight.detach(), ref_fc.weight.detach(),
                               rtol=1e-5, atol=1e-6)
    assert opt.state_dict()["ipu_state"]["Accl___W"].shape == (2, 3, 4)
    assert opt.state_dict()["ipu_state"]["Accl___fc.weight"].shape == (1, 4)


def test_all_replicas_retrieval_returns_one_value_per_replica():
    r = 4
    w = torch.randn(2, 3, 4)
    model = Grouped(w.clone())
    training = poptorch.trainingModel(model, poptorch.Options().replicationFactor(r),
                                      poptorch.optim.Adam(model.parameters(), lr=0.01))
    training.W.replicaGrouping(CGT.Orthogonal, 2, VRM.AllReplicas)
    x, t = torch.randn(r * 2, 3), torch.randn(r * 2, 1)
    training(x, t)
    assert model.W.shape == (r, 3, 4)  # host now holds one value per replica
    torch.testing.assert_close(model.W[0], model.W[2])  # replicas 0 and 2: group 0
    torch.testing.assert_close(model.W[1], model.W[3])
    assert not torch.equal(model.W[0], model.W[1])
    state = training._state.binding.optimizer.state_dict()["ipu_state"]
    assert state["Accl1___W"].shape == (2, 3, 4)
    training.copyWeightsToDevice()  # [R, ...] host values are accepted back
    training(x, t)


def test_replica_grouping_errors():
    opts = poptorch.Options().replicationFactor(4)
    scalar = nn.Module()
    scalar.s = nn.Parameter(torch.tensor(2.0))
    scalar.forward = lambda x: x * scalar.s
    inference = poptorch.inferenceModel(scalar, opts)
    inference.s.replicaGrouping(CGT.Consecutive, 2, VRM.OnePerGroup)
    with pytest.raises(poptorch.Error, match="Scalars cannot be passed as per-replica "
                                             "weight tensor values"):
        inference(torch.ones(4))
    model = Grouped(torch.randn(3, 3, 4))  # 3 values, 2 groups
    inference = poptorch.inferenceModel(model, opts)
    inference.W.replicaGrouping(CGT.Consecutive, 2, VRM.OnePerGroup)
    with pytest.raises(poptorch.Error, match="must be the number of replica groups"):
        inference(torch.randn(4, 3))
    model = Grouped(torch.randn(2, 3, 4))
    inference = poptorch.inferenceModel(model, opts)
    inference.W.replicaGrouping(CGT.Consecutive, 3, VRM.OnePerGroup)
    with pytest.raises(poptorch.Error, match="must be a multiple of the group size"):
        inference(torch.randn(4, 3))
    assert not inference.isCompiled()
    inference.per_replica_params["W"] = (CGT.Consecutive, 2, VRM.OnePerGroup)
    inference(torch.randn(4, 3))  # fixed: compiles


# -- buffers and replication (docs/semantics.md S-36)
# -----------------------------------------------------

def test_per_replica_batchnorm_statistics_in_training():
    """broadcastBuffers(False): each replica's running statistics follow its own data;
    the host receives replica 0's."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(2)

        def forward(self, x):
            return poptorch.identity_loss(self.bn(x).pow(2).mean(), reduction="sum")

    model = M()
    replica0 = copy.deepcopy(model)
    opts = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
    training = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(),
                                                                   lr=0.0))
    with pytest.raises(poptorch.Error, match="PopTorch does not support broadcasting"):
        poptorch.trainingModel(copy.deepcopy(replica0),
                               poptorch.Options().replicationFactor(2))(torch.randn(8, 2))
    for _ in range(3):
        x = torch.randn(8, 2)
        training(x)
        replica0.bn(x[:4])
    torch.testing.assert_close(model.bn.running_mean, replica0.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, replica0.bn.running_var)


# -- input replica grouping of inference (docs/semantics.md S-26)
# ----------------------------------------

@pytest.mark.parametrize("group_type,expected", [
    (poptorch.CommGroupType.Consecutive, [0, 0, 1, 1]),
    (poptorch.CommGroupType.Orthogonal, [0, 1, 0, 1]),
])
def test_input_replica_grouping(group_type, expected):
    class M(nn.Module):
        def forward(self, x):
            return x + 0

    opts = poptorch.Options().replicationFactor(4).inputReplicaGrouping(2, group_type)
    out = poptorch.inferenceModel(M(), opts)(torch.tensor([[0.], [1.]]))
    assert out.flatten().tolist() == expected
