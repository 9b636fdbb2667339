"""A journal written by an older job core restores in this one.

``tests/fixtures/journal_v1/`` was written by the job core before its split
(issue 31; ``tests/fixtures/make_journal_v1.py`` says how): a snapshot plus
journal records of dispatch (single gets and leases), reports (single and
batched), versions, evaluations, a PS rollback protocol, a settle and
replica bookkeeping, stopped with an evaluation under way. ``expected.json``
is the writer's whole state at that moment."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from elasticdl.master.journal import Journal
from tests.fixtures.make_journal_v1 import EXPECTED, Clock, build_core, full_state, main

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "journal_v1"


@pytest.fixture
def restored(tmp_path: Path) -> tuple[Any, dict[str, Any], int]:
    copy = tmp_path / "journal"
    shutil.copytree(FIXTURE, copy)   # a restore may trim a torn tail: never the fixture
    os.unlink(copy / EXPECTED)
    core = build_core(Clock())
    replayed = core.restore(Journal(str(copy)))
    expected = json.loads((FIXTURE / EXPECTED).read_text(encoding="utf-8"))
    return core, expected, replayed


def test_the_v1_journal_restores_to_the_state_it_recorded(restored):
    core, expected, replayed = restored
    assert replayed > 50   # snapshot + a replay, not the snapshot alone
    assert full_state(core) == expected


def test_the_v1_journal_restores_counts_ledger_version_and_evaluation(restored):
    """The same, field by field, so a difference reads as what it is."""
    core, expected, _ = restored
    tasks = expected["tasks"]
    assert core.tm.training_records_done() == sum(
        e["records_completed"] for e in tasks["ledger"].values())
    assert {str(k): v for k, v in core.state_dict()["tasks"]["ledger"].items()} == \
        tasks["ledger"]
    assert core.tm.completed.to_flat() == tasks["completed"]
    assert core.tm.settled_version == tasks["settled_version"] == 30
    assert core.version == expected["versions"]["version"] == 48
    assert core.version_bound() == 20 + 48   # rolled back to 20, 48 minibatches out
    evaluation = core.state_dict()["evaluation"]
    assert evaluation == expected["evaluation"]
    assert evaluation["running"] == {"epoch": None, "reasons": ["periodic"], "version": 48}
    assert [e["model_version"] for e in core.report.evaluations] == \
        [e["model_version"] for e in expected["report"]["evaluations"]]
    assert core.protocols.rollbacks_done == 1 and not core.protocols.open
    assert core.replicas.live_workers == {0}
    assert not core.finished()


def test_this_core_journals_the_v1_scenario_as_the_old_one_did(tmp_path: Path):
    """The same calls make the same records, snapshot and state: the split of the
    job core changed no decision. (A later change that journals this scenario
    differently on purpose writes a journal_v2 fixture; journal_v1 stays and
    must still restore.)"""
    main(str(tmp_path / "now"))
    for name in sorted(os.listdir(FIXTURE)):
        old = (FIXTURE / name).read_text(encoding="utf-8")
        new = (tmp_path / "now" / name).read_text(encoding="utf-8")
        if name.endswith(".jsonl"):
            assert new == old, name
        else:   # the same JSON (key order may differ)
            assert json.loads(new) == json.loads(old), name
