"""popart_compiler/planner/variants.py: the ops of a program with any subset of the
planner's markers, from the program with all of them (A) and with none (B)."""
from popart_compiler.cost.op_costs import OpCost, ProgramCosts
from popart_compiler.planner.variants import Variants


def _programs():
    # A: mm1 -> marker m (a view of mm1, checkpointed) -> mm2 reads m
    a = [OpCost("mm1", "linear", out_bytes=64, checkpoint=True, inputs=("x",)),
         OpCost("m", "recomputation_checkpoint", view=True, checkpoint=True,
                inputs=("mm1",)),
         OpCost("mm2", "linear", out_bytes=32, inputs=("m",)),
         OpCost("out", "relu", out_bytes=32, inputs=("mm2",))]
    # B: the same program without the marker
    b = [OpCost("mm1", "linear", out_bytes=64, inputs=("x",)),
         OpCost("mm2", "linear", out_bytes=32, inputs=("mm1",)),
         OpCost("out", "relu", out_bytes=32, inputs=("mm2",))]
    costs = [ProgramCosts(ops, [], 0, 0, 1, [(0, 0)]) for ops in (a, b)]
    return Variants(costs[0], costs[1], ["m"])


def test_the_marker_names_what_it_marks_and_who_it_changes():
    v = _programs()
    assert v.index == {"mm1": 0, "m": 1, "mm2": 2, "out": 3}
    assert v.marked == {"m": "mm1"}
    assert v.affected == {"mm1": {"m"}, "mm2": {"m"}}
    assert v.consumers == {"x": [0], "mm1": [1], "m": [2], "mm2": [3]}


def test_with_the_marker_present_the_ops_are_as_in_a():
    v = _programs()
    ops = [v.op(i, lambda name: True) for i in range(4)]
    assert [op.name for op in ops] == ["mm1", "m", "mm2", "out"]
    assert ops[0].checkpoint and ops[2].inputs == ("m",)
    assert v.consumers_of("mm1", lambda name: True) == [1]


def test_with_the_marker_absent_the_ops_are_as_in_b():
    v = _programs()
    ops = [v.op(i, lambda name: False) for i in range(4)]
    assert ops[1] is None
    assert not ops[0].checkpoint and ops[2].inputs == ("mm1",)
    assert ops[3] is v.ops[3]  # unaffected ops are A's (the same as B's)
    # an absent marker's readers read the tensor it marks
    assert v.consumers_of("mm1", lambda name: False) == [2]
