"""What every member knows is in the model: microbatch identities ride on the step's
meta all-reduce (a real 2-process gloo all-reduce of the encoded blocks), each member
records the summed block, a re-queued task's minibatches in it are skipped."""

from __future__ import annotations

from typing import Any

from elasticdl.common.task import Task, TaskType
from elasticdl.elastic.trained import TrainedRecords
from elasticdl.worker.elastic_dataset import BatchTag, _TaskState
from tests.integration.dist_procs import Procs, free_port

WORLD = 2


def _tags(task_id: int, n: int, mb: int = 8) -> list[BatchTag]:
    state = _TaskState(Task(task_id, TaskType.TRAINING, "s", 0, n * mb), list(range(n * mb)), n)
    return [BatchTag(state, i, mb) for i in range(n)]


def _member(rank: int, port: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        trained = TrainedRecords(minibatch_size=8)
        tags = _tags(2**60 + 100 + rank, 4)
        for step in range(3):   # two slots per member (gradient accumulation)
            mine = tags[step:step + 1] + ([None] if rank == 0 else [])   # None: filler
            block = torch.tensor([1.0] + trained.encode(mine, rank, WORLD, slots=2),
                                 dtype=torch.float64)
            dist.all_reduce(block)
            trained.record(block.tolist()[1:])
        return {"entries": trained.entries(),
                "done_0": sorted(trained.minibatches_of(2**60 + 100, 4)),
                "done_1": sorted(trained.minibatches_of(2**60 + 101, 4))}
    finally:
        dist.destroy_process_group()


def test_every_member_records_every_members_minibatches_from_the_step_meta():
    port = free_port()
    procs = Procs()
    try:
        for r in range(WORLD):
            procs.start(r, _member, r, port)
        got = procs.collect(list(range(WORLD)), timeout_s=120)
    finally:
        procs.close()
    assert got[0] == got[1]
    assert got[0]["entries"] == [(2**60 + 100, o, 8) for o in (0, 8, 16)] + \
        [(2**60 + 101, o, 8) for o in (0, 8, 16)]
    assert got[0]["done_0"] == got[0]["done_1"] == [0, 1, 2]


def test_identities_survive_large_task_ids_and_the_state_round_trip():
    # a run's task ids start at a large base: beyond float64's exact integers (2**53)
    trained = TrainedRecords(minibatch_size=4)
    tags = _tags(117668364739280898, 3, mb=4)
    trained.record(trained.encode(tags[1:], rank=1, world_size=3, slots=2))
    assert trained.holds(tags[1]) and trained.holds(tags[2]) and not trained.holds(tags[0])
    assert not trained.holds(None)
    copy = TrainedRecords(4)
    copy.load_state_dict(trained.state_dict())
    assert copy.minibatches_of(117668364739280898, 3) == {1, 2}
    assert copy.entries() == [(117668364739280898, 4, 4), (117668364739280898, 8, 4)]


def test_more_microbatches_than_slots_is_an_error():
    trained = TrainedRecords(minibatch_size=8)
    try:
        trained.encode(_tags(1, 3), rank=0, world_size=1, slots=2)
    except RuntimeError as e:
        assert "room for 2" in str(e)
    else:
        raise AssertionError("no error")
