"""Rendezvous failure rounds (issue 11): ``aborting`` tells members a plan is broken,
a member silent for ``hung_after_s`` when a failure round is open is excluded as hung
(fake clock)."""

from __future__ import annotations

import itertools

from elasticdl.master.rendezvous import Rendezvous
from tests.unit.master.test_rendezvous import FakeClock


def _three(clock: FakeClock, **kw) -> Rendezvous:
    ports = itertools.count(41000)
    rdzv = Rendezvous("h", lambda: next(ports), clock=clock, settle_s=0.5,
                      checkin_timeout_s=30.0, initial_workers=3, **kw)
    for w in range(3):
        rdzv.join(w, f"h{w}", 0)
    clock.advance(1.0)
    assert rdzv.members() == [0, 1, 2]
    return rdzv


def test_removal_marks_the_plan_aborting_until_survivors_reform():
    clock = FakeClock()
    rdzv = _three(clock, hung_after_s=5.0)
    assert not rdzv.get_comm_plan(0, 1).aborting
    rdzv.remove_worker(2)                       # the controller saw its process exit
    view = rdzv.get_comm_plan(0, 1)             # worker 0 polls mid-collective
    assert view.aborting and not view.ready
    view = rdzv.get_comm_plan(1, 1)             # the last survivor checks in: published
    assert view.ready and not view.aborting and view.plan_version == 2
    assert rdzv.members() == [0, 1]
    assert rdzv.take_excluded() == []


def test_a_join_round_is_not_aborting():
    clock = FakeClock()
    rdzv = _three(clock, hung_after_s=5.0)
    rdzv.join(7, "h7", 0)
    view = rdzv.get_comm_plan(0, 1)
    assert not view.ready and not view.aborting  # finish the step, then re-form


def test_member_silent_after_a_failure_is_excluded_as_hung():
    clock = FakeClock()
    rdzv = _three(clock, hung_after_s=5.0)
    rdzv.get_comm_plan(2, 1)                    # worker 2's last call, then it hangs
    clock.advance(3.0)
    rdzv.report_failure(0, 1, "Timed out waiting 5000ms for recv")
    assert rdzv.get_comm_plan(1, 1).aborting
    clock.advance(1.9)
    assert not rdzv.get_comm_plan(0, 1).ready and rdzv.take_excluded() == []
    clock.advance(0.2)                          # worker 2 silent for 5.1 s
    view = rdzv.get_comm_plan(0, 1)
    assert view.ready and view.plan_version == 2 and view.world_size == 2
    assert rdzv.members() == [0, 1]
    assert rdzv.take_excluded() == [2]
    assert rdzv.take_excluded() == []            # handed out once
    assert rdzv.get_comm_plan(2, 1).rank == -1  # if it wakes up it must join again


def test_a_member_that_keeps_calling_is_waited_for():
    clock = FakeClock()
    rdzv = _three(clock, hung_after_s=5.0)
    rdzv.report_failure(0, 1, "connection reset")
    for _ in range(8):                          # worker 2 busy but alive: still polling
        clock.advance(1.0)
        rdzv.get_comm_plan(1, 1)
        view = rdzv.get_comm_plan(2, 1)
    assert view.ready and view.world_size == 3 and rdzv.take_excluded() == []


def test_failure_during_a_join_round_still_aborts():
    clock = FakeClock()
    rdzv = _three(clock, hung_after_s=5.0)
    rdzv.join(7, "h7", 0)
    rdzv.report_failure(0, 1, "connection reset")
    assert rdzv.get_comm_plan(1, 1).aborting
