"""The data position of a checkpoint, without torch (the master reads it).

A distributed checkpoint must say which records its model was trained on, so
that a job resumed from it (``--checkpoint_dir_for_init``) trains every record
of the interrupted epoch exactly once. Two files make that possible:

* ``<checkpoint_dir>/tasks.jsonl``: the master's *task table*. Task ids are
  per run (the master starts them at a time-based value), so the master
  appends every training task it creates, ``{"t": id, "s": shard, "a": start,
  "b": end, "e": epoch}``, before handing it out. A resumed run starts its
  table with a ``{"base": ...}`` line: the data position it resumed from
  (epochs created, per-epoch counts of the records already in the model).
  Appends are single ``write`` calls of one line, so a killed master leaves at
  most a torn last line, which is skipped.
* ``<checkpoint_dir>/version-N/data_position.json``: a single writer that has
  the task manager at hand (Local) writes its state directly.
* ``<checkpoint_dir>/version-N/trained-<writer>.json``: what the model of
  version N contains, as ``[task_id, offset, records]`` triples (``offset``
  records into the task). Parameter servers write one per PS from their
  applied-identity ledgers (a minibatch counts only when every PS applied
  it); allreduce rank 0 writes ``trained-group.json`` with what every member
  trained up to N (exchanged with every step's meta). Written before the
  version's ``DONE`` marker.

:func:`resume_state` combines the newest complete checkpoint with the table of
its directory into the state :meth:`TaskManager.load_state_dict` takes:
partially trained tasks resume after their trained records, and each epoch's
``records_completed`` counts what was in the model.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any, Optional

from elasticdl.checkpoint.paths import CheckpointError, resolve, version_of
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import Task, TaskType

logger = logging.getLogger(__name__)

TABLE = "tasks.jsonl"
POSITION = "data_position.json"   # a single writer's own position (Local: TaskManager state)
_TRAINED = re.compile(r"^trained-(.+)\.json$")

Trained = dict[int, dict[int, int]]   # task id -> {offset in the task: records}


# ------------------------------------------------------------ trained records
def trained_path(version_dir: str, writer: str) -> str:
    return os.path.join(version_dir, f"trained-{writer}.json")


def write_trained(version_dir: str, writer: str,
                  entries: Iterable[tuple[int, int, int]]) -> str:
    """Write ``[task_id, offset, records]`` triples for ``writer`` (atomic)."""
    os.makedirs(version_dir, exist_ok=True)
    path = trained_path(version_dir, writer)
    rows = sorted({(int(t), int(o)): int(r) for t, o, r in entries if r > 0}.items())
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"trained": [[t, o, r] for (t, o), r in rows]}, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def write_trained_compact(version_dir: str, writer: str, generation: int,
                          closed: IntervalSet,
                          entries: Iterable[tuple[int, int, int]]) -> str:
    """Write the compact form (atomic): ``{"generation", "closed": flat intervals of
    tasks fully in the model, "entries": [[task_id, offset, records], ...]}`` with
    entries only for tasks not closed: O(live), whatever the job's length."""
    os.makedirs(version_dir, exist_ok=True)
    path = trained_path(version_dir, writer)
    rows = sorted({(int(t), int(o)): int(r) for t, o, r in entries
                   if r > 0 and int(t) not in closed}.items())
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"generation": int(generation), "closed": closed.to_flat(),
                   "entries": [[t, o, r] for (t, o), r in rows]}, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


class TrainedSet:
    """What a checkpoint's model holds: every task in ``closed`` whole and, per
    other task, ``{offset: records}`` (common to every writer)."""

    def __init__(self, closed: IntervalSet, entries: Trained):
        self.closed = closed
        self.entries = entries

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrainedSet) and self.closed == other.closed and \
            self.entries == other.entries


