"""Lagged checks on real CPU loops: a step's checks are judged up to ``max_lag`` steps after it, and whatever the lag
the failure is the step whose values fired, its window ends there, and replay reproduces it bit for bit.

On a CPU every value is on the host at once; ``monitor.checks.ready_after`` (the documented test seam) makes a check
count as ready only once that many steps have run after it, as a GPU running behind the host would.
"""

from __future__ import annotations

import pytest
import torch
from rk_testing import cli

import reprokit
from reprokit.bundle import open_bundle

MAX_LAG = 8


def _recorder(mod, tmp_path, *, lag: int | None, config=None, step=None, **kw) -> reprokit.Recorder:
    config = {} if config is None else config
    rec = reprokit.Recorder(mod.build(config), step or mod.train_step, build=mod.build, config=config,
                            out_dir=tmp_path / "repros", **kw)
    rec.monitor.checks.ready_after = lag
    return rec


def _train(rec, batches) -> tuple[int, BaseException | None]:
    """Step through ``batches``; the index of the step call that raised (or the count) and what it raised."""
    i = -1
    for i, b in enumerate(batches):
        try:
            rec.step(b)
        except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
            return i, e
    return i + 1, None


@pytest.mark.parametrize("lag", range(MAX_LAG + 1))
def test_a_nan_at_step_k_is_attributed_to_step_k_whatever_the_lag(projects, tmp_path, lag):
    mlp = projects("rk_mlp")
    k = 9
    rec = _recorder(mlp, tmp_path, lag=lag, snapshot_every=4, max_lag=MAX_LAG)
    raised_at, exc = _train(rec, mlp.batches({}, 30, poison_step=k))
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert (exc.failure.kind, exc.failure.step) == ("nonfinite_loss", k)
    assert 0 <= exc.detected_lag <= min(lag, MAX_LAG)
    assert raised_at - exc.detected_lag in (k, k + 1), "seen at the end of step k + lag, or before the next started"
    if exc.detected_lag:
        assert f"seen {exc.detected_lag} step" in str(exc) and f"ends at step {k}" in str(exc), str(exc)
    bundle = open_bundle(exc.bundle)
    assert bundle.steps[-1] == k, "the window ends at the failing step: the steps after it are not replayed"
    assert bundle.run["detected_lag"] == exc.detected_lag and bundle.run["recorder"]["max_lag"] == MAX_LAG
    assert max(h["step"] for h in bundle.run["history"]) == k
    assert rec.stats()["lag_max"] <= MAX_LAG


@pytest.mark.parametrize("lag", [2, MAX_LAG])
def test_a_lagged_bundle_replays_at_the_failing_step_bit_exact(projects, tmp_path, lag):
    mlp = projects("rk_mlp")
    rec = _recorder(mlp, tmp_path, lag=lag, config={"scheduler": "lambda"}, snapshot_every=4, max_lag=MAX_LAG)
    _, exc = _train(rec, mlp.batches({"scheduler": "lambda"}, 30, poison_step=10))
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 10 and exc.detected_lag > 0, exc
    report = reprokit.replay(exc.bundle, times=2)
    assert report.reproduced and report.verdict == "deterministic", report.verdict
    assert report.runs[0].failure.step == 10
    assert report.fidelity["bit_exact"] and report.fidelity["steps_compared"] == len(open_bundle(exc.bundle).steps)
    r = cli("replay", exc.bundle)  # the command line too: exit 1 while it fails
    assert r.exit_code == 1, r.output


@pytest.mark.parametrize("lag, max_lag, k, raised_at", [
    (2, 1, 3, 4),  # step 3's check is waited for at the end of step 4 (max_lag 1)
    (2, MAX_LAG, 3, 5),  # it lands at the end of step 5
    (10**6, MAX_LAG, 10, 12),  # the postponed snapshot waits at step 12's start and finds it: step 12 never runs
])
def test_a_snapshot_due_after_the_failing_step_does_not_drop_its_window(projects, tmp_path, lag, max_lag, k,
                                                                         raised_at):
    # A snapshot every 4 steps: one is due at step 4 (right after step 3), then postponed while checks are on
    # their way, up to step 12.
    mlp = projects("rk_mlp")
    rec = _recorder(mlp, tmp_path, lag=lag, snapshot_every=4, max_lag=max_lag)
    seen_at, exc = _train(rec, mlp.batches({}, 20, poison_step=k))
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == k, exc
    assert seen_at == raised_at
    assert open_bundle(exc.bundle).steps == list(range(k + 1)), "the window of the failing step (from 0) was kept"
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.step == k and report.fidelity["bit_exact"]


