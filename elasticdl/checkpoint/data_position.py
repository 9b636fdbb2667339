"""The data position of a checkpoint, without torch (the master reads it).

A distributed checkpoint must say which records its model was trained on, so
that a job resumed from it (``--checkpoint_dir_for_init``) trains every record
of the interrupted epoch exactly once. Two files make that possible:

* ``<checkpoint_dir>/tasks.jsonl``: the master's *task table*. Task ids are
  per run (the master starts them at a time-based value) and name their task
  (:mod:`elasticdl.common.task_blocks`): the table starts with a ``{"pieces":
  {"shards": [...], "rpt": records_per_task}}`` line (how the training shards
  are cut) and the master appends one line per *block* of ids it creates,
  before handing any of it out: ``{"blk": base, "n": count, "e": epoch,
  "seed": shuffle seed or null, "src": "train"}`` for an epoch, or with
  ``"src": [[shard, start, end, epoch], ...]`` for ranges no rule derives (the
  pending ranges of a resumed run): one line per epoch, not per task. (Tables
  of older versions have one ``{"t": id, "s": shard, "a": start, "b": end,
  "e": epoch}`` line per task; they are still read.) A resumed run starts its
  table with a ``{"base": ...}`` line: the data position it resumed from
  (epochs created, per-epoch counts of the records already in the model),
  then the tasks of earlier runs it resumed whole under their own ids
  (per-task lines, below; see :func:`position`).
  Appends are single ``write`` calls of one line, so a killed master leaves at
  most a torn last line, which is skipped.
* ``<checkpoint_dir>/version-N/data_position.json``: a single writer that has
  the task manager at hand (Local) writes its state directly.
* ``<checkpoint_dir>/version-N/trained-<writer>.json``: what the model of
  version N contains: ``{"trained": [[task_id, offset, records], ...]}``
  (``offset`` records into the task), or the compact form ``{"generation": g,
  "closed": [lo, hi, ...], "entries": [[task_id, offset, records], ...]}``:
  every task in the ``closed`` intervals whole, ``entries`` only for tasks not
  closed. Parameter servers write one per PS from their applied-identity
  ledgers (a minibatch counts only when every PS applied it); allreduce rank 0
  writes ``trained-group.json`` with what every member trained up to N
  (exchanged with every step's meta). Written before the version's ``DONE``
  marker.

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
from typing import Any, NamedTuple, Optional

from elasticdl.checkpoint.paths import CheckpointError, resolve, version_of
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.task import Task, TaskType
from elasticdl.common.task_blocks import Block, PieceSource, gaps

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
                          closed: IntervalSet, entries: Iterable[tuple[int, int, int]]) -> str:
    """Write the compact form for ``writer`` (atomic): the tasks in ``closed``
    whole, ``entries`` (``[task_id, offset, records]``) for the others."""
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
    other task, ``{offset: records}`` (common to every writer). ``writers``:
    each writer's name and own ``(closed, entries)``, in name order (several
    PS need not hold the same pushes at one version: async PS, or sync PS whose
    groups formed in another order)."""

    def __init__(self, closed: IntervalSet, entries: Trained,
                 writers: Optional[list[tuple[str, IntervalSet, Trained]]] = None):
        self.closed = closed
        self.entries = entries
        self.writers = writers or []

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
    writers = [(_TRAINED.match(n).group(1), c, e)  # type: ignore[union-attr]
               for n, (c, e) in zip(names, parts)]
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
    return TrainedSet(closed, out, writers)


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


def read_position(version_dir: str, carry: Optional[Carry] = None) -> Optional[dict[str, Any]]:
    """The data position a version directory records, in either form
    (``data_position.json``, or trained records + the directory's task table);
    None when it records none. ``carry``: the resuming run's PS (see
    :func:`position`).

    Raises:
        CheckpointError: trained records without a task table.
    """
    path = os.path.join(version_dir, POSITION)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return dict(json.load(f))
    trained = read_trained_set(version_dir)
    if trained is None:
        return None
    base, blocks, sources = read_table_blocks(os.path.dirname(os.path.normpath(version_dir)))
    return position(base, blocks, trained, sources, carry)


