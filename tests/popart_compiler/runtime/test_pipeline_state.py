"""Versions of a stage's state in a pipeline across processes
(``popart_compiler/runtime/pipeline_state.py``): which values an owner serves to a
read made at a given point, and when it refuses, without processes."""
import threading

import pytest
import torch

from popart_compiler.runtime.pipeline_state import (Refusal, StateProvider, Version,
                                                    flat_layout, flatten, unflatten_into)


def _provider():
    """Stage 0 of 2 owns a float weight, an int buffer and a float optimizer tensor."""
    owned = [{"weights": [torch.zeros(2, 3)], "buffers": [torch.zeros(2, dtype=torch.int64)],
              "optimizer": [torch.zeros(3)]},
             {"weights": [], "buffers": [], "optimizer": []}]
    return StateProvider(7, owned, 0, lambda s: f"stage {s}"), owned[0]


def _serve(p, kind, runs, writes, ending=None):
    return p.payload(kind, Version(runs, writes), "the reader", lambda: ending)


def test_flat_layout_groups_by_dtype_and_round_trips():
    tensors = [torch.arange(4.0).view(2, 2), torch.tensor([5, 6]), torch.tensor([7.0])]
    assert flat_layout(tensors) == [(torch.float32, [0, 2]), (torch.int64, [1])]
    flats = flatten(tensors)
    assert flats[0].tolist() == [0.0, 1.0, 2.0, 3.0, 7.0] and flats[1].tolist() == [5, 6]
    targets = [torch.zeros(2, 2), torch.zeros(2, dtype=torch.int64), torch.zeros(1)]
    unflatten_into(flats, targets)
    for got, want in zip(targets, tensors):
        assert torch.equal(got, want)


def test_live_state_and_the_copy_kept_before_a_write():
    p, mine = _provider()
    mine["weights"][0].fill_(1.0)
    assert _serve(p, "weights", 0, 0)[0].tolist() == [1.0] * 6
    with p.writing(("weights",)):  # a host write: the old values are kept first
        mine["weights"][0].fill_(2.0)
    assert p.version("weights") == Version(0, 1) and p.version("optimizer") == Version(0, 0)
    assert _serve(p, "weights", 0, 0)[0].tolist() == [1.0] * 6  # a late reader
    assert _serve(p, "weights", 0, 1)[0].tolist() == [2.0] * 6
    p.begin_run()
    mine["weights"][0].fill_(3.0)
    p.end_run(True)
    assert _serve(p, "weights", 1, 1)[0].tolist() == [3.0] * 6
    with pytest.raises(Refusal, match="after call 0 and 0 host writes"):  # copies dropped
        _serve(p, "weights", 0, 0)


def test_buffers_are_kept_at_the_start_of_a_call():
    """A forward changes the stage's buffers before the other stages take part: a read
    of the previous version during the call gets the values from before it."""
    p, mine = _provider()
    mine["buffers"][0].fill_(4)
    p.begin_run()
    mine["buffers"][0].fill_(5)  # the first forward of the call
    assert _serve(p, "buffers", 0, 0)[0].tolist() == [4, 4]
    # weights are live until the update, which needs every stage in the call
    mine["weights"][0].fill_(6.0)
    assert _serve(p, "weights", 0, 0)[0].tolist() == [6.0] * 6
    p.end_run(False)  # rolled back: still version 0
    assert p.version("buffers") == Version(0, 0)


def test_a_read_waits_for_the_call_it_reads_after():
    p, mine = _provider()
    got = []
    reader = threading.Thread(target=lambda: got.append(_serve(p, "optimizer", 1, 0)))
    p.begin_run()
    reader.start()
    reader.join(timeout=0.3)
    assert reader.is_alive() and not got  # the owner is still in call 1
    mine["optimizer"][0].fill_(9.0)
    p.end_run(True)
    reader.join(timeout=10)
    assert got[0][0].tolist() == [9.0] * 3


def test_refusals_name_the_mismatch():
    p, _ = _provider()
    p.begin_run()  # the owner starts call 1 without the write the reader made
    with pytest.raises(Refusal) as info:
        _serve(p, "weights", 0, 1)
    assert str(info.value) == (
        "the reader reads the weights of stage 0 after call 0 and 1 host writes of them, "
        "but the process of that stage is in call 1 after 0: every process of the "
        "pipeline must make the same calls and the same host writes (copyWeightsToDevice, "
        "loading weights or optimizer state) at the same points of the script")
    p.end_run(True)
    with pytest.raises(Refusal, match="the process of that stage ended its script after "
                       "call 1: every process must make the same calls"):
        _serve(p, "weights", 2, 0, ending="ended its script")
    p.close()
    with pytest.raises(Refusal, match="destroyed the model after call 1"):
        _serve(p, "weights", 2, 0)
    assert _serve(p, "weights", 1, 0)[0].shape == (6,)  # its final state stays readable
