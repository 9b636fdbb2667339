"""--autoscale: the throughput-driven sizing decisions (elasticdl/master/autoscale.py),
against a simulated job whose throughput saturates."""

from __future__ import annotations

import pytest

from elasticdl.master.autoscale import AutoScaler, Phase


def simulate(scaler: AutoScaler, rate_of, seconds: int, start_delay_s: int = 5,
             capacity: int = 100):
    """Steps the scaler once a second over a job whose records/s at n running workers
    is ``rate_of(n)``; an added worker runs ``start_delay_s`` after it is asked for
    (never beyond ``capacity``), a given-back one stops at once. Returns the resizes
    and the running count each second."""
    records, running, asked_at = 0.0, scaler.target, {}
    resizes, trace = [], []
    for now in range(seconds):
        for n, t in list(asked_at.items()):
            if now - t >= start_delay_s and n <= capacity:
                running = max(running, n)
                del asked_at[n]
        records += rate_of(running)
        decision = scaler.step(float(now), int(records), running)
        if decision is not None:
            target, reason = decision
            resizes.append((now, target, reason))
            if target > running:
                asked_at[target] = now
            else:
                running = target
                asked_at.clear()
        trace.append(running)
    return resizes, trace


def test_grows_while_each_worker_pays_and_gives_back_the_one_that_does_not():
    scaler = AutoScaler(0.3, floor=1, ceiling=4, settle_s=3, window_s=10, hold_s=1000)
    resizes, trace = simulate(scaler, lambda n: 80.0 * min(n, 2), 120)
    targets = [t for _, t, _ in resizes]
    assert targets == [2, 3, 2], resizes
    assert "given back" in resizes[-1][2] and "under 0.3 x" in resizes[-1][2]
    assert trace[-1] == 2 and scaler.phase == Phase.HOLD
    assert scaler.rates[1] == pytest.approx(80, rel=0.05)
    assert scaler.rates[2] == pytest.approx(160, rel=0.05)


def test_linear_scaling_reaches_max_and_holds():
    scaler = AutoScaler(0.5, floor=2, ceiling=4, settle_s=2, window_s=5)
    resizes, trace = simulate(scaler, lambda n: 50.0 * n, 80)
    assert [t for _, t, _ in resizes] == [3, 4]
    assert trace[-1] == 4 and scaler.phase == Phase.HOLD


def test_a_worker_that_never_runs_is_given_back():
    scaler = AutoScaler(0.2, floor=1, ceiling=3, settle_s=2, window_s=5, start_timeout_s=20)
    resizes, trace = simulate(scaler, lambda n: 40.0 * n, 80, capacity=1)
    assert [t for _, t, _ in resizes] == [2, 1], resizes
    assert "not running after 20 s (no capacity)" in resizes[-1][2]
    assert trace[-1] == 1


def test_probes_again_after_holding():
    scaler = AutoScaler(0.3, floor=1, ceiling=3, settle_s=2, window_s=5, hold_s=30)
    resizes, _ = simulate(scaler, lambda n: 80.0 * min(n, 2), 150)
    targets = [t for _, t, _ in resizes]
    assert targets[:3] == [2, 3, 2] and targets[3:5] == [3, 2], resizes


def test_a_lost_worker_restarts_the_measurement():
    scaler = AutoScaler(0.3, floor=1, ceiling=3, settle_s=2, window_s=10)
    assert scaler.step(0.0, 0, 1) is None            # settle starts
    assert scaler.step(2.0, 100, 1) is None          # measuring from here
    assert scaler.step(5.0, 400, 0) is None          # the worker died: no rate from this
    assert scaler.phase == Phase.SETTLE and 1 not in scaler.rates


def test_rebound_keeps_the_size_within_the_new_range():
    scaler = AutoScaler(0.3, floor=1, ceiling=4, target=3)
    assert scaler.rebound(1, 2, 0.0) == 2
    assert scaler.rebound(3, 5, 0.0) == 3 and scaler.phase == Phase.SETTLE


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_a_fraction_outside_0_1_is_refused(fraction):
    with pytest.raises(ValueError, match="--autoscale expects a fraction"):
        AutoScaler(fraction, floor=1, ceiling=2)
