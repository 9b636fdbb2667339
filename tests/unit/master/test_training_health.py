"""Decision tests of the training-health detector (issue 28): loss sequences in,
verdicts out; bookkeeping bounded by the windows kept."""

from __future__ import annotations

import json
import math

from elasticdl.master.training_health import HealthRule, HealthStatus, LossHealth, final_status

RULE = HealthRule(window_tasks=4)


def _feed(health: LossHealth, losses, records: int = 32) -> list[int]:
    """Feed per-task losses; the task indexes at which the verdict turned."""
    turned = []
    for i, loss in enumerate(losses):
        if health.observe(loss, records):
            turned.append(i)
    return turned


def test_a_finite_decreasing_noisy_loss_stays_healthy():
    h = LossHealth(RULE)
    losses = [2.3 * math.exp(-i / 40) + 0.05 + 0.02 * ((i * 7) % 5) for i in range(2000)]
    assert _feed(h, losses) == []
    assert h.status == HealthStatus.HEALTHY and h.windows == 500
    # late noise (best ~0.05, windows at ~0.1) is no divergence: far from the initial 2.3
    assert _feed(h, [0.12] * 40) == []
    assert len(h.means) == RULE.keep and len(json.dumps(h.state_dict())) < 2000


def test_nan_is_diverged_at_once():
    h = LossHealth(RULE)
    assert _feed(h, [2.0, 1.9, 1.8, 1.7, 1.6]) == []
    assert h.observe(float("nan"), 32)
    assert h.status == HealthStatus.DIVERGED and "non-finite" in h.reason


def test_a_task_failed_with_nonfinite_error_is_diverged():
    h = LossHealth(RULE)
    _feed(h, [2.0] * 3)
    assert h.observe(None, 0, nonfinite=True)
    assert h.status == HealthStatus.DIVERGED


def test_a_loss_rising_far_above_its_best_is_diverged_after_patience():
    h = LossHealth(RULE)
    down = [2.3 - 0.1 * i for i in range(16)]      # windows 2.15 .. 0.95
    up = [2.2] * 4 + [2.3] * 4                     # back near the initial value
    turned = _feed(h, down + up)
    assert turned == [len(down) + 7]               # the second rising window
    rep = h.report()
    assert rep["status"] == "diverged" and rep["best"] < 1.0
    assert rep["window_means"][-2:] == [2.2, 2.3] and rep["thresholds"]["patience"] == 2


def test_one_spike_is_not_divergence():
    h = LossHealth(RULE)
    _feed(h, [2.3 - 0.1 * i for i in range(16)])
    assert _feed(h, [2.5] * 4 + [0.9] * 4 + [2.5] * 4 + [0.8] * 8) == []
    assert h.healthy


def test_a_spike_that_comes_back_is_a_recovered_episode_with_its_evidence():
    """Two windows more than halfway back to the initial loss (an async PS spike), then
    three windows back near the best: the verdict turned, then ``recovered``; the job
    is healthy again (``final_status``: a plain succeeded), the episode in the report."""
    h = LossHealth(RULE)
    down = [2.3 - 0.1 * i for i in range(16)]      # windows 2.15 .. 0.95
    spike = [2.0] * 8                              # two windows at 2.0: diverged
    turned = _feed(h, down + spike)
    assert turned == [len(down) + 7] and h.status == HealthStatus.DIVERGED
    assert _feed(h, [1.1] * 8) == [] and h.status == HealthStatus.DIVERGED   # 2 of 3
    assert _feed(h, [1.0] * 4) == [] and h.status == HealthStatus.RECOVERED, h.report()
    assert h.healthy and final_status("succeeded", None) == "succeeded"
    rep = h.report()
    assert rep["status"] == "recovered" and "rose above the best" in rep["reason"]
    assert rep["episode_count"] == 1 and rep["episodes"][0]["cause"] == "rising"
    assert rep["episodes"][0]["recovered_window"] == rep["episodes"][0]["window"] + 3
    # judging goes on: a second rise is a second episode
    assert _feed(h, [2.1] * 8) == [7] and h.status == HealthStatus.DIVERGED
    assert h.report()["episode_count"] == 2 and not h.healthy


def test_the_flaky_master_kill_jobs_windows_end_recovered():
    """The window means of the digits PS job that ended succeeded_with_warnings in a
    suite run (test_ps_job_survives_master_kill; 2 workers, grads_to_wait=1): an early
    spike, then on down to 0.07."""
    h = LossHealth(RULE)
    windows = [0.99, 0.55, 1.69, 1.06, 0.5, 0.3, 0.2, 0.15, 0.1, 0.07]
    turned = _feed(h, [w for w in windows for _ in range(RULE.window_tasks)])
    assert turned == [4 * RULE.window_tasks - 1]       # diverged at the 4th window ...
    assert h.status == HealthStatus.RECOVERED          # ... recovered by the 7th
    assert h.report()["episodes"][0]["recovered_window"] == 7
    assert final_status("succeeded", None if h.healthy else (h.status, h.reason)) == \
        "succeeded"