# ---------------------------------------------------------------- task table
class TaskTable:
    """The master's append-only table of training task blocks (module docs).

    Creating one starts a fresh table in ``checkpoint_dir`` (replacing an older
    one atomically) whose first lines are ``base`` when the run resumed and
    ``pieces`` (how the training shards are cut, :class:`PieceSource`), then
    one per-task line per earlier run's task resumed under its own id.
    """

    def __init__(self, checkpoint_dir: str, base: Optional[dict[str, Any]] = None,
                 pieces: Optional[PieceSource] = None, carried: Iterable[list[Any]] = ()):
        os.makedirs(checkpoint_dir, exist_ok=True)
        self.path = os.path.join(checkpoint_dir, TABLE)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            if base is not None:
                f.write(json.dumps({"base": base}, separators=(",", ":")) + "\n")
            if pieces is not None:
                f.write(json.dumps({"pieces": pieces.to_json()}, separators=(",", ":")) + "\n")
            for shard, a, b, e, task_id in carried:   # an earlier run's tasks, resumed whole
                f.write(json.dumps({"t": task_id, "s": shard, "a": a, "b": b, "e": e},
                                   separators=(",", ":")) + "\n")
        os.replace(tmp, self.path)
        # unbuffered: each line reaches the file in one write before the task is handed out
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def record(self, block: Block) -> None:
        """Append a block of training tasks (other types are not part of the data
        position)."""
        if block.type != TaskType.TRAINING:
            return
        src = block.source if isinstance(block.source, str) else \
            [list(p) for p in block.source]
        line = json.dumps({"blk": block.base, "n": block.count, "e": block.epoch,
                           "seed": block.seed, "src": src}, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode("utf-8"))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_table_blocks(checkpoint_dir: str) -> tuple[Optional[dict[str, Any]], list[Block],
                                                    dict[str, Any]]:
    """The base position, the training task blocks and the piece sources of
    ``checkpoint_dir``'s table (a per-task line of an older table is a block of
    one explicit task).

    Raises:
        CheckpointError: there is no table, or a damaged one.
    """
    path = os.path.join(checkpoint_dir, TABLE)
    if not os.path.exists(path):
        raise CheckpointError(f"{checkpoint_dir} has no task table ({TABLE}): it was not "
                              "written by a distributed job of this version")
    base: Optional[dict[str, Any]] = None
    blocks: list[Block] = []
    sources: dict[str, Any] = {}
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
        try:
            if "base" in row:
                base = row["base"]
            elif "pieces" in row:
                sources["train"] = PieceSource.from_json(row["pieces"])
            elif "blk" in row:
                src = row["src"] if isinstance(row["src"], str) else [
                    (str(n), int(a), int(b), int(e)) for n, a, b, e in row["src"]]
                if isinstance(src, str) and src not in sources:
                    raise CheckpointError(f"{path}:{i + 1}: a block of {src!r} pieces "
                                          "before the table's pieces line")
                blocks.append(Block(int(row["blk"]), int(row["n"]), TaskType.TRAINING, src,
                                    int(row["e"]), -1,
                                    None if row["seed"] is None else int(row["seed"])))
            else:
                blocks.append(Block(int(row["t"]), 1, TaskType.TRAINING,
                                    [(str(row["s"]), int(row["a"]), int(row["b"]),
                                      int(row["e"]))], -1))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{path}:{i + 1}: not a task table line ({e})") from e
    return base, blocks, sources


