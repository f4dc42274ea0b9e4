"""Ops with data-dependent internals but static outputs run (opaque ops, values of
constant-only tensors); ops whose outputs depend on data raise a ``poptorch.Error``
naming the op, the user's line and the alternative (issue 7, the op-coverage rule)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import poptorch

T, N, C = 12, 4, 6
TARGET_LENGTHS = [3, 5, 4, 3]


class CtcModel(nn.Module):
    def __init__(self, lists):
        super().__init__()
        self.proj = nn.Linear(C, C)
        self.lists = lists

    def forward(self, x, targets, input_lengths, target_lengths):
        log_probs = self.proj(x).log_softmax(2)
        if self.lists:
            input_lengths, target_lengths = [T] * N, TARGET_LENGTHS
        return F.ctc_loss(log_probs, targets, input_lengths, target_lengths)


@pytest.mark.parametrize("lists", [False, True], ids=["tensor_lengths", "list_lengths"])
def test_ctc_loss_trains_three_steps_like_plain_pytorch(lists):
    x = torch.randn(T, N, C)
    targets = torch.randint(1, C, (N, 5))
    input_lengths = torch.full((N,), T)
    target_lengths = torch.tensor(TARGET_LENGTHS)
    model = CtcModel(lists)
    ref = copy.deepcopy(model)
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.5))
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, ref_losses = [], []
    for _ in range(3):
        losses.append(training(x, targets, input_lengths, target_lengths))
        optimizer.zero_grad()
        loss = ref(x, targets, input_lengths, target_lengths)
        loss.backward()
        optimizer.step()
        ref_losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses))
    assert losses[2] < losses[0]
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


def test_ctc_loss_is_one_opaque_node_in_the_graph():
    model = CtcModel(lists=False)
    inference = poptorch.inferenceModel(model)
    args = (torch.randn(T, N, C), torch.randint(1, C, (N, 5)), torch.full((N,), T),
            torch.tensor(TARGET_LENGTHS))
    torch.testing.assert_close(inference(*args), model(*args).detach())
    ir = inference._debugGetPopartIR()
    assert "poptorch.ctc_loss.Tensor" in ir and "_ctc_loss" not in ir


class Seq2Seq(nn.Module):
    def __init__(self, dropout=0.1):
        super().__init__()
        self.transformer = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2,
                                          num_decoder_layers=2, dim_feedforward=32,
                                          batch_first=True, dropout=dropout)

    def forward(self, src, tgt, target=None):
        out = self.transformer(src, tgt,
                               tgt_mask=nn.Transformer.generate_square_subsequent_mask(3))
        if target is None:
            return out
        return out, F.mse_loss(out, target)


def test_transformer_with_causal_tgt_mask_inference_equals_plain_pytorch():
    model = Seq2Seq().eval()
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 3, 16)
    out = poptorch.inferenceModel(model)(src, tgt)
    torch.testing.assert_close(out, model(src, tgt).detach())


def test_transformer_with_causal_tgt_mask_trains_like_plain_pytorch():
    model = Seq2Seq().eval()
    ref = copy.deepcopy(model)
    src, tgt, target = torch.randn(2, 5, 16), torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        out, loss = training(src, tgt, target)
        optimizer.zero_grad()
        ref_out, ref_loss = ref(src, tgt, target)
        ref_loss.backward()
        optimizer.step()
        torch.testing.assert_close(loss, ref_loss.detach())
        torch.testing.assert_close(out, ref_out.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach())


def test_transformer_mask_given_as_input_names_pytorch_code_and_the_fix():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = Seq2Seq().transformer

        def forward(self, src, tgt, mask):
            return self.transformer(src, tgt, tgt_mask=mask)  # the user's line

    model = poptorch.inferenceModel(Model().eval())
    with pytest.raises(poptorch.Error) as info:
        model(torch.randn(2, 5, 16), torch.randn(2, 3, 16),
              nn.Transformer.generate_square_subsequent_mask(3))
    message = str(info.value)
    assert "test_data_dependence.py" in message
    assert "return self.transformer(src, tgt, tgt_mask=mask)" in message
    assert "_detect_is_causal_mask at nn/modules/transformer.py" in message
    assert "tgt_is_causal" in message


class Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, i):
        return self.fn(x, i)


X, IDX = torch.randn(4, 4), torch.tensor([0, 1, 3, 4, 2, 2])

#: (op, what the message names, alternative it gives)
RAISING = {
    "nonzero": (lambda x, i: torch.nonzero(x > 0), "torch.nonzero (aten::nonzero)",
                "torch.nonzero_static"),
    "argwhere": (lambda x, i: torch.argwhere(x), "torch.argwhere", "torch.nonzero_static"),
    "unique": (lambda x, i: torch.unique(i), "torch.unique", "on the host"),
    "unique_consecutive": (lambda x, i: torch.unique_consecutive(i),
                           "torch.unique_consecutive", "on the host"),
    "masked_select": (lambda x, i: torch.masked_select(x, x > 0),
                      "torch.masked_select (aten::masked_select)", "torch.where"),
    "boolean_mask": (lambda x, i: x[x > 0], "Tensor.__getitem__ (aten::index)",
                     "torch.where"),
    "bincount": (lambda x, i: torch.bincount(i), "torch.bincount (aten::bincount)",
                 "minlength="),
    "one_hot_without_num_classes": (lambda x, i: F.one_hot(i),
                                    "torch.nn.functional.one_hot", "num_classes"),
    "repeat_interleave_tensor": (lambda x, i: torch.repeat_interleave(x[0], i[:4]),
                                 "torch.repeat_interleave", "output_size="),
    "lstsq": (lambda x, i: torch.linalg.lstsq(x, x[:, :2]).solution,
              "torch.linalg.lstsq (aten::linalg_lstsq)", "torch.linalg.pinv"),
    "pack_padded_sequence": (lambda x, i: nn.utils.rnn.pack_padded_sequence(
        x, i[2:4], batch_first=True).data, "torch._pack_padded_sequence", "torch.where"),
}


@pytest.mark.parametrize("name", list(RAISING))
def test_op_with_data_dependent_output_shape_raises_naming_op_line_and_alternative(name):
    fn, op, alternative = RAISING[name]
    model = poptorch.inferenceModel(Op(fn))
    with pytest.raises(poptorch.Error) as info:
        model(X, IDX)
    message = str(info.value)
    assert "shape depends on tensor values" in message or "needs the value" in message
    assert op in message, message
    assert "test_data_dependence.py" in message and f'RAISING = {{' not in message
    assert alternative in message, message
    assert not model.isCompiled()


@pytest.mark.parametrize("read", ["item", "bool", "tolist", "equal"])
def test_tensor_value_in_python_control_flow_raises_naming_the_read(read):
    reads = {
        "item": lambda x, i: x * 2 if x.sum().item() > 0 else x,
        "bool": lambda x, i: x * 2 if x.sum() > 0 else x,
        "tolist": lambda x, i: x * len([v for v in x.tolist() if v[0] > 0]),
        "equal": lambda x, i: x if torch.equal(x, x.abs()) else -x,
    }
    model = poptorch.inferenceModel(Op(reads[read]))
    with pytest.raises(poptorch.Error) as info:
        model(X, IDX)
    message = str(info.value)
    assert "uses the value of a tensor in Python control flow" in message
    assert {"item": ".item()", "bool": "bool(tensor)", "tolist": ".tolist()",
            "equal": "torch.equal()"}[read] in message
    assert f'"{read}": lambda x, i:' in message
    assert "poptorch.cond" in message


def test_values_computed_from_constants_are_known_at_capture():
    def fn(x, i):
        scale = torch.tensor([1.0, 2.0]).sum()  # constant: 3.0 on every run
        if scale > 2:
            x = x * scale.item()
        mask = torch.ones(4, 4).triu()
        mask.mul_(2)
        return x * mask if bool((mask == 2 * torch.ones(4, 4).triu()).all()) else x

    out = poptorch.inferenceModel(Op(fn))(X, IDX)
    torch.testing.assert_close(out, fn(X, IDX))


def test_item_feeding_a_tensor_op_runs_with_new_values():
    model = poptorch.inferenceModel(Op(lambda x, i: x / x.abs().max().item()))
    for x in (X, X * 3):
        torch.testing.assert_close(model(x, IDX), x / x.abs().max())


def test_complex_output_is_rejected_and_complex_intermediates_run():
    model = poptorch.inferenceModel(Op(lambda x, i: torch.fft.fft(x)))
    with pytest.raises(poptorch.Error, match="Unsupported tensor output type: ComplexFloat"):
        model(X, IDX)
    out = poptorch.inferenceModel(Op(lambda x, i: torch.fft.fft(x).abs()))(X, IDX)
    torch.testing.assert_close(out, torch.fft.fft(X).abs())


def test_gaussian_nll_loss_validation_read_does_not_block_capture():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.log_var = nn.Parameter(torch.zeros(3, 4))

        def forward(self, x, y):
            return F.gaussian_nll_loss(x, y, self.log_var.exp())

    model = Model()
    ref = copy.deepcopy(model)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(
        model.parameters(), lr=0.5))
    loss = training(x, y)
    ref_loss = ref(x, y)
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(model.log_var.detach(), ref.log_var.detach())


def test_opaque_op_with_several_device_iterations_equals_plain_pytorch():
    class BatchFirstCtc(nn.Module):
        def forward(self, x, targets):  # x: [N, T, C]
            return F.ctc_loss(x.transpose(0, 1).log_softmax(2), targets, [T] * N,
                              TARGET_LENGTHS, reduction="none")

    model = BatchFirstCtc()
    inference = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    x, targets = torch.randn(2 * N, T, C), torch.randint(1, C, (2 * N, 5))
    expected = torch.cat([model(x[i * N:(i + 1) * N], targets[i * N:(i + 1) * N])
                          for i in range(2)])
    torch.testing.assert_close(inference(x, targets), expected)


# -- data-dependent control flow and shapes in forward ---------------------------------

def test_data_dependent_control_flow_names_the_line_and_points_to_cond():
    class M(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent
                return x * 2
            return x

    model = poptorch.inferenceModel(M())
    with pytest.raises(poptorch.Error) as info:
        model(torch.ones(2))
    message = str(info.value)
    assert "test_data_dependence.py" in message and "if x.sum() > 0:" in message
    assert "poptorch.cond" in message
    assert not model.isCompiled()


def test_cond_expresses_data_dependent_choice():
    class M(nn.Module):
        def forward(self, x):
            return poptorch.cond(x.sum() > 0, lambda a: a * 2, [x], lambda a: a - 1, [x])[0]

    model = poptorch.inferenceModel(M())
    assert model(torch.ones(2)).tolist() == [2.0, 2.0]
    assert model(-torch.ones(2)).tolist() == [-2.0, -2.0]
    assert M()(torch.ones(2)).tolist() == [2.0, 2.0]  # genuine if/else on the CPU


@pytest.mark.parametrize("iterations", [1, 2])
def test_data_dependent_output_shapes_are_rejected(iterations):
    """Found by a user: x[x > 0] ran with deviceIterations 1 (shape changing from call to
    call) and failed with a raw RuntimeError with 2."""
    class M(nn.Module):
        def forward(self, x):
            return x[x > 0] * 2

    model = poptorch.inferenceModel(M(), poptorch.Options().deviceIterations(iterations))
    with pytest.raises(poptorch.Error) as info:
        model(torch.ones(iterations, 2))
    message = str(info.value)
    assert "shape depends on tensor values" in message
    assert "return x[x > 0] * 2" in message and "torch.where" in message
    assert not model.isCompiled()


# -- tensor.numpy() in forward ---------------------------------------------------------

class _NumpyInForward(torch.nn.Module):
    def forward(self, x):
        return torch.from_numpy(x.detach().cpu().numpy() * 2)  # the user's line


class _NumpyOfConstant(torch.nn.Module):
    def forward(self, x):
        k = torch.tensor([1.0, 2.0]).numpy()  # same on every run: known at capture
        return x * float(k.sum())


def test_numpy_of_run_time_tensor_names_the_read_and_the_line():
    """x.numpy() in forward was a bare "Failed to capture ...: .numpy() is not supported
    for tensor subclasses"; it is a data-dependence error like .tolist()."""
    with pytest.raises(poptorch.Error) as info:
        poptorch.inferenceModel(_NumpyInForward())(torch.ones(2))
    text = str(info.value)
    assert "tensor.numpy()" in text
    assert "test_data_dependence.py" in text and "the user's line" in text
    assert "torch.where" in text


def test_numpy_of_constant_tensor_is_known_at_capture():
    x = torch.randn(2)
    out = poptorch.inferenceModel(_NumpyOfConstant())(x)
    assert torch.allclose(out, x * 3.0)
