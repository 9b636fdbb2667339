"""The allreduce data position: every member's stepped minibatches, agreed at a
checkpoint step by a real 2-process gloo all_gather (lost steps left out)."""

from __future__ import annotations

from typing import Any

from tests.integration.dist_procs import Procs, free_port

WORLD = 2


def _member(rank: int, port: int) -> dict[str, Any]:
    import torch.distributed as dist

    from elasticdl.common.task import Task, TaskType
    from elasticdl.elastic.dataset import BatchTag, _TaskState
    from elasticdl.elastic.trained import TrainedRecords

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        task = Task(100 + rank, TaskType.TRAINING, "s", 0, 32)
        state = _TaskState(task, list(range(32)), 4)
        tags = [BatchTag(state, i, 8) for i in range(4)]
        trained = TrainedRecords(minibatch_size=8)
        trained.stepped(tags[:2])
        trained.gather(version=10, world_size=WORLD)      # checkpoint at version 10
        first = trained.entries()
        trained.stepped(tags[2:] + [None])                # None: a filler step's tag
        if rank == 1:
            trained.lost([tags[3]])                       # re-joined: step not in the model
        trained.gather(version=20, world_size=WORLD)
        copy = TrainedRecords(8)
        copy.load_state_dict(trained.state_dict())
        return {"first": first, "second": trained.entries(), "last_saved": trained.last_saved,
                "copy": copy.entries(), "copy_last": copy.last_saved}
    finally:
        dist.destroy_process_group()


def test_members_agree_on_the_union_of_their_steps_without_the_lost_ones():
    port = free_port()
    procs = Procs()
    try:
        for r in range(WORLD):
            procs.start(r, _member, r, port)
        got = procs.collect(list(range(WORLD)), timeout_s=120)
    finally:
        procs.close()
    assert got[0] == got[1]
    assert got[0]["first"] == [(100, 0, 8), (100, 8, 8), (101, 0, 8), (101, 8, 8)]
    assert got[0]["second"] == [(100, o, 8) for o in (0, 8, 16, 24)] + \
        [(101, o, 8) for o in (0, 8, 16)]
    assert got[0]["last_saved"] == got[0]["copy_last"] == 20
    assert got[0]["copy"] == got[0]["second"]


def _survivor(rank: int, port: int) -> dict[str, Any]:
    import datetime
    import os

    import torch.distributed as dist

    from elasticdl.common.task import Task, TaskType
    from elasticdl.elastic.collective import CollectiveError
    from elasticdl.elastic.dataset import BatchTag, _TaskState
    from elasticdl.elastic.trained import TrainedRecords

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=20))
    dist.barrier()
    if rank == 1:
        os._exit(0)   # dies before the checkpoint step's gather
    task = Task(5, TaskType.TRAINING, "s", 0, 16)
    trained = TrainedRecords(minibatch_size=8)
    trained.stepped([BatchTag(_TaskState(task, list(range(16)), 2), 0, 8)])
    try:
        trained.gather(version=4, world_size=WORLD)
    except CollectiveError as e:
        return {"error": str(e)[:80], "agreed": trained.entries(),
                "last_saved": trained.last_saved, "mine": len(trained._mine)}
    return {"error": None}


def test_a_gather_a_member_died_in_fails_as_a_collective_error_and_changes_nothing():
    port = free_port()
    procs = Procs()
    try:
        for r in range(WORLD):
            procs.start(r, _survivor, r, port)
        got = procs.collect([0], timeout_s=120)[0]
    finally:
        procs.close()
    assert got["error"] and "trained records" in got["error"]
    assert got["agreed"] == [] and got["last_saved"] == 0 and got["mine"] == 1
