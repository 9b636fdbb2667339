"""Issue 11: a malformed record fails an allreduce job at once, as in PS mode — the
worker reports the task as fatally failed (one attempt) before it exits, instead of
dying unreported and being relaunched until every worker has failed."""

from __future__ import annotations

import pytest

from elasticdl.common.task import TaskType
from elasticdl.data.api import MalformedRecordError
from elasticdl.master.rendezvous import Rendezvous
from elasticdl.master.task_manager import TaskManager
from tests.integration.dist_procs import Procs, free_port
from tests.integration.elastic_harness import FakeSource, MasterStandIn, MemoryReader, connect
from tests.integration.test_allreduce_elastic import _job_spec, _trainer

pytestmark = pytest.mark.integration


class BadRecordReader(MemoryReader):
    """Record 150 cannot be parsed (what the CSV reader raises for a broken line)."""

    def read(self, name: str, start: int, end: int) -> list[dict]:
        if start <= 150 < end:
            raise MalformedRecordError("train/part-0.csv", 150, "expected 6 fields, got 2")
        return super().read(name, start, end)


def _worker(address, worker_id: int, spec_json: str, n_records: int) -> str:
    from elasticdl.common.job_spec import JobSpec

    trainer = _trainer(address, worker_id, JobSpec.from_json(spec_json))
    source = FakeSource(connect(address).tm(), worker_id)
    try:
        trainer.run(source, {TaskType.TRAINING: BadRecordReader(n_records)})
    except MalformedRecordError as e:
        return f"raised: {e}"
    return "finished"


def test_malformed_record_is_fatal_at_the_first_report():
    n_records = 256
    spec = _job_spec(minibatch_size=16, num_minibatches_per_task=4, num_workers=1)
    rdzv = Rendezvous("127.0.0.1", free_port, settle_s=0.2, checkin_timeout_s=10)
    tm = TaskManager(training_shards=[("mem", 0, n_records)],
                     records_per_task=spec.records_per_task, num_epochs=1,
                     max_task_retries=10)
    master = MasterStandIn(rdzv, tm)
    procs = Procs()
    try:
        procs.start(0, _worker, master.address, 0, spec.to_json(), n_records)
        res = procs.collect([0], timeout_s=60)
    finally:
        procs.close()
        master.close()
    assert res[0].startswith("raised: train/part-0.csv: malformed record 150"), res[0]
    failure = tm.failure
    assert failure is not None, "the bad record was never reported to the master"
    assert failure.attempts == 1 and "malformed record 150" in failure.error
    assert failure.task.start <= 150 < failure.task.end