def test_a_rise_that_does_not_come_back_stays_diverged():
    h = LossHealth(RULE)
    _feed(h, [2.3 - 0.1 * i for i in range(16)] + [2.0] * 8)
    # near but not back within best x rise_factor (0.95 x 1.25 = 1.19): still diverged
    assert _feed(h, [1.3] * 40) == [] and h.status == HealthStatus.DIVERGED


def test_a_nonfinite_loss_during_an_open_episode_sticks():
    h = LossHealth(RULE)
    _feed(h, [2.3 - 0.1 * i for i in range(16)] + [2.0] * 8)
    assert not h.observe(float("nan"), 32)
    _feed(h, [0.5] * 40)
    assert h.status == HealthStatus.DIVERGED and "non-finite" in h.reason
    assert h.report()["episodes"][-1]["cause"] == "nonfinite"


def test_a_stall_that_starts_learning_recovers():
    h = LossHealth(RULE)
    _feed(h, [math.log(10)] * 4 * (RULE.stall_windows + 1))
    assert h.status == HealthStatus.STALLED
    _feed(h, [1.5] * 4 * RULE.recover_windows)
    assert h.status == HealthStatus.RECOVERED


def test_a_loss_exploding_from_the_start_is_diverged():
    h = LossHealth(RULE)
    assert _feed(h, [2.3] * 4 + [5.0] * 4 + [50.0] * 4) == [11]
    assert h.status == HealthStatus.DIVERGED


def test_a_loss_flat_at_its_initial_value_is_stalled():
    h = LossHealth(RULE)
    # the digits async case: a spike above ln 10 in the first window, then exactly ln 10
    losses = [2.46, 2.4, 2.35, 2.31] + [math.log(10)] * 40
    turned = _feed(h, losses)
    assert h.status == HealthStatus.STALLED, h.report()
    assert turned == [4 * (RULE.stall_windows + 1) - 1]   # 6 flat windows after the first
    assert "never left its initial value" in h.reason


# DeepCTR-Torch's DeepFM as published (benchmarks/ctr_models.py, 200,000 Criteo-shaped
# records, 2 workers x 2 PS): its tasks' mean losses, in the order the master got them
DEEPCTR_TASK_LOSSES = [
    0.63, 0.633, 0.603, 0.588, 0.594, 0.6, 0.596, 0.593, 0.585, 0.586, 0.594, 0.586, 0.579,
    0.578, 0.593, 0.573, 0.577, 0.567, 0.56, 0.593, 0.563, 0.58, 0.563, 0.58, 0.583, 0.576,
    0.576, 0.58, 0.569, 0.574, 0.572, 0.565, 0.566, 0.571, 0.57, 0.565, 0.568, 0.568, 0.568,
    0.556, 0.551, 0.576, 0.551, 0.559, 0.536, 0.559, 0.567, 0.567, 0.563, 0.559, 0.57, 0.561,
    0.557, 0.538, 0.544, 0.569, 0.551, 0.551, 0.552, 0.556, 0.559, 0.555, 0.559, 0.556, 0.55,
    0.549, 0.537, 0.565, 0.557, 0.546, 0.553, 0.549, 0.556, 0.544, 0.531, 0.551, 0.551, 0.536,
    0.55, 0.55, 0.55, 0.546, 0.543, 0.546, 0.552, 0.553, 0.557, 0.543, 0.547, 0.543, 0.554,
    0.555, 0.544, 0.554, 0.563, 0.56, 0.543, 0.552]


def test_a_ctr_model_that_learned_in_its_first_window_is_not_stalled():
    """Its first window's mean (0.605) already held most of what it learns (from 0.63 to
    0.546 at best, AUC 0.735): against that mean it was called stalled, a healthy job
    reported succeeded_with_warnings (and rolled back under --on_divergence=rollback).
    The initial value is its first task's loss."""
    h = LossHealth(HealthRule(window_tasks=8))   # the default window, as the job had it
    assert _feed(h, DEEPCTR_TASK_LOSSES) == [], h.report()
    assert not h.finish(), h.report()   # the job's end judges the last 2 tasks: window 13
    assert h.windows == 13
    assert h.healthy and h.report()["first_task"] == 0.63
    assert h.initial < 0.61 and h.best > h.initial * 0.9   # within 10% of the window mean


