"""ElasticGroup's side of the rendezvous, against a real Rendezvous and a fake
clock; process-group creation is replaced by a recorder (no torch.distributed)."""

from __future__ import annotations

import itertools

import pytest
import torch

from elasticdl.common.collective import CollectiveError
from elasticdl.elastic.group import ElasticGroup, RendezvousTimeout, default_backend
from elasticdl.master.rendezvous import Rendezvous


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class Comm:
    def __init__(self, rdzv: Rendezvous, worker_id: int):
        self.rdzv, self.worker_id = rdzv, worker_id
        self.calls: list[str] = []

    def join(self, host, port):
        self.calls.append("join")
        return self.rdzv.join(self.worker_id, host, port)

    def get_comm_plan(self, known_version):
        return self.rdzv.get_comm_plan(self.worker_id, known_version)

    def report_collective_failure(self, plan_version, reason):
        self.calls.append(f"fail {plan_version}")
        return self.rdzv.report_failure(self.worker_id, plan_version, reason)


def _group(rdzv: Rendezvous, worker_id: int, clock: Clock, formed: list, fail_first: int = 0):
    group = ElasticGroup(Comm(rdzv, worker_id), f"h{worker_id}", "gloo", torch.device("cpu"),
                         timeout_s=5, rendezvous_timeout_s=30, poll_s=0.1,
                         check_interval_s=1.0, clock=clock, sleep=clock.sleep)
    failures = [fail_first]

    def init(plan):
        if failures[0] > 0:
            failures[0] -= 1
            raise CollectiveError("init_process_group", RuntimeError("store unreachable"))
        formed.append((worker_id, plan.plan_version, plan.rank, plan.world_size))
        group.plan, group._last_version, group.active = plan, plan.plan_version, True
        group.formations += 1
        group._last_check = clock()

    group._init = init  # type: ignore[method-assign]
    group._teardown = lambda abort: setattr(group, "active", False)  # type: ignore
    return group


def _rdzv(clock: Clock) -> Rendezvous:
    ports = itertools.count(50000)
    return Rendezvous("m", lambda: next(ports), settle_s=0.5, clock=clock,
                      checkin_timeout_s=5.0)


def test_form_joins_and_waits_for_the_settled_plan():
    clock, formed = Clock(), []
    rdzv = _rdzv(clock)
    g = _group(rdzv, 0, clock, formed)
    g.form()
    assert formed == [(0, 1, 0, 1)] and clock.now >= 0.5
    assert g.rejoined and g.version == 1


def test_change_pending_polls_at_most_every_interval():
    clock, formed = Clock(), []
    rdzv = _rdzv(clock)
    g = _group(rdzv, 0, clock, formed)
    g.form()
    rdzv.join(1, "h1", 0)                 # a newcomer opens a round
    assert g.change_pending() is False    # polled less than a second ago
    clock.now += 1.0
    assert g.change_pending() is True
    g.leave()
    g.form()                              # both check in; the plan settles
    assert formed[-1] == (0, 2, 0, 2) and not g.rejoined


def test_left_out_worker_joins_again():
    clock, formed = Clock(), []
    rdzv = _rdzv(clock)
    a, b = _group(rdzv, 0, clock, formed), _group(rdzv, 1, clock, formed)
    a.comm.join("h0", 0)
    b.comm.join("h1", 0)
    a._joined = b._joined = True
    a.form()
    b.form()
    assert formed == [(0, 1, 0, 2), (1, 1, 1, 2)]
    a.fail("peer timed out")      # worker 1 hangs and does not check in
    a.form()                      # published without it after the check-in timeout
    assert formed[-1] == (0, 2, 0, 1) and rdzv.members() == [0]
    b.fail("woke up")             # a stale report: it is no member any more

    def sleep_while_a_polls(s: float) -> None:
        clock.sleep(s)
        rdzv.get_comm_plan(0, 2)  # worker 0 keeps polling while it trains

    b._sleep = sleep_while_a_polls
    b.form()                      # rank -1 -> join again -> the next plan
    assert b.comm.calls.count("join") == 2 and b.rejoined
    assert formed[-1] == (1, 3, 1, 2)
    clock.now += 1.0
    assert a.change_pending()
    a.leave()
    a.form()
    assert formed[-1] == (0, 3, 0, 2) and not a.rejoined


def test_a_plan_that_cannot_be_formed_is_reported_and_the_next_one_used():
    clock, formed = Clock(), []
    rdzv = _rdzv(clock)
    g = _group(rdzv, 0, clock, formed, fail_first=1)
    g.form()
    assert g.comm.calls == ["join", "fail 1"] and formed == [(0, 2, 0, 1)]


def test_no_plan_in_time_raises():
    clock, formed = Clock(), []
    rdzv = Rendezvous("m", lambda: 1, settle_s=0.5, clock=clock, initial_workers=2,
                      checkin_timeout_s=1000)
    g = _group(rdzv, 0, clock, formed)
    with pytest.raises(RendezvousTimeout):
        g.form()


def test_default_backend():
    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend(torch.device("cuda", 0)) == "nccl"
    assert default_backend(torch.device("cpu"), "nccl") == "nccl"
