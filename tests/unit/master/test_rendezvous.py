"""Rendezvous plans: settle, check-in, removal, failure reports, versions (fake clock)."""

from __future__ import annotations

import itertools
import sys

import pytest

from elasticdl.master.rendezvous import CommPlan, MemberConflict, Rendezvous


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(clock: FakeClock, **kw) -> Rendezvous:
    ports = itertools.count(40000)
    kw.setdefault("settle_s", 1.0)
    kw.setdefault("checkin_timeout_s", 10.0)
    return Rendezvous("master-host", lambda: next(ports), clock=clock, **kw)


def test_first_plan_settles_and_ranks_follow_worker_ids(clock):
    rdzv = make(clock)
    p = rdzv.join(5, "h5", 0)
    assert not p.ready and p.rank == -1
    clock.advance(0.5)
    rdzv.join(2, "h2", 7)
    clock.advance(0.9)  # 0.9 s since the last join: still settling
    assert not rdzv.get_comm_plan(5, 0).ready
    clock.advance(0.2)
    p5 = rdzv.get_comm_plan(5, 0)
    p2 = rdzv.get_comm_plan(2, 0)
    assert p5.ready and p2.ready
    assert (p2.rank, p5.rank) == (0, 1)
    assert p5.world_size == 2 and p5.plan_version == 1
    assert p5.peer_addresses == ("h2:7", "h5:0")
    # rank 0 hosts the store: its host, a port from the allocator
    assert (p5.master_addr, p5.master_port) == ("h2", 40000)
    assert rdzv.members() == [2, 5]
    assert isinstance(p5, CommPlan)


def test_empty_host_falls_back_to_store_host(clock):
    rdzv = make(clock)
    rdzv.join(0, "", 0)
    clock.advance(1.0)
    assert rdzv.get_comm_plan(0, 0).master_addr == "master-host"


def test_initial_workers_waits_for_the_expected_group(clock):
    rdzv = make(clock, initial_workers=2)
    rdzv.join(0, "h0", 0)
    clock.advance(5.0)
    assert not rdzv.get_comm_plan(0, 0).ready
    rdzv.join(1, "h1", 0)
    clock.advance(1.0)
    assert rdzv.get_comm_plan(0, 0).world_size == 2
    # ... but not forever
    rdzv2 = make(clock, initial_workers=3)
    rdzv2.join(0, "h0", 0)
    clock.advance(10.0)
    assert rdzv2.get_comm_plan(0, 0).ready


def _formed(clock: FakeClock, n: int, **kw) -> Rendezvous:
    rdzv = make(clock, **kw)
    for w in range(n):
        rdzv.join(w, f"h{w}", 0)
    clock.advance(1.0)
    assert rdzv.get_comm_plan(0, 0).ready
    return rdzv


def test_new_worker_opens_a_round_that_needs_every_member_to_check_in(clock):
    rdzv = _formed(clock, 2)
    assert rdzv.join(7, "h7", 0).ready is False
    assert rdzv.get_comm_plan(0, 1).ready is False  # members see the change at once
    clock.advance(2.0)
    # worker 1 has not checked in yet: the round waits for it
    assert not rdzv.get_comm_plan(0, 1).ready
    p1 = rdzv.get_comm_plan(1, 1)
    assert p1.ready and p1.plan_version == 2 and p1.world_size == 3
    assert rdzv.members() == [0, 1, 7]
    assert rdzv.get_comm_plan(7, 0).rank == 2
    assert p1.master_port != 40000  # a fresh store port per plan


def test_failure_report_drops_silent_members_after_checkin_timeout(clock):
    rdzv = _formed(clock, 3)
    p = rdzv.report_failure(0, 1, "allreduce timed out")
    assert not p.ready
    rdzv.report_failure(2, 1, "connection reset")
    clock.advance(5.0)
    assert not rdzv.get_comm_plan(0, 1).ready  # worker 1 may still check in
    clock.advance(5.0)
    p0 = rdzv.get_comm_plan(0, 1)
    assert p0.ready and p0.plan_version == 2 and p0.world_size == 2
    assert rdzv.members() == [0, 2]
    # the silent worker comes back: it is not a member and must join again
    late = rdzv.get_comm_plan(1, 1)
    assert late.ready and late.rank == -1
    assert not rdzv.join(1, "h1", 0).ready
    clock.advance(1.0)
    rdzv.get_comm_plan(0, 2)
    rdzv.get_comm_plan(2, 2)
    assert rdzv.members() == [0, 1, 2] and rdzv.plan_version == 3