def _read_writer(path: str) -> tuple[IntervalSet, dict[int, dict[int, int]]]:
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
            if "trained" in doc:
                closed, rows = IntervalSet(), doc["trained"]
            else:
                closed, rows = IntervalSet.from_flat(doc["closed"]), doc["entries"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: not a trained-records file ({e})") from e
    entries: dict[int, dict[int, int]] = {}
    for t, o, r in rows:
        entries.setdefault(int(t), {})[int(o)] = int(r)
    return closed, entries


def read_trained_set(version_dir: str) -> Optional[TrainedSet]:
    """What the model of a version directory contains (either form of every
    writer's file); None when it records nothing. Several writers (one per PS):
    a task is whole when every writer has it closed, else a record counts only
    when every writer that has not closed it has it."""
    names = sorted(n for n in os.listdir(version_dir) if _TRAINED.match(n))
    if not names:
        return None
    parts = [_read_writer(os.path.join(version_dir, n)) for n in names]
    closed = parts[0][0]
    for c, _ in parts[1:]:
        closed = closed.intersection(c)
    out: Trained = {}
    for task in set().union(*(e.keys() for _, e in parts)):
        if task in closed:
            continue
        common: Optional[dict[int, int]] = None
        for c, e in parts:
            if task in c:
                continue   # whole on that writer: no constraint
            mine = e.get(task, {})
            common = dict(mine) if common is None else \
                {o: r for o, r in common.items() if o in mine}
        if common:
            out[task] = common
    return TrainedSet(closed, out)


def read_trained(version_dir: str) -> Optional[Trained]:
    """The per-task records of a version directory's trained files (tasks a
    compact file holds whole are in :func:`read_trained_set`'s ``closed`` only);
    None when it records nothing."""
    found = read_trained_set(version_dir)
    return None if found is None else found.entries


def write_position(version_dir: str, state: dict[str, Any]) -> str:
    """Write a :meth:`TaskManager.state_dict` as ``data_position.json`` (atomic), so
    that a checkpoint written with its task manager at hand (Local) resumes in
    every mode, the torch-free master included."""
    os.makedirs(version_dir, exist_ok=True)
    path = os.path.join(version_dir, POSITION)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def read_position(version_dir: str) -> Optional[dict[str, Any]]:
    """The data position a version directory records, in either form
    (``data_position.json``, or trained records + the directory's task table);
    None when it records none.

    Raises:
        CheckpointError: trained records without a task table.
    """
    path = os.path.join(version_dir, POSITION)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f))
    found = read_trained_set(version_dir)
    if found is None:
        return None
    base, tasks = read_table(os.path.dirname(os.path.normpath(version_dir)))
    return position(base, tasks, found.entries, found.closed)


# ---------------------------------------------------------------- task table
class TaskTable:
    """The master's append-only table of training tasks (module docs).

    Creating one starts a fresh table in ``checkpoint_dir`` (replacing an older
    one atomically) whose first line is ``base`` when the run resumed.
    """

    def __init__(self, checkpoint_dir: str, base: Optional[dict[str, Any]] = None):
        os.makedirs(checkpoint_dir, exist_ok=True)
        self.path = os.path.join(checkpoint_dir, TABLE)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            if base is not None:
                f.write(json.dumps({"base": base}, separators=(",", ":")) + "\n")
        os.replace(tmp, self.path)
        # unbuffered: each line reaches the file in one write before the task is handed out
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def record(self, task: Task) -> None:
        """Append a training task (other types are not part of the data position)."""
        if task.type != TaskType.TRAINING:
            return
        line = json.dumps({"t": task.task_id, "s": task.shard_name, "a": task.start,
                           "b": task.end, "e": task.epoch}, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode("utf-8"))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_table(checkpoint_dir: str) -> tuple[Optional[dict[str, Any]], list[Task]]:
    """The base position and the training tasks of ``checkpoint_dir``'s table.

    Raises:
        CheckpointError: there is no table.
    """
    path = os.path.join(checkpoint_dir, TABLE)
    if not os.path.exists(path):
        raise CheckpointError(f"{checkpoint_dir} has no task table ({TABLE}): it was not "
                              "written by a distributed job of this version")
    base: Optional[dict[str, Any]] = None
    tasks: list[Task] = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if i >= len(lines) - 2:   # a torn last line: the master was killed mid-write
                logger.warning("%s: torn last line skipped", path)
                continue
            raise CheckpointError(f"{path}:{i + 1}: not JSON") from None
        if "base" in row:
            base = row["base"]
        else:
            tasks.append(Task(int(row["t"]), TaskType.TRAINING, str(row["s"]), int(row["a"]),
                              int(row["b"]), int(row["e"])))
    return base, tasks


