"""Where two features meet: the private code copy and processes that die (no copy left behind); the memory budget
and accelerate's accumulation (no window restarted mid-accumulation, none at a dataloader's last batch that replay
would contradict)."""

from __future__ import annotations

import os
import warnings

import pytest
from rk_testing import record

import reprokit
from reprokit.bundle import open_bundle
from reprokit.replayer import RunOutcome, Session, replay
from reprokit.shrink.shrinker import Case, Shrinker


@pytest.mark.slow
def test_an_isolated_candidate_that_crashes_leaves_no_private_code_copy(projects, tmp_path, monkeypatch):
    """An isolated shrink candidate replays its snapshot from a private copy of its code (reprokit.code.materialize);
    one that crashes (SIGKILL: a segfault, or the --timeout's kill) never removes it. The copy must go with the
    candidate's scratch folder, not pile up in the system's temp folder."""
    mlp, crash = projects("rk_mlp"), projects("rk_crash_in_child")
    cfg = {"batch_size": 6}
    _, exc = record(mlp, cfg, mlp.batches(cfg, 3, poison_step=2), tmp_path / "repros", step=crash.train_step,
                    snapshot_every=4)
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_tmp))  # what a child replay process takes as its temp folder
    monkeypatch.setenv("RK_CRASH_UNLESS_PID", str(os.getpid()))  # the child dies; this process replays normally
    with Session(open_bundle(exc.bundle)) as session:
        inputs = tuple(session.inputs())
        case = Case(inputs, session.snapshot, 0, tuple(range(6)), None)
        shrinker = Shrinker(session, budget=1, pad_id=0, isolate=True, timeout=120, progress=None)
        try:
            reproduced, d = shrinker._isolated(case)
        finally:
            if shrinker.runner is not None:
                shrinker.runner.close()
    # the child died: a crash at its step, a different failure from the recorded exception
    assert not reproduced and isinstance(d, RunOutcome) and d.failure is not None and d.failure.kind == "crash", d
    assert not list(system_tmp.glob("reprokit-code-*")), list(system_tmp.iterdir())


@pytest.mark.slow
def test_a_full_window_never_restarts_mid_accumulation(projects, tmp_path):
    """accelerate accumulation over 2 (syncs at steps 1, 3, 5) with a host-memory budget that holds 3 steps: the
    window fills at step 3, mid-accumulation. An early snapshot there replayed step 3 with a fresh Accelerator that
    does not sync where the run did (not bit-exact: replay trains another model); the window must end and the next
    synced step (4) start the new one."""
    acc = projects("rk_accumulate")
    config = {"accumulate": 2}
    state = acc.build(config)
    rec = reprokit.Recorder(state, acc.train_step, build=acc.build, config=config, out_dir=tmp_path / "repros",
                            snapshot_every=100, host_memory_budget=130_000)
    with warnings.catch_warnings(), pytest.raises(reprokit.TrainingFailure) as info:
        warnings.simplefilter("ignore", reprokit.RecorderWarning)  # the budget's notes
        try:
            for batch in acc.loader(acc.Rows(40, bad=21)):  # row 21: step 5
                rec.step(batch)
        finally:
            rec.close()
    b = open_bundle(info.value.bundle)
    report = replay(b)
    assert report.verdict == "deterministic" and report.fidelity["bit_exact"], (b.run["window"], report.fidelity)
    assert b.run["window"]["steps"][0] % 2 == 0, b.run["window"]  # right after a synced step


def test_a_failure_at_a_dataloaders_last_batch_writes_no_bundle_replay_would_contradict(projects, tmp_path):
    """10 batches, accumulation over 4: accelerate steps the optimizer early at batch 9, the last one, because the
    dataloader ends. A NaN gradient there fails at that step. Replay from the snapshot at step 8 runs 8 and 9 with a
    fresh Accelerator that does not step at 9: it read "not reproduced" (bit-exact, so "transient") for a failure
    that happens every time. Step 9 cannot be replayed: no bundle, and the recorder says why."""
    acc = projects("rk_accumulate_grad_nan")
    config = {"accumulate": 4}
    state = acc.build(config)
    rec = reprokit.Recorder(state, acc.train_step, build=acc.build, config=config, out_dir=tmp_path / "repros",
                            snapshot_every=4)
    with warnings.catch_warnings(record=True) as said, pytest.raises(reprokit.TrainingFailure) as info:
        warnings.simplefilter("always", reprokit.RecorderWarning)
        try:
            for batch in acc.loader(acc.GradOnly(40, bad=37)):  # row 37: batch 9, the last
                rec.step(batch)
        finally:
            rec.close()
    assert (info.value.failure.kind, info.value.failure.step) == ("nonfinite_grad", 9)
    if info.value.bundle is not None:  # the old recorder wrote one; say what its replay said
        report = replay(open_bundle(info.value.bundle))
        raise AssertionError(f"a bundle was written for step 9: its replay says {report.verdict}")
    assert any("step 9 is a dataloader's last batch" in str(w.message) for w in said), [str(w.message) for w in said]