def read_table(checkpoint_dir: str) -> tuple[Optional[dict[str, Any]], list[Task]]:
    """The base position and every training task of ``checkpoint_dir``'s table
    (O(tasks): for tests and tools; resuming reads the blocks).

    Raises:
        CheckpointError: there is no table.
    """
    base, blocks, sources = read_table_blocks(checkpoint_dir)
    return base, [b.task(p, sources) for b in blocks for p in range(b.count)]


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


def _empty_led() -> dict[str, int]:
    return {"records_completed": 0, "records_applied": 0, "records_redone": 0,
            "tasks_completed": 0}


class Carry(NamedTuple):
    """How the resuming run pushes: ``num_ps`` PS restoring their own shard's
    ledger, minibatches of ``minibatch_size`` records (the ledger's identities
    ``(task, k)`` name the same records only then)."""

    num_ps: int
    minibatch_size: int

    def fits(self, trained: TrainedSet) -> bool:
        names = sorted(w for w, _, _ in trained.writers)
        return self.num_ps > 0 and self.minibatch_size > 0 and \
            names == sorted(f"ps-{i}-of-{self.num_ps}" for i in range(self.num_ps))


def _aligned(task: Task, views: list[dict[int, int]], minibatch: int) -> bool:
    n = task.end - task.start
    return all(o % minibatch == 0 and r == min(minibatch, n - o)
               for view in views for o, r in view.items())


def position(base: Optional[dict[str, Any]], blocks: list[Block], trained: TrainedSet,
             sources: dict[str, Any], carry: Optional[Carry] = None) -> dict[str, Any]:
    """The :meth:`TaskManager.load_state_dict` state: ``base`` plus, per task of
    the table's blocks, its trained records counted and its untrained ranges
    pending. Costs O(tasks not closed), not O(tasks): the closed ones of a block
    count as its records less those of the others.

    A task the writers (PS) hold differently — one PS applied a minibatch the
    other had not yet when each wrote this version — has no range that is
    pending everywhere and trained nowhere. With ``carry`` (the resuming run's
    PS restore these shards' ledgers, same minibatch size) it is pending whole
    under its own id, ``[shard, start, end, epoch, task_id]``, and counts
    nothing yet: each PS skips the minibatches its ledger holds, as for a task
    re-issued within a run. Without (another number of PS, another strategy) the
    minibatches only some PS hold are trained again on those PS (warned)."""
    base = base or {}
    ledger: dict[int, dict[str, int]] = {
        int(e): {"records_completed": int(v.get("records_completed", 0)),
                 "records_applied": int(v.get("records_applied",
                                              v.get("records_completed", 0))),
                 "records_redone": 0, "tasks_completed": int(v.get("tasks_completed", 0))}
        for e, v in base.get("ledger", {}).items()}
    epochs = int(base.get("epochs_created", 0))
    pending: list[list[Any]] = []
    can_carry = carry is not None and carry.fits(trained)
    carried = twice = 0
    for block in blocks:
        # the block's whole records and tasks per epoch, less those not closed below
        whole: dict[int, list[int]] = {}
        if isinstance(block.source, str):
            whole[block.epoch] = [sources[block.source].records, block.count]
        else:
            for _, a, b, e in block.source:
                w = whole.setdefault(e, [0, 0])
                w[0] += b - a
                w[1] += 1
        for lo, hi in gaps(trained.closed, block.base, block.base + block.count):
            for task_id in range(lo, hi):
                task = block.task(task_id - block.base, sources)
                w = whole[task.epoch]
                # each writer's own view of the task: its untrained ranges
                views = [e.get(task_id, {}) for _, c, e in trained.writers if task_id not in c]
                lefts = {() if task_id in c else tuple(untrained_ranges(task, e.get(task_id, {})))
                         for _, c, e in trained.writers}
                if len(lefts) > 1 and can_carry and \
                        _aligned(task, views, carry.minibatch_size):  # type: ignore[union-attr]
                    pending.append([task.shard_name, task.start, task.end, task.epoch, task_id])
                    w[0] -= task.end - task.start
                    w[1] -= 1
                    carried += 1
                    continue
                left = untrained_ranges(task, trained.entries.get(task_id, {}))
                if len(lefts) > 1:
                    twice += sum(b - a for a, b in left) - \
                        min(sum(b - a for a, b in x) for x in lefts)
                untrained = sum(b - a for a, b in left)
                w[0] -= untrained
                w[1] -= 1 if left else 0
                pending.extend([task.shard_name, a, b, task.epoch] for a, b in left)
        for e, (records, tasks) in whole.items():
            epochs = max(epochs, e + 1)
            led = ledger.setdefault(e, _empty_led())
            led["records_completed"] += records
            led["records_applied"] += records
            led["tasks_completed"] += tasks
    for e in range(epochs):
        ledger.setdefault(e, _empty_led())
    if carried:
        logger.info("%d task(s) are held differently by the PS of this checkpoint: pending "
                    "whole under their own ids (each PS skips what its ledger holds)", carried)
    if twice:
        logger.warning("this checkpoint's PS hold some minibatches differently and this run "
                       "cannot restore their ledgers (another number of PS, another strategy "
                       "or minibatch size): up to %d record(s) will be trained a second time "
                       "on the PS that hold them", twice)
    # the earlier runs' task ids: this run's start above them (a clock set back between
    # runs would otherwise reuse ids the restored PS ledgers hold)
    floor = max([int(base.get("id_floor", 0))] + [b.base + b.count for b in blocks])
    return {"epochs_created": epochs, "pending": pending, "ledger": ledger, "id_floor": floor}


