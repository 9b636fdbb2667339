"""The one executor of recovery protocols (DESIGN §6c): each pass of the job
controller's loop it asks :func:`~elasticdl.master.protocols.next_action` what
each open protocol needs and applies that one action. Every step change is a
journaled core transition (:mod:`elasticdl.master.recovery`) taken *before*
the side effect it names; RPCs (reading PS versions, the rollback itself) run
in a thread and their result is applied by a later pass, unless the protocol
moved on meanwhile (its ``seq`` changed: the result is stale and dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import grpc

from elasticdl.checkpoint import paths as ckpt_paths
from elasticdl.common import faults
from elasticdl.common.intervals import IntervalSet
from elasticdl.common.job_spec import JobSpec
from elasticdl.master import ps_rollback
from elasticdl.master.job import JobCore
from elasticdl.master.protocols import (
    Act,
    Action,
    Kind,
    Observed,
    Step,
    next_action,
)
from elasticdl.master.protocols import Protocol as RecoveryProtocol

logger = logging.getLogger(__name__)

RETRY_S = 2.0   # after a failed RPC step, the next try (a lost PS is noticed meanwhile)


@dataclass
class _InFlight:
    seq: int
    thread: threading.Thread
    box: dict[str, Any] = field(default_factory=dict)


class Controller(Protocol):
    """What the executor needs of the job controller (``JobController`` has it):
    the job, its core, the PS addresses, and the launches and the failure it
    applies."""

    @property
    def spec(self) -> JobSpec: ...

    @property
    def core(self) -> JobCore: ...

    @property
    def ps_addrs(self) -> Sequence[str]: ...

    def launch_ps(self, index: int, await_rollback: bool = False,
                  restore_from: Optional[str] = None) -> None: ...

    def launch_worker(self, lineage: Optional[int] = None) -> int: ...

    def fail(self, replica: str, error: str, traceback: str) -> None: ...


class ProtocolExecutor:
    """Applies protocol actions for ``controller`` (its cluster, PS addresses, core)."""

    def __init__(self, controller: Controller, rollback_budget_s: float = 600.0,
                 max_export_attempts: int = 3):
        self.c = controller
        self.core = controller.core
        self.rollback_budget_s = rollback_budget_s
        self.max_export_attempts = max_export_attempts
        self._inflight: dict[int, _InFlight] = {}
        self._retry_at: dict[int, float] = {}
        self._source_checked = False

    def _trained_live(self) -> frozenset[int]:
        """Live workers that were given a task (allreduce: they hold the model)."""
        return frozenset(w for w in self.core.replicas.live_workers if self.core.has_worked(w))

    def observed(self) -> Observed:
        live = frozenset(self.core.replicas.live_workers)
        only_trained = self.core.export_requires_training and self.core.export_source() is None
        if only_trained:   # who may export: a worker that trained (allreduce)
            live = self._trained_live()
        return Observed(self.core.protocols.incarnation, live, time.time(),
                        self.rollback_budget_s, self.max_export_attempts,
                        can_launch_exporter=not only_trained)

    def advance(self) -> None:
        """One pass: at most one action per open protocol."""
        self._export_source()
        for p in self.core.open_protocols():
            run = self._inflight.get(p.pid)
            if run is not None:
                if run.thread.is_alive():
                    continue
                del self._inflight[p.pid]
                if run.seq == p.seq:
                    self._finish(p, run.box)
                continue
            if time.monotonic() < self._retry_at.get(p.pid, 0.0):
                continue
            action = next_action(p, self.observed(), self.core.protocols.export_attempts)
            if action.act != Act.WAIT:
                logger.info("protocol %d (%s at %s): %s %s", p.pid, p.kind.value,
                            p.step.value, action.act.value, action.reason)
            self._apply(p, action)

    def _export_source(self) -> None:
        """Training is over, the final model is not exported, and no live worker
        that trained holds it (allreduce: every member that trained is gone, the
        exporter last): open the export with the final checkpoint as its source
        when the job's newest checkpoint holds every record (any worker may then
        load it and export), else without one (the export protocol fails on its
        budget, naming why). Looked for once: the exporter writes the final
        checkpoint before it exports, so it is there now or never."""
        core = self.core
        if not core.export_requires_training or self._source_checked or \
                not core.finished() or not core.export_pending():
            return
        if self._trained_live() or core.exporter() in core.replicas.live_workers:
            return
        from elasticdl.checkpoint.restore import final_checkpoint

        self._source_checked = True
        source = final_checkpoint(self.c.spec, core.version)
        core.open_export(source)
        if source is not None:
            logger.warning("no live worker holds the trained model: the final export loads "
                           "the final checkpoint %s", source)
        else:
            logger.warning("no live worker holds the trained model and the job's newest "
                           "checkpoint is not the final model")

    # ---------------------------------------------------------------- actions
    def _apply(self, p: RecoveryProtocol, action: Action) -> None:
        core, act = self.core, action.act
        if act == Act.WAIT:
            return
        if act == Act.FAIL:
            self.c.fail("master", action.reason, "")
        elif act == Act.LAUNCH_PS:
            self._set_aside(p)   # before the step: a master that dies here does it again
            launch = list(p.data["launch"])
            # alone: every PS this protocol launched restores (one lost meanwhile joins)
            restore = sorted(set(p.data.get("restore", [])) | set(launch))
            core.protocol_step(p.pid, Step.PS_LAUNCHED, launch=[], launched=launch,
                               restore=restore)
            faults.point("after_ps_launched")
            for index in launch:
                self.c.launch_ps(index, await_rollback=True, restore_from=p.data["dir"])
            core.snapshot()
        elif act == Act.CHOOSE_VERSION:
            self._start(p, self._choose_version, p)
        elif act == Act.RECHOOSE:
            core.protocol_step(p.pid, Step.PS_LAUNCHED)
        elif act == Act.ROLLBACK_ALL:
            self._start(p, self._rollback_all, p)
        elif act == Act.CLOSE:
            self._set_aside(p, below=p.data.get("new_version"))
            core.protocol_close(p.pid)
            if p.kind == Kind.ROLLBACK and p.data.get("alone"):
                logger.warning("PS recovery %d closed: PS %s restored checkpoint %s alone, "
                               "versions continue at %s there", p.pid, p.data.get("restore"),
                               p.data.get("checkpoint"), p.data.get("new_version"))
            elif p.kind == Kind.ROLLBACK:
                logger.warning("PS rollback %d closed: every PS at checkpoint %s, versions "
                               "continue at %s", p.pid, p.data.get("checkpoint"),
                               p.data.get("new_version"))
            core.snapshot()
        elif act == Act.EXPORT_LOST:
            core.export_lost(p.pid)
            logger.warning("the final export is open again: %s", action.reason)
        elif act == Act.LAUNCH_EXPORTER:
            worker_id = self.c.launch_worker()
            logger.warning("no worker left for the final export: launched worker-%d for it",
                           worker_id)

    def _set_aside(self, p: RecoveryProtocol, below: Optional[int] = None) -> None:
        """A divergence rollback: the checkpoints above its source are the diverged
        model's; set them aside (:func:`~elasticdl.checkpoint.paths.set_aside`), those
        written meanwhile (below the versions after the rollback) again at the close."""
        ckpt_dir = self.c.spec.checkpoint_dir
        if not p.data.get("set_aside") or not ckpt_dir or "://" in ckpt_dir:
            return
        moved = ckpt_paths.set_aside(ckpt_dir, int(p.data["checkpoint"]),
                                     int(below) if below is not None else None)
        if moved:
            logger.warning("divergence rollback %d: checkpoint version(s) %s set aside as "
                           "%sversion-N (written by the diverged model)", p.pid, moved,
                           ckpt_paths.DIVERGED_PREFIX)

    def _start(self, p: RecoveryProtocol, fn: Callable[..., Any], *args: Any) -> None:
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = fn(*args)
            except (grpc.RpcError, TimeoutError, ValueError) as e:
                box["error"] = e

        t = threading.Thread(target=run, name=f"protocol-{p.pid}-{p.step.value}", daemon=True)
        self._inflight[p.pid] = _InFlight(p.seq, t, box)
        t.start()

    def _finish(self, p: RecoveryProtocol, box: dict[str, Any]) -> None:
        """A step's RPCs ended (on the controller's thread)."""
        error: Optional[BaseException] = box.get("error")
        if error is not None:
            if _moved_on(error):   # a PS went past the version chosen: choose again
                self.core.protocol_step(p.pid, Step.PS_LAUNCHED)
                return
            if isinstance(error, grpc.RpcError) and \
                    error.code() == grpc.StatusCode.INVALID_ARGUMENT:   # refused: no retry
                self.c.fail("master", f"PS rollback to checkpoint {p.data.get('checkpoint')} "
                            f"refused: {error.details()}", "")
                return
            logger.warning("protocol %d at %s: %s; retrying in %.0f s", p.pid, p.step.value,
                           _describe(error), RETRY_S)
            self._retry_at[p.pid] = time.monotonic() + RETRY_S
            return
        result = box["result"]
        if p.step == Step.PS_LAUNCHED:
            self.core.protocol_step(p.pid, Step.ROLLING_BACK, new_version=result)
            faults.point("after_rollback_start")
        elif p.step == Step.ROLLING_BACK:
            faults.point("after_ps_rollback")
            applied, closed = result
            self.core.rollback_requeued(p.pid, applied, p.data["new_version"], closed)
            faults.point("after_requeue")
            self.core.snapshot()

    def _choose_version(self, p: RecoveryProtocol) -> int:
        current = ps_rollback.ps_versions(self.c.ps_addrs)
        slack = ps_rollback.alone_slack(self.c.spec.num_workers) if p.data.get("alone") \
            else ps_rollback.VERSION_SLACK
        return max(current + [int(p.data["checkpoint"])]) + 1 + slack

    def _rollback_all(self, p: RecoveryProtocol) -> tuple[dict[int, int], IntervalSet]:
        if p.data.get("alone"):   # --ps_recovery=alone: the lost PS only
            return ps_rollback.restore_alone(
                self.c.ps_addrs, p.data["restore"], int(p.data["checkpoint"]),
                int(p.data["new_version"]), protocol_id=p.pid, incarnation=p.incarnation,
                version_dir=p.data["dir"])
        return ps_rollback.rollback_each(
            self.c.ps_addrs, int(p.data["checkpoint"]), int(p.data["new_version"]),
            protocol_id=p.pid, incarnation=p.incarnation, version_dir=p.data["dir"])


def _moved_on(e: BaseException) -> bool:
    return isinstance(e, grpc.RpcError) and \
        e.code() == grpc.StatusCode.INVALID_ARGUMENT and "must exceed" in (e.details() or "")


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"
