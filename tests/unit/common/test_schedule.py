import pytest

from elasticdl.common.schedule import Schedule


def test_due_once_per_multiple_crossed_whether_versions_come_singly_or_in_jumps():
    s = Schedule(evaluation_steps=10, checkpoint_steps=4)
    last, due = 0, []
    for v in range(1, 31):
        if s.eval_due(v, last):
            due.append(v)
            last = v
    assert due == [10, 20, 30]
    # a worker that reports rarely: 7, 23, 24, 41 -> due at 23 (crossed 10 and 20 once) and 41
    last, due = 0, []
    for v in (7, 23, 24, 41):
        if s.eval_due(v, last):
            due.append(v)
            last = v
    assert due == [23, 41]
    assert s.checkpoint_due(4, 0) and not s.checkpoint_due(7, 4) and s.checkpoint_due(8, 7)


def test_zero_switches_off_and_old_versions_are_never_due():
    s = Schedule()
    assert not s.eval_due(100, 0) and not s.checkpoint_due(100, 0)
    s = Schedule(evaluation_steps=5)
    assert not s.eval_due(5, 10)          # behind what was already evaluated
    assert not s.eval_due(10, 10)
    with pytest.raises(ValueError, match="evaluation_steps"):
        Schedule(evaluation_steps=-1)