def resume_state(init_path: str, carry: Optional[Carry] = None) -> Optional[dict[str, Any]]:
    """The data position to resume from for ``--checkpoint_dir_for_init``: the
    newest complete checkpoint there (or that version directory) and the task
    table of its directory. None (with a warning: the data starts over) when
    the checkpoint records no trained records.

    Raises:
        CheckpointError: no complete checkpoint, or trained records but no table.
    """
    vdir = resolve(init_path)
    found = read_position(vdir, carry)
    if found is None:
        logger.warning("checkpoint %s records no data position; training data starts over "
                       "from the first epoch", vdir)
        return None
    state = position({"epochs_created": found["epochs_created"], "ledger": found["ledger"]},
                     [], TrainedSet(IntervalSet(), {}), {})
    state["pending"] = [list(p) for p in found["pending"]]
    state["id_floor"] = int(found.get("id_floor", 0))
    state["from_version"] = version_of(vdir)
    done = {e: v["records_completed"] for e, v in sorted(state["ledger"].items())}
    logger.info("resuming the data position of %s: %d epoch(s) created, records in the "
                "model per epoch %s, %d pending range(s)", vdir, state["epochs_created"],
                done, len(state["pending"]))
    return state


def attach(task_manager: Any, checkpoint_dir: str, init_path: str = "",
           carry: Optional[Carry] = None) -> Optional[TaskTable]:
    """Resume ``task_manager`` from ``init_path``'s data position (if any) and
    record its training tasks in ``checkpoint_dir``'s table (if set; the tasks
    pending under their own ids, ``carry``, are in it from the start).

    The call site of the master: the table is read before a new one replaces
    it (when both directories are the same).
    """
    state = resume_state(init_path, carry) if init_path else None
    table = None
    if checkpoint_dir:
        base = None if state is None else {"epochs_created": state["epochs_created"],
                                           "ledger": state["ledger"],
                                           "id_floor": state["id_floor"],
                                           "from": os.path.abspath(init_path)}
        pieces = getattr(task_manager, "_train_pieces", None)
        table = TaskTable(checkpoint_dir, base,
                          pieces if isinstance(pieces, PieceSource) else None,
                          [] if state is None else [p for p in state["pending"] if len(p) == 5])
        task_manager.block_created_callbacks.append(table.record)
    if state is not None:
        task_manager.load_state_dict(state)
    return table
