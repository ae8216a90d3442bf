"""The queue of lagged checks (reprokit.lag): step order, the max_lag bound, the test seam, the lag it reports."""

from __future__ import annotations

import torch

from reprokit.lag import CheckQueue, Reading


def _reading(step: int, loss: float = 1.0) -> Reading:
    return Reading(step, torch.tensor([loss, 2.0], dtype=torch.float64), (True, True, False, False))


def test_host_readings_are_ready_at_once_and_come_back_in_step_order():
    q = CheckQueue(max_lag=8)
    for k in range(3):
        q.push(_reading(k, loss=float(k)))
    got = [q.values(r) for r in q.take(2)]
    assert [(c.step, c.loss, c.grad_norm, c.param_norm, c.scale) for c in got] == \
        [(0, 0.0, 2.0, None, None), (1, 1.0, 2.0, None, None), (2, 2.0, 2.0, None, None)]
    assert q.stats() == {"max_lag": 8, "lag_max": 2, "lag_mean": 1.0, "lag_waits": 0, "checks_pending": 0}


def test_a_reading_not_ready_holds_back_the_later_ones_until_max_lag():
    q = CheckQueue(max_lag=3)
    q.ready_after = 100  # nothing lands by itself
    for k in range(5):
        q.push(_reading(k))
        assert [r.step for r in q.take(k)] == ([k - 3] if k >= 3 else [])  # waited for at age 3 exactly
    assert len(q) == 3 and q.stats()["lag_waits"] == 2
    assert [r.step for r in q.take(4, wait=True)] == [2, 3, 4]
    assert q.stats()["lag_waits"] == 5 and q.stats()["lag_max"] == 3


def test_ready_after_lets_readings_land_that_many_steps_late():
    q = CheckQueue(max_lag=8)
    q.ready_after = 2
    q.push(_reading(0))
    q.push(_reading(1))
    assert list(q.take(1)) == []
    assert [r.step for r in q.take(2)] == [0]
    assert [r.step for r in q.take(3)] == [1]
    assert q.stats()["lag_waits"] == 0


def test_a_number_loss_and_a_reading_without_values():
    q = CheckQueue()
    q.push(Reading(4, None, (False, False, False, False), number_loss=0.5))
    (r,) = q.take(4)
    c = q.values(r)
    assert (c.step, c.loss, c.grad_norm) == (4, 0.5, None)


def test_clear_forgets_the_readings_after_a_failure():
    q = CheckQueue(max_lag=8)
    q.ready_after = 5
    for k in range(3):
        q.push(_reading(k))
    q.clear()
    assert len(q) == 0 and list(q.take(10, wait=True)) == []
