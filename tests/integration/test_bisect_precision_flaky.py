"""`reprokit bisect precision` on a failure that does not recur on every replay."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import reprokit
from reprokit.bisect import bisect_precision
from reprokit.bisect.precision import format_precision
from reprokit.bundle import open_bundle

sys.path.insert(0, str(Path(__file__).parent))
from test_bisect_commits import TRAINER, batches  # noqa: E402
from test_bisect_commits_merges_and_skips import FLAKY_STEP  # noqa: E402

sys.path.pop(0)


def _record(tmp_path, monkeypatch, counter):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "trainer.py").write_text(TRAINER.format(sanitize=False, layer="fc",
                                                    extra=FLAKY_STEP.format(counter=str(counter))))
    monkeypatch.syspath_prepend(str(proj))
    monkeypatch.delitem(sys.modules, "trainer", raising=False)
    trainer = importlib.import_module("trainer")
    rec = reprokit.Recorder(trainer.build({}), trainer.train_step, build=trainer.build, config={},
                            out_dir=tmp_path / "r", snapshot_every=4)
    with pytest.raises(reprokit.TrainingFailure) as info:
        for b in batches():
            rec.step(b)
    monkeypatch.delitem(sys.modules, "trainer", raising=False)
    return open_bundle(info.value.bundle)


@pytest.mark.slow
def test_a_lucky_pass_of_a_flaky_failure_is_not_called_a_fix(tmp_path, monkeypatch):
    """The NaN gets through on 2 runs in 3: recorded fails (run 2), `deterministic` passes by luck (run 3). On CPU
    that variant changes nothing, so calling it the fix would be wrong: a second look at both says it was luck."""
    bundle = _record(tmp_path, monkeypatch, tmp_path / "runs")
    d = bisect_precision(bundle, variants=["recorded", "deterministic"])
    assert d["variants"] == {"recorded": "fail", "deterministic": "pass"}
    assert d["smallest_fix"] is None, d
    assert d["note"].startswith("flaky: replayed once more, recorded gave fail and deterministic gave fail")
    text = format_precision(d)
    assert "note: flaky" in text and "smallest change that makes the failure go away" not in text

