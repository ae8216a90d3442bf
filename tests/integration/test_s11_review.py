"""Review of session 11: the private code copy replay imports never outlives a child process that dies."""

from __future__ import annotations

import os

from rk_testing import record

from reprokit.bundle import open_bundle
from reprokit.replay import Session
from reprokit.shrink.shrinker import Case, Shrinker


def test_an_isolated_candidate_that_crashes_leaves_no_private_code_copy(projects, tmp_path, monkeypatch):
    """An isolated shrink candidate replays its snapshot from a private copy of its code (reprokit.code.materialize);
    one that crashes (SIGKILL: a segfault, or the --timeout's kill) never removes it. The copy must go with the
    candidate's scratch folder, not pile up in the system's temp folder."""
    mlp, crash = projects("rk_mlp"), projects("rk_s11_review_crash")
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
        reproduced, d = Shrinker(session, budget=1, pad_id=0, isolate=True, timeout=120, progress=None)._isolated(case)
    assert (reproduced, d) == (False, {}), d  # the child died: no report
    assert not list(system_tmp.glob("reprokit-code-*")), list(system_tmp.iterdir())