def test_a_slowly_improving_loss_is_not_stalled():
    h = LossHealth(RULE)
    assert _feed(h, [2.3 * (0.97 ** i) for i in range(200)]) == []


def test_a_loss_that_starts_at_zero_is_judged_for_nonfinite_only():
    h = LossHealth(RULE)  # the counting fixtures: 0 in epoch 1, 16 in epoch 2
    assert _feed(h, [0.0] * 40 + [16.0] * 40) == []
    assert h.healthy
    assert h.observe(float("inf"), 8) and h.status == HealthStatus.DIVERGED


def test_state_round_trips_and_restart_judges_afresh():
    h = LossHealth(RULE)
    _feed(h, [2.3] * 4 + [5.0] * 8 + [1.0, 2.0])
    again = LossHealth(RULE)
    again.load_state_dict(json.loads(json.dumps(h.state_dict())))
    assert again.state_dict() == h.state_dict() and not again.healthy
    again.restart()
    assert again.healthy and again.restarts == 1 and again.windows == 0
    assert _feed(again, [2.3 - 0.05 * i for i in range(20)]) == []


# ----------------------------------------------------- through the job core
def _core(window_tasks: int = 2):
    from elasticdl.common.job_report import JobReport
    from elasticdl.master.job import JobCore
    from elasticdl.master.task_manager import TaskManager

    tm = TaskManager([("t", 0, 400)], records_per_task=10, num_epochs=1, max_task_retries=3)
    core = JobCore(tm, JobReport("j", "PS", "local", 1, 0), minibatch_size=10)
    core.health = LossHealth(HealthRule(window_tasks=window_tasks))
    return core


def _train(core, losses, worker_id: int = 0):
    for loss in losses:
        task = core.get(worker_id)
        if loss == "nonfinite":
            core.report_task(task.task_id, worker_id, False,
                             "NonFiniteError: non-finite loss (nan) at step 3")
        else:
            core.report_task(task.task_id, worker_id, True, loss=loss)


def test_the_core_judges_reported_losses_and_reports_the_evidence(tmp_path):
    from elasticdl.master.journal import Journal
    from elasticdl.master.training_health import final_status

    core = _core()
    core.attach_journal(Journal(str(tmp_path / "j"), fsync=False))
    core.begin()
    _train(core, [2.3, 2.3, 1.0, 0.9, 0.8, 0.7])
    assert core.health_verdict() is None
    assert final_status("succeeded", core.health_verdict()) == "succeeded"
    _train(core, [2.3] * 4)   # back at the initial value for 2 windows (patience)
    status, reason = core.health_verdict()
    assert status == HealthStatus.DIVERGED and "rose above the best" in reason
    health = core.refresh_report().to_dict()["training_health"]
    assert health["status"] == "diverged" and health["best"] == 0.75
    assert health["window_means"] == [2.3, 0.95, 0.75, 2.3, 2.3]
    assert final_status("succeeded", core.health_verdict()) == "succeeded_with_warnings"
    assert final_status("failed", core.health_verdict()) == "failed"
    # a restarted master replays the journal to the same verdict and evidence
    again = _core()
    again.restore(Journal(str(tmp_path / "j"), fsync=False))
    assert again.state_dict()["health"] == core.state_dict()["health"]
    core.restart_health()
    assert core.health_verdict() is None and core.health.restarts == 1


def test_a_task_failed_with_a_nonfinite_loss_marks_the_job_diverged():
    core = _core()
    _train(core, [2.3, 2.2, "nonfinite"])
    status, reason = core.health_verdict()
    assert status == HealthStatus.DIVERGED and "non-finite" in reason


def test_other_task_failures_are_no_evidence():
    core = _core()
    task = core.get(0)
    core.report_task(task.task_id, 0, False, "ConnectionError: PS 1 unreachable")
    assert core.health_verdict() is None and core.health.windows == 0