def test_snapshots_wait_for_earlier_checks_and_every_window_replays_from_an_exact_snapshot(projects, tmp_path):
    # Every snapshot is postponed (checks are always 3 steps behind), then taken after one wait at max_lag.
    mlp = projects("rk_mlp")
    rec = _recorder(mlp, tmp_path, lag=3, snapshot_every=4, max_lag=2, spike_factor=50.0, spike_window=10)
    seen_at, exc = _train(rec, mlp.batches({}, 40, spike_step=22))
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert (exc.failure.kind, exc.failure.step, seen_at) == ("loss_spike", 22, 24)
    # Snapshots at steps 0, 6, 12 and 18: each due 4 steps after the last, postponed twice, taken after one wait.
    # The one due at 22 waited at step 24's start, and found step 22's spike: step 24 never ran.
    stats = rec.stats()
    assert (stats["snapshot_postponed_steps"], stats["lag_max"]) == (8, 2), stats
    assert open_bundle(exc.bundle).steps == list(range(18, 23))
    # The spike history came with the (postponed) snapshot: replay judges step 22 as the recorder did.
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and (report.runs[0].failure.kind, report.runs[0].failure.step) == ("loss_spike", 22)


def test_a_run_without_failure_is_bit_identical_with_and_without_the_lagged_recorder(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adam", "scheduler": "cosine"}
    batches = list(mlp.batches(cfg, 24))
    bare = mlp.build(cfg)
    bare_losses = [mlp.train_step(bare, {k: v.clone() for k, v in b.items()}) for b in batches]
    rec = _recorder(mlp, tmp_path, lag=3, config=cfg, snapshot_every=5, max_lag=4, check_params=True)
    losses = [rec.step(b) for b in batches]
    rec.close()
    assert all(torch.equal(a.detach(), b) for a, b in zip(bare_losses, losses))
    for (name, p), q in zip(bare.model.named_parameters(), rec.state.model.parameters()):
        assert torch.equal(p, q), name
    for sa, sb in zip(bare.optimizer.state.values(), rec.state.optimizer.state.values()):
        assert all(torch.equal(sa[key], sb[key]) for key in sa)
    assert rec.stats()["lag_max"] == 3 and rec.stats()["checks_pending"] == 0


@pytest.mark.parametrize("lag", [0, 4])
def test_a_loss_spike_is_attributed_to_its_step(projects, tmp_path, lag):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd", "lr": 1e-3}
    rec = _recorder(mlp, tmp_path, lag=lag, config=cfg, snapshot_every=4, spike_factor=50.0, spike_window=10)
    _, exc = _train(rec, mlp.batches(cfg, 30, spike_step=14))
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert (exc.failure.kind, exc.failure.step, exc.detected_lag) == ("loss_spike", 14, lag)
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.step == 14


def test_a_lagged_predicate_is_judged_late_and_attributed_to_its_step(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd", "lr": 1e-3}
    rec = _recorder(mlp, tmp_path, lag=3, config=cfg, snapshot_every=4, detect=[mlp.loss_above_lagged])
    _, exc = _train(rec, mlp.batches(cfg, 30, spike_step=14))
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert (exc.failure.kind, exc.failure.step, exc.detected_lag) == ("predicate", 14, 3)
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.step == 14


def test_a_predicate_not_marked_lagged_sees_the_state_its_step_left(projects, tmp_path):
    # seven_calls reads state.extra: judged at its own step's end (lag 0) even where the other checks would lag.
    mlp = projects("rk_mlp")
    cfg = {"count": True}
    rec = _recorder(mlp, tmp_path, lag=3, config=cfg, step=mlp.counting_step, snapshot_every=4,
                    detect=[mlp.seven_calls])
    _, exc = _train(rec, mlp.batches(cfg, 20))
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert (exc.failure.kind, exc.failure.step, exc.detected_lag) == ("predicate", 6, 0)
    assert exc.failure.message == "7 calls", "judged on the state step 6 left, not a later one"
    assert rec.stats()["lag_max"] == 0
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.step == 6


def test_an_exception_is_immediate(projects, tmp_path):
    inj = projects("rk_inject")
    rec = _recorder(inj, tmp_path, lag=4, step=inj.exception_step, snapshot_every=4)
    raised_at, exc = _train(rec, inj.batches({}, 12))
    assert raised_at == 5 and type(exc).__name__ == "InjectedFault", exc
    bundle = open_bundle(next(iter(rec.bundles)))
    assert (bundle.failure.kind, bundle.failure.step, bundle.run["detected_lag"]) == ("exception", 5, 0)


def test_an_exception_after_an_unseen_nan_reports_the_nan_s_step(projects, tmp_path):
    # Step 3 feeds a NaN; its check is still on its way when step 5 raises: step 3 is the failure, step 5's
    # exception its cause.
    inj = projects("rk_inject")
    rec = _recorder(inj, tmp_path, lag=4, step=inj.exception_step, snapshot_every=4)
    raised_at, exc = _train(rec, inj.batches({}, 12, poison_step=3))
    assert raised_at == 5 and isinstance(exc, reprokit.TrainingFailure), exc
    assert (exc.failure.kind, exc.failure.step, exc.detected_lag) == ("nonfinite_loss", 3, 2)
    assert type(exc.__cause__).__name__ == "InjectedFault"
    assert open_bundle(exc.bundle).steps == [0, 1, 2, 3]


def test_a_check_that_never_lands_is_waited_for_at_max_lag(projects, tmp_path):
    # A loop that never syncs: nothing is ready until the recorder waits, max_lag steps later.
    mlp = projects("rk_mlp")
    rec = _recorder(mlp, tmp_path, lag=10**6, snapshot_every=100, max_lag=3)
    raised_at, exc = _train(rec, mlp.batches({}, 20, poison_step=6))
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 6, exc
    assert (raised_at, exc.detected_lag) == (9, 3)
    stats = rec.stats()
    assert (stats["lag_max"], stats["lag_waits"]) == (3, 7), stats  # steps 0..6, each waited for at age 3


def test_close_and_wait_for_checks_judge_what_is_still_on_its_way(projects, tmp_path):
    mlp = projects("rk_mlp")
    rec = _recorder(mlp, tmp_path / "a", lag=10**6, snapshot_every=4, max_lag=MAX_LAG)
    assert _train(rec, mlp.batches({}, 6, poison_step=5)) == (6, None), "the last step's NaN is not seen yet"
    with pytest.raises(reprokit.TrainingFailure) as info:
        rec.close()
    assert info.value.failure.step == 5 and open_bundle(info.value.bundle).steps[-1] == 5

    rec = _recorder(mlp, tmp_path / "b", lag=10**6, snapshot_every=4, max_lag=MAX_LAG)
    _train(rec, mlp.batches({}, 6, poison_step=4))
    with pytest.raises(reprokit.TrainingFailure) as info:
        rec.wait_for_checks()
    assert (info.value.failure.step, info.value.detected_lag) == (4, 1)
    rec.close()  # nothing left to judge

    with pytest.raises(ValueError, match="the block's own") as info2:  # noqa: PT012 - the with block is the subject
        with _recorder(mlp, tmp_path / "c", lag=10**6, snapshot_every=4, max_lag=MAX_LAG) as rec:
            _train(rec, mlp.batches({}, 6, poison_step=5))
            raise ValueError("the block's own error")
    assert any("when the Recorder closed, non-finite loss at step 5" in n for n in info2.value.__notes__)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_max_lag_must_be_a_whole_number_of_steps(projects, tmp_path, bad):
    mlp = projects("rk_mlp")
    with pytest.raises(reprokit.ConfigError, match="max_lag"):
        reprokit.Recorder(mlp.build({}), mlp.train_step, build=mlp.build, config={}, out_dir=tmp_path, max_lag=bad)