def test_removal_lets_the_round_close_early(clock):
    rdzv = _formed(clock, 3)
    rdzv.report_failure(0, 1, "connection reset")
    rdzv.report_failure(2, 1, "connection reset")
    assert not rdzv.get_comm_plan(0, 1).ready  # worker 1 might still check in
    rdzv.remove_worker(1)  # the job controller saw the process die
    p = rdzv.get_comm_plan(2, 1)
    assert p.ready and p.world_size == 2 and p.rank == 1
    assert rdzv.members() == [0, 2]


def test_removal_alone_opens_a_round_that_closes_on_check_in(clock):
    rdzv = _formed(clock, 3)
    rdzv.remove_worker(2)
    assert not rdzv.get_comm_plan(0, 1).ready  # worker 1 has not checked in yet
    p = rdzv.get_comm_plan(1, 1)  # no settle wait: nobody joined
    assert p.ready and p.world_size == 2 and p.plan_version == 2
    rdzv.remove_worker(42)  # unknown: nothing happens
    assert rdzv.get_comm_plan(0, 2).ready


def test_stale_and_repeated_failure_reports_open_one_round(clock):
    rdzv = _formed(clock, 2)
    assert not rdzv.report_failure(0, 1, "timeout").ready
    clock.advance(0.5)
    rdzv.report_failure(1, 1, "timeout")  # same plan, round already open: a check-in only
    p = rdzv.get_comm_plan(0, 1)
    assert p.ready and p.plan_version == 2 and p.world_size == 2
    # a report against the superseded plan changes nothing
    p = rdzv.report_failure(1, 1, "late report")
    assert p.ready and p.plan_version == 2


def test_a_join_during_a_failure_round_makes_it_settle(clock):
    rdzv = _formed(clock, 2)
    rdzv.report_failure(0, 1, "timeout")
    rdzv.join(5, "h5", 0)
    rdzv.get_comm_plan(1, 1)
    assert not rdzv.get_comm_plan(0, 1).ready
    clock.advance(1.0)
    assert rdzv.get_comm_plan(0, 1).world_size == 3


def test_settle_restarts_with_each_join(clock):
    rdzv = make(clock)
    for w in range(4):
        rdzv.join(w, f"h{w}", 0)
        clock.advance(0.6)
    assert not rdzv.get_comm_plan(0, 0).ready
    clock.advance(0.4)
    assert rdzv.get_comm_plan(0, 0).world_size == 4
    assert rdzv.plan_version == 1


def test_rejoin_with_same_address_during_a_round_is_idempotent(clock):
    rdzv = make(clock)
    rdzv.join(0, "h0", 0)
    clock.advance(0.8)
    rdzv.join(0, "h0", 0)  # a retried RPC must not restart the settle window
    clock.advance(0.2)
    assert rdzv.get_comm_plan(0, 0).ready


def test_member_rejoining_means_a_new_incarnation(clock):
    rdzv = _formed(clock, 2)
    # a live member's id cannot be taken from another address (issue 12) ...
    with pytest.raises(MemberConflict, match="live member"):
        rdzv.join(1, "h1-new", 0)
    assert rdzv.get_comm_plan(1, 1).ready and rdzv.members() == [0, 1]
    # ... once the old incarnation is removed, the id may join from a new address
    rdzv.remove_worker(1)
    assert not rdzv.join(1, "h1-new", 0).ready
    clock.advance(1.0)
    rdzv.get_comm_plan(0, 1)
    p = rdzv.get_comm_plan(1, 1)
    assert p.ready and p.plan_version == 2 and p.peer_addresses[1] == "h1-new:0"


def test_everyone_removed_then_a_new_worker(clock):
    rdzv = _formed(clock, 1)
    rdzv.remove_worker(0)
    clock.advance(5.0)
    assert rdzv.members() == [0]  # nothing to publish: the old plan stays, not ready
    assert rdzv.forming()
    rdzv.join(3, "h3", 0)
    clock.advance(1.0)
    assert rdzv.get_comm_plan(3, 0).ready and rdzv.members() == [3]


def test_master_side_never_imports_torch():
    assert "elasticdl.master.rendezvous" in sys.modules
    import elasticdl.master.rendezvous as mod

    assert "torch" not in mod.__dict__