def test_the_dead_relu_job_of_a_real_run_is_stalled_as_collapsed():
    """The window means of a real async digits job (4 workers, Adam 1e-2, seed 0) that
    died: an early spike to 3.0, then ln 10 for good. By the loss alone it is a plateau
    below the first window (healthy, as the job ended); its collapsed steps make it
    ``stalled`` after ``patience`` windows, the rollback target before the collapse."""
    means = [3.007148, 2.305423, 2.304398, 2.306112, 2.305818]
    by_loss = LossHealth(RULE)
    for m in means:
        for _ in range(RULE.window_tasks):
            by_loss.observe(m, 32, version=0)
    assert by_loss.healthy
    h = LossHealth(RULE)
    version, turned = 0, []
    for w, m in enumerate(means):
        for _ in range(RULE.window_tasks):
            version += 4
            dead = w >= 1 or version > 12   # window 0: 1 task of 4 (not a collapsed window)
            if h.observe(m, 32, version=version, collapsed=(32, version - 3, -1) if dead
                         else (0, 0, version - 2)):
                turned.append(w)
    assert turned == [2] and h.status == HealthStatus.STALLED
    assert h.cause == "collapsed" and "identical for every record" in h.reason
    # windows 1 and 2 collapsed: since their first step's version (20 - 3); the model
    # was last seen alive at 12 - 2 (a worker's step at version 13 saw it collapsed)
    assert h.collapse_version == 17 and h.alive_version == 10 and h.rollback_version == 10
    # the core's rollback bound goes a margin further back (a detector window's versions)
    core = _core()
    core.health = h
    assert core.health_rollback_version(collapse_margin=4) == 6
    assert core.health_rollback_version(collapse_margin=32) == 0
    episode = h.report()["episodes"][-1]
    assert episode["cause"] == "collapsed" and episode["since_version"] == 17
    # the state (journaled by the job core) round-trips, older states load
    again = LossHealth(RULE)
    again.load_state_dict(json.loads(json.dumps(h.state_dict())))
    assert again.report() == h.report() and again.rollback_version == 10
    old = h.state_dict()
    old["open"] = old["open"][:4]
    del old["collapsing"], old["collapse_version"], old["alive_version"]
    LossHealth(RULE).load_state_dict(old)


def test_a_few_collapsed_steps_are_no_collapse_and_a_collapse_can_recover():
    h = LossHealth(RULE)
    # 3 of 4 tasks collapsed (75% < 90%) for many windows: not collapsed
    for i in range(40):
        h.observe(2.0 - 0.01 * i, 32, version=i, collapsed=(32, i, -1) if i % 4 else (0, 0, i))
    assert h.healthy and h.collapsing == 0
    # zero-initialised outputs collapse the first steps only: one window is no verdict
    z = LossHealth(RULE)
    for i in range(4):
        z.observe(2.0, 32, version=i, collapsed=(32, i, -1))
    for i in range(4, 40):
        z.observe(2.0 - 0.02 * i, 32, version=i)
    assert z.healthy and z.episode_count == 0
    # a verdict whose outputs differ again for recover_windows windows is recovered
    for i in range(8):
        z.observe(1.0, 32, version=100 + i, collapsed=(32, 100 + i, -1))
    assert z.status == HealthStatus.STALLED
    for i in range(4 * RULE.recover_windows):
        z.observe(0.9, 32, version=200 + i)
    assert z.status == HealthStatus.RECOVERED and z.episodes[-1]["recovered_window"]
    assert z.rollback_version == z.best_version


def test_a_counter_whose_loss_is_zero_is_not_judged_collapsed():
    h = LossHealth(RULE)
    for i in range(40):
        h.observe(0.0, 32, version=i, collapsed=(32, i, -1))
    assert h.healthy


def test_a_model_that_collapses_in_its_last_tasks_is_stalled_at_the_end():
    """A job whose model died in its last window (the async digits job of seed 3, Adam
    1e-2: 5 windows at 2.50, 2.26, 2.30, 2.33, 2.31, its exported model at chance):
    ``patience`` windows never came; the end of training judges the open window and a
    last window that collapsed."""
    def job(open_task: bool) -> LossHealth:
        h = LossHealth(RULE)
        for i in range(16):
            h.observe(2.3 - 0.01 * i, 32, version=i, collapsed=(0, 0, i))
        for i in range(16, 20):                      # the last closed window collapsed
            h.observe(2.31, 32, version=i, collapsed=(32, i, -1))
        if open_task:                                # and an open window of one task
            h.observe(2.31, 32, version=20, collapsed=(32, 20, -1))
        assert h.healthy and h.collapsing == 1
        return h

    last = job(open_task=False)
    assert last.finish() and last.status == HealthStatus.STALLED and last.cause == "collapsed"
    assert "the model the training ended with collapsed" in last.reason
    assert last.windows == 5 and last.rollback_version == 15
    assert not last.finish() and last.episode_count == 1     # again: nothing changes
    # the open window closes as the second collapsed one: the patience rule's verdict
    both = job(open_task=True)
    assert both.finish() and both.windows == 6 and "in 2 windows" in both.reason
    healthy = LossHealth(RULE)
    for i in range(18):
        healthy.observe(2.3 - 0.01 * i, 32, version=i, collapsed=(0, 0, i))
    assert not healthy.finish() and healthy.healthy and healthy.windows == 5
