"""One master writes a job's journal at a time: a replacement master (a new pod
while the old one is still ending) waits for the old one to release the journal
and then restores from every record it wrote; a fresh start next to a running
master is refused; a killed holder frees it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from elasticdl.master import failover
from elasticdl.master.journal import JournalLockedError


def test_a_restoring_master_waits_and_then_sees_every_record_of_the_old_one(tmp_path):
    job_dir = str(tmp_path)
    old, restoring = failover.open_journal(job_dir, restore=False)
    assert not restoring
    old.append({"op": "first"})

    def the_old_master_ends():   # serves and journals its last RPCs, then closes
        for i in range(5):
            time.sleep(0.2)
            old.append({"op": "late", "i": i})
        old.close()

    threading.Thread(target=the_old_master_ends).start()
    start = time.monotonic()
    new, restoring = failover.open_journal(job_dir, restore=True, lock_wait_s=30)
    try:
        assert restoring
        assert time.monotonic() - start >= 0.8   # it waited for the old one
        _, records = new.load()
        assert [r["op"] for r in records] == ["first"] + ["late"] * 5
        assert new.seq == 6   # it appends after the old master's last record
    finally:
        new.close()


def test_a_fresh_start_beside_a_running_master_is_refused_at_once(tmp_path):
    running, _ = failover.open_journal(str(tmp_path), restore=False)
    try:
        running.append({"op": "x"})
        start = time.monotonic()
        with pytest.raises(JournalLockedError, match=f"pid {os.getpid()}"):
            failover.open_journal(str(tmp_path), restore=False)
        assert time.monotonic() - start < 5
        # ... and its journal was not discarded
        assert [r["op"] for r in running.load()[1]] == ["x"]
    finally:
        running.close()


def test_a_restoring_master_gives_up_after_its_wait(tmp_path):
    holder, _ = failover.open_journal(str(tmp_path), restore=False)
    try:
        start = time.monotonic()
        with pytest.raises(JournalLockedError, match="after 1 s"):
            failover.open_journal(str(tmp_path), restore=True, lock_wait_s=1.0)
        assert 1.0 <= time.monotonic() - start < 10
    finally:
        holder.close()


def test_a_killed_holder_frees_the_journal(tmp_path):
    code = ("import sys, time\n"
            "from elasticdl.master import failover\n"
            "j, _ = failover.open_journal(sys.argv[1], restore=False)\n"
            "j.append({'op': 'before the kill'})\n"
            "print('held', flush=True)\n"
            "time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        with pytest.raises(JournalLockedError):
            failover.open_journal(str(tmp_path), restore=True, lock_wait_s=0.5)
        proc.kill()
        proc.wait(timeout=30)
        new, restoring = failover.open_journal(str(tmp_path), restore=True, lock_wait_s=10)
        try:
            assert restoring
            assert [r["op"] for r in new.load()[1]] == ["before the kill"]
        finally:
            new.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)
