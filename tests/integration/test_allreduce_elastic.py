"""AllreduceTrainer on real gloo groups in 2-4 processes, master stood in by a real
Rendezvous and TaskManager served from the test process (127.0.0.1 only)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Optional

import pytest
import torch

from elasticdl.api.model_spec import load_model_spec
from elasticdl.common.job_spec import JobSpec
from elasticdl.common.task import TaskType
from elasticdl.master.rendezvous import Rendezvous
from elasticdl.master.task_manager import TaskManager
from elasticdl.worker.trainer import LocalTrainer
from tests.conftest import FIXTURE_ZOO
from tests.integration.dist_procs import Procs, free_port
from tests.integration.elastic_harness import (
    FakeComm,
    FakeSource,
    MasterStandIn,
    MemoryReader,
    connect,
)

pytestmark = pytest.mark.integration

MODEL_DEF = "toy.linear.custom_model"


def _job_spec(**kw) -> JobSpec:
    kw.setdefault("collective_timeout_s", 5.0)
    return JobSpec(model_zoo=FIXTURE_ZOO, model_def=MODEL_DEF, training_data="mem",
                   distribution_strategy="AllreduceStrategy", job_name="elastic-test", **kw)


def _trainer(address, worker_id: int, spec: JobSpec, device: str = "cpu",
             model_def: str = MODEL_DEF):
    from elasticdl.worker.allreduce_trainer import AllreduceTrainer

    rdzv = connect(address).rdzv()
    model_spec = load_model_spec(FIXTURE_ZOO, model_def)
    dev = torch.device("cuda", worker_id) if device == "cuda" else torch.device("cpu")
    return AllreduceTrainer(model_spec, spec, worker_id, dev, FakeComm(rdzv, worker_id),
                            "127.0.0.1")


def _batches(n_steps: int, world: int, size: int) -> list[list[tuple]]:
    """batches[k][r]: (x, y) of rank r at step k; the union over r is records k*world*size.."""
    data = MemoryReader(n_steps * world * size)
    out = []
    for k in range(n_steps):
        row = []
        for r in range(world):
            start = (k * world + r) * size
            x = torch.from_numpy(data.x[start:start + size])
            y = torch.from_numpy(data.y[start:start + size])
            row.append((x, y))
        out.append(row)
    return out


# --------------------------------------------------------------- equivalence
def _equivalence_worker(address, worker_id: int, spec_json: str, world: int,
                        device: str = "cpu") -> dict:
    spec = JobSpec.from_json(spec_json)
    trainer = _trainer(address, worker_id, spec, device)
    try:
        losses = []
        for row in _batches(6, world, 8):
            if spec.fixed_global_batch_size:  # one member, all of a step's minibatches
                for x, y in row:
                    loss = trainer.train_minibatch(x, y)
            else:
                x, y = row[worker_id]
                loss = trainer.train_minibatch(x, y)
            assert loss is not None
            losses.append(float(loss))
        return {"params": {k: v.cpu().clone() for k, v in trainer.model.state_dict().items()},
                "version": trainer.model_version, "world": trainer.group.world_size,
                "backend": trainer.group.backend}
    finally:
        trainer.close()


def _union_reference(world: int) -> dict:
    model_spec = load_model_spec(FIXTURE_ZOO, MODEL_DEF)
    ref = LocalTrainer(model_spec, torch.device("cpu"), seed=0)
    for row in _batches(6, world, 8):
        x = torch.cat([b[0] for b in row])
        y = torch.cat([b[1] for b in row])
        ref.train_minibatch(x, y)
    return ref.model.state_dict()


def _run_equivalence(spec: JobSpec, workers: int, world: int,
                     device: str = "cpu") -> list[dict]:
    rdzv = Rendezvous("127.0.0.1", free_port, settle_s=0.3, checkin_timeout_s=20,
                      initial_workers=workers)
    master = MasterStandIn(rdzv)
    procs = Procs()
    try:
        for w in range(workers):
            procs.start(w, _equivalence_worker, master.address, w, spec.to_json(), world,
                        device)
        res = procs.collect(list(range(workers)), timeout_s=50)
        return [res[w] for w in range(workers)]
    finally:
        procs.close()
        master.close()


def test_two_workers_equal_single_process_training_on_the_union_batches():
    results = _run_equivalence(_job_spec(), workers=2, world=2)
    ref = _union_reference(2)
    for res in results:
        assert res["world"] == 2 and res["version"] == 6
        for name, value in ref.items():
            torch.testing.assert_close(res["params"][name], value, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL needs 2 CUDA devices")
def test_two_workers_equivalence_on_nccl():
    results = _run_equivalence(_job_spec(device="cuda"), workers=2, world=2, device="cuda")
    ref = _union_reference(2)
    for res in results:
        assert res["backend"] == "nccl" and res["version"] == 6
        for name, value in ref.items():
            torch.testing.assert_close(res["params"][name], value, rtol=0, atol=1e-5)


def test_fixed_global_batch_accumulates_when_fewer_workers_are_present():
    # the job is sized for 2 workers; 1 is present: 2 accumulated minibatches per step
    results = _run_equivalence(_job_spec(num_workers=2, fixed_global_batch_size=True),
                               workers=1, world=2)
    ref = _union_reference(2)
    assert results[0]["world"] == 1 and results[0]["version"] == 6
    for name, value in ref.items():
        torch.testing.assert_close(results[0]["params"][name], value, rtol=0, atol=1e-5)


# --------------------------------------------------------------------- chaos
def _chaos_worker(address, worker_id: int, spec_json: str, n_records: int,
                  go: Optional[Any] = None) -> dict:
    if go is not None and not go.wait(60):  # a late worker: torch imported, waiting to join
        raise TimeoutError("never told to join")
    spec = JobSpec.from_json(spec_json)
    trainer = _trainer(address, worker_id, spec)
    failures: list[float] = []
    fail = trainer.group.fail

    def recording_fail(reason: str) -> None:
        failures.append(time.time())
        fail(reason)

    trainer.group.fail = recording_fail  # type: ignore[method-assign]
    trainer.runner.start()
    joined_at_version = trainer.model_version
    source = FakeSource(connect(address).tm(), worker_id)
    stats = trainer.run(source, {TaskType.TRAINING: MemoryReader(n_records)})
    return {"pid": os.getpid(), "joined_at_version": joined_at_version,
            "version": trainer.model_version, "failures": failures,
            "formations": trainer.group.formations, "steps": stats.steps,
            "params": {k: v.clone() for k, v in trainer.model.state_dict().items()}}


def test_kill_one_of_three_members_survivors_continue_and_a_new_worker_joins(monkeypatch):
    n_records = 4096  # long enough that the joiner is in before the end, under load
    monkeypatch.setenv("TOY_FEED_DELAY_S", "0.04")  # 512 minibatches of >= 40 ms
    spec = _job_spec(minibatch_size=16, num_minibatches_per_task=4, num_epochs=2,
                     num_workers=3, collective_timeout_s=5.0)
    rdzv = Rendezvous("127.0.0.1", free_port, settle_s=0.5, checkin_timeout_s=15,
                      initial_workers=3)
    tm = TaskManager(training_shards=[("mem", 0, n_records)],
                     records_per_task=spec.records_per_task, num_epochs=2,
                     max_task_retries=3)
    master = MasterStandIn(rdzv, tm)
    procs = Procs()
    try:
        for w in range(3):
            procs.start(w, _chaos_worker, master.address, w, spec.to_json(), n_records)
        go = procs.ctx.Event()
        procs.start(3, _chaos_worker, master.address, 3, spec.to_json(), n_records, go)
        deadline = time.monotonic() + 120  # 4 processes import torch: slow on a loaded CI
        while tm.counts()["completed"] < 4:
            assert time.monotonic() < deadline, "training did not start"
            assert tm.failure is None
            time.sleep(0.05)
        procs.kill(2)                       # kill -9 mid-epoch
        killed_at = time.time()
        tm.recover_tasks(2)                 # what the master's job controller does
        rdzv.remove_worker(2)
        deadline = time.monotonic() + 30
        while rdzv.members() != [0, 1] or rdzv.forming():
            assert time.monotonic() < deadline, "survivors did not re-form"
            time.sleep(0.05)
        reformed_after = time.time() - killed_at
        go.set()                            # a new worker joins the running job
        res = procs.collect([0, 1, 3], timeout_s=120)
    finally:
        procs.close()
        master.close()

    assert tm.finished() and tm.failure is None
    assert reformed_after < 5.0
    for epoch in tm.epochs_report():
        assert epoch["records_completed"] == n_records, tm.epochs_report()
    for w in (0, 1):  # the survivors noticed within seconds, in the same process
        assert res[w]["pid"] == procs.procs[w].pid
        assert res[w]["failures"], f"worker {w} saw no failure"
        assert res[w]["failures"][0] - killed_at < 5.0
        assert res[w]["formations"] >= 3  # 3 members, 2 survivors, + the new worker
    assert res[3]["joined_at_version"] > 0  # took the survivors' state by broadcast
    versions = {res[w]["version"] for w in (0, 1, 3)}
    assert len(versions) == 1
    for name, value in res[0]["params"].items():
        for w in (1, 3):
            torch.testing.assert_close(res[w]["params"][name], value, rtol=0, atol=0)
    weight = res[0]["params"]["fc.weight"].flatten()
    torch.testing.assert_close(weight, torch.tensor([1.0, -2.0, 0.5, 3.0]), rtol=0, atol=0.05)


def test_a_hung_member_is_timed_out_left_out_and_rejoins_when_it_wakes(monkeypatch):
    """SIGSTOP (no connection reset): the survivor detects it by the collective
    timeout, goes on alone after the check-in timeout; on SIGCONT the stale
    member finds itself left out, joins again and retrains its unconfirmed steps."""
    n_records = 1024
    monkeypatch.setenv("TOY_FEED_DELAY_S", "0.02")
    spec = _job_spec(minibatch_size=16, num_minibatches_per_task=4, num_epochs=2,
                     num_workers=2, collective_timeout_s=2.0)
    rdzv = Rendezvous("127.0.0.1", free_port, settle_s=0.3, checkin_timeout_s=3.0,
                      initial_workers=2)
    tm = TaskManager(training_shards=[("mem", 0, n_records)],
                     records_per_task=spec.records_per_task, num_epochs=2)
    master = MasterStandIn(rdzv, tm)
    procs = Procs()
    try:
        for w in range(2):
            procs.start(w, _chaos_worker, master.address, w, spec.to_json(), n_records)
        deadline = time.monotonic() + 120
        while tm.counts()["completed"] < 3:
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.05)
        os.kill(procs.procs[1].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while rdzv.members() != [0] or rdzv.forming():
            assert time.monotonic() < stopped_at + 30, "worker 0 did not go on alone"
            time.sleep(0.05)
        alone_after = time.monotonic() - stopped_at
        time.sleep(1.0)                     # worker 0 trains alone for a while
        os.kill(procs.procs[1].pid, signal.SIGCONT)
        res = procs.collect([0, 1], timeout_s=50)
    finally:
        for p in procs.procs.values():
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
        procs.close()
        master.close()

    assert alone_after < 2.0 + 3.0 + 3.0   # collective timeout + check-in timeout + slack
    assert tm.finished() and tm.failure is None
    for epoch in tm.epochs_report():
        assert epoch["records_completed"] == n_records, tm.epochs_report()
    assert res[1]["failures"] and res[1]["formations"] >= 2  # it came back
    assert res[0]["version"] == res[1]["version"]
    for name, value in res[0]["params"].items():
        torch.testing.assert_close(res[1]["params"][name], value, rtol=0, atol=0)


# ------------------------------------------------- resize with a fixed global batch
ADAM_MODEL_DEF = "toy.linear_adam.custom_model"


def _logging_worker(address, worker_id: int, spec_json: str, n_records: int,
                    go: Optional[Any] = None) -> dict:
    """A member that logs, for every step it took part in, the record ranges of its
    own microbatches (the union over members is the step's global batch)."""
    if go is not None and not go.wait(60):
        raise TimeoutError("never told to join")
    from elasticdl.elastic.runner import RoundStatus

    spec = JobSpec.from_json(spec_json)
    trainer = _trainer(address, worker_id, spec, model_def=ADAM_MODEL_DEF)
    steps: dict[int, list[tuple[int, int]]] = {}
    worlds: dict[int, int] = {}
    after_round = trainer.runner.on_round

    def logging_round(result) -> None:
        if result.status == RoundStatus.STEPPED and result.tags:
            mb = spec.minibatch_size
            steps[result.version] = [(t.state.task.start + t.index * mb, t.records)
                                     for t in result.tags]
            worlds[result.version] = trainer.group.world_size
        after_round(result)

    trainer.runner.on_round = logging_round
    trainer.runner.start()
    joined_at_version = trainer.model_version
    stats = trainer.run(FakeSource(connect(address).tm(), worker_id),
                        {TaskType.TRAINING: MemoryReader(n_records)})
    return {"steps": steps, "worlds": worlds, "joined_at_version": joined_at_version,
            "version": trainer.model_version, "trained_steps": stats.steps,
            "params": {k: v.clone() for k, v in trainer.model.state_dict().items()}}


def test_a_group_grown_mid_epoch_with_a_fixed_global_batch_trains_what_one_process_would(
        monkeypatch):
    """Issue 22: a job sized for 4 with --fixed_global_batch_size starts with 2 members
    (2 accumulated minibatches each per step) and grows to 4 mid-epoch (1 each). Every
    step's global batch is read back from the members' own logs; one process replaying
    those batches, one Adam step each, from the same initial model, ends with the
    members' parameters: the resize (re-form, state and optimizer moments broadcast to
    the joiners, quotas changed) adds nothing and loses nothing."""
    n_records, epochs = 2048, 2   # ~25 s of minibatches at 2 members: the joiners are in
    monkeypatch.setenv("TOY_FEED_DELAY_S", "0.05")
    spec = _job_spec(minibatch_size=8, num_minibatches_per_task=4, num_epochs=epochs,
                     num_workers=4, fixed_global_batch_size=True, collective_timeout_s=10.0)
    rdzv = Rendezvous("127.0.0.1", free_port, settle_s=0.3, checkin_timeout_s=20,
                      initial_workers=2)
    tm = TaskManager(training_shards=[("mem", 0, n_records)],
                     records_per_task=spec.records_per_task, num_epochs=epochs,
                     max_task_retries=3)
    master = MasterStandIn(rdzv, tm)
    procs = Procs()
    try:
        go = procs.ctx.Event()
        for w in range(4):
            procs.start(w, _logging_worker, master.address, w, spec.to_json(), n_records,
                        go if w >= 2 else None)
        deadline = time.monotonic() + 120
        while tm.counts()["completed"] < 6:
            assert time.monotonic() < deadline, "training did not start"
            assert tm.failure is None
            time.sleep(0.05)
        go.set()   # two more workers join the running group, mid-epoch 0
        res = procs.collect([0, 1, 2, 3], timeout_s=150)
    finally:
        procs.close()
        master.close()

    assert tm.finished() and tm.failure is None
    assert all(e["records_completed"] == n_records for e in tm.epochs_report())
    final = {res[w]["version"] for w in res}
    assert len(final) == 1
    last = final.pop()
    batches: dict[int, list[tuple[int, int]]] = {}
    worlds: dict[int, set[int]] = {}
    for w in res:
        for v, ranges in res[w]["steps"].items():
            batches.setdefault(v, []).extend(ranges)
            worlds.setdefault(v, set()).add(res[w]["worlds"][v])
    assert sorted(batches) == list(range(1, last + 1)), "a step without a global batch"
    assert all(len(s) == 1 for s in worlds.values()), worlds
    # both sizes trained: 2 members x 2 minibatches, then 4 x 1; never more than 4
    by_world = {w: [v for v, s in worlds.items() if w in s] for w in (2, 4)}
    assert by_world[2] and by_world[4], worlds
    assert max(by_world[2]) < min(by_world[4])
    # the global batch is 4 x 8 at either size (seen: 127 of 129 steps; a member flushes
    # a short step where it ran out of tasks, at the resize and the epochs' ends)
    sizes = [sum(n for _, n in r) for r in batches.values()]
    assert all(len(r) <= 4 for r in batches.values())
    assert sum(s != 32 for s in sizes) <= 6, {k: sizes.count(k) for k in set(sizes)}
    assert res[2]["joined_at_version"] > 0 and res[3]["joined_at_version"] > 0
    # every record in exactly `epochs` steps
    seen = torch.zeros(n_records, dtype=torch.int64)
    for ranges in batches.values():
        for start, n in ranges:
            seen[start:start + n] += 1
    assert bool((seen == epochs).all()), seen.unique(return_counts=True)
    # the replay: one process, the logged global batches in version order
    data = MemoryReader(n_records)
    ref = LocalTrainer(load_model_spec(FIXTURE_ZOO, ADAM_MODEL_DEF),
                       torch.device("cpu"), seed=spec.seed)
    for v in range(1, last + 1):
        idx = [i for start, n in sorted(batches[v]) for i in range(start, start + n)]
        ref.train_minibatch(torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx]))
    for w in res:
        for name, value in ref.model.state_dict().items():
            torch.testing.assert_close(res[w]["params"][name], value, rtol=1e-4, atol=1e-5)