# ------------------------------------------------------------------- resume
def untrained_ranges(task: Task, trained: dict[int, int]) -> list[tuple[int, int]]:
    """``(start, end)`` record ranges of ``task`` not in ``trained`` (offset -> records)."""
    out = []
    pos = task.start
    for offset, records in sorted(trained.items()):
        a, b = task.start + offset, min(task.start + offset + records, task.end)
        if a > pos:
            out.append((pos, min(a, task.end)))
        pos = max(pos, b)
    if pos < task.end:
        out.append((pos, task.end))
    return [(a, b) for a, b in out if a < b]


def position(base: Optional[dict[str, Any]], tasks: list[Task],
             trained: Trained, closed: Optional[IntervalSet] = None) -> dict[str, Any]:
    """The :meth:`TaskManager.load_state_dict` state: ``base`` plus, per task of
    the table, its trained records counted and its untrained ranges pending."""
    base = base or {}
    ledger: dict[int, dict[str, int]] = {
        int(e): {"records_completed": int(v.get("records_completed", 0)),
                 "records_applied": int(v.get("records_applied",
                                              v.get("records_completed", 0))),
                 "records_redone": 0, "tasks_completed": int(v.get("tasks_completed", 0))}
        for e, v in base.get("ledger", {}).items()}
    epochs = int(base.get("epochs_created", 0))
    pending: list[list[Any]] = []
    for task in tasks:
        epochs = max(epochs, task.epoch + 1)
        led = ledger.setdefault(task.epoch, {"records_completed": 0, "records_applied": 0,
                                             "records_redone": 0, "tasks_completed": 0})
        left = [] if closed is not None and task.task_id in closed else \
            untrained_ranges(task, trained.get(task.task_id, {}))
        done = task.num_records - sum(b - a for a, b in left)
        led["records_completed"] += done
        led["records_applied"] += done
        if not left:
            led["tasks_completed"] += 1
        pending.extend([task.shard_name, a, b, task.epoch] for a, b in left)
    for e in range(epochs):
        ledger.setdefault(e, {"records_completed": 0, "records_applied": 0,
                              "records_redone": 0, "tasks_completed": 0})
    return {"epochs_created": epochs, "pending": pending, "ledger": ledger}


def resume_state(init_path: str) -> Optional[dict[str, Any]]:
    """The data position to resume from for ``--checkpoint_dir_for_init``: the
    newest complete checkpoint there (or that version directory) and the task
    table of its directory. None (with a warning: the data starts over) when
    the checkpoint records no trained records.

    Raises:
        CheckpointError: no complete checkpoint, or trained records but no table.
    """
    vdir = resolve(init_path)
    found = read_position(vdir)
    if found is None:
        logger.warning("checkpoint %s records no data position; training data starts over "
                       "from the first epoch", vdir)
        return None
    state = position({"epochs_created": found["epochs_created"], "ledger": found["ledger"]},
                     [], {})
    state["pending"] = [list(p) for p in found["pending"]]
    state["from_version"] = version_of(vdir)
    done = {e: v["records_completed"] for e, v in sorted(state["ledger"].items())}
    logger.info("resuming the data position of %s: %d epoch(s) created, records in the "
                "model per epoch %s, %d pending range(s)", vdir, state["epochs_created"],
                done, len(state["pending"]))
    return state


def attach(task_manager: Any, checkpoint_dir: str, init_path: str = "") -> Optional[TaskTable]:
    """Resume ``task_manager`` from ``init_path``'s data position (if any) and
    record its training tasks in ``checkpoint_dir``'s table (if set).

    The call site of the master: the table is read before a new one replaces
    it (when both directories are the same).
    """
    state = resume_state(init_path) if init_path else None
    table = None
    if checkpoint_dir:
        base = None if state is None else {"epochs_created": state["epochs_created"],
                                           "ledger": state["ledger"],
                                           "from": os.path.abspath(init_path)}
        table = TaskTable(checkpoint_dir, base)
        task_manager.task_created_callbacks.append(table.record)
    if state is not None:
        task_manager.load_state_dict(state)
    return table
