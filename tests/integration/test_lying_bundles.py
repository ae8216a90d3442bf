"""Bundles that lie: schema-valid edits under re-signed checksums that would make a bundle pass as "fixed".

A bundle is a regression test, so the worst thing a bundle can do is be unable to fail: ``replay`` then says NOT
REPRODUCED (exit 0) and the pytest plugin reports a pass, for a bug that was never fixed. Each case is a real recorded
bundle (rk_mlp, NaN loss at step 6, window 4..6) edited the way a careless tool or a sender could, then re-signed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from rk_testing import cli, reseal

from reprokit import bundle as B
from reprokit.errors import BundleError
from reprokit.replayer import replay


def edit_run(bundle: Path, edit: Callable[[dict], object]) -> Path:
    run = json.loads((bundle / B.RUN).read_text())
    edit(run)
    (bundle / B.RUN).write_text(json.dumps(run))
    reseal(bundle)
    return bundle


def _window(steps: list[int]) -> Callable[[dict], object]:
    def edit(run: dict) -> None:
        run["window"]["steps"] = steps
        if steps:
            run["window"]["start"], run["window"]["end"] = steps[0], steps[-1]
    return edit


CANNOT_FAIL = {
    "failing-step-dropped": (_window([4, 5]), "does not hold step 6"),
    "empty-window": (_window([]), "window.steps is empty"),
}


def test_the_recorded_bundle_reproduces(nan_bundle):
    assert B.verify(nan_bundle) == []
    assert replay(nan_bundle).verdict == "deterministic"


@pytest.mark.parametrize("case", CANNOT_FAIL)
def test_a_window_that_cannot_reach_the_failure_is_an_invalid_bundle(nan_bundle, case):
    edit, words = CANNOT_FAIL[case]
    edit_run(nan_bundle, edit)
    problems = B.verify(nan_bundle)
    assert any(p["file"] == "run.json" and words in p["problem"] for p in problems), problems
    v = cli("verify", str(nan_bundle))
    assert v.exit_code == 1 and words in v.output, v.output
    r = cli("replay", "--times", "2", str(nan_bundle))
    assert r.exit_code == 3 and words in r.output and "NOT REPRODUCED" not in r.output, r.output
    with pytest.raises(BundleError, match=words):
        replay(nan_bundle)


def test_a_window_edited_in_memory_is_refused_too(nan_bundle):
    """A tool that changes an opened Bundle's run (no file involved) gets no verdict of zero steps either."""
    b = B.open_bundle(nan_bundle)
    b.run["window"]["steps"] = []
    with pytest.raises(BundleError, match="window.steps is empty"):
        replay(b)


@pytest.mark.slow
def test_switching_off_the_detector_that_fired_does_not_hide_the_failure(nan_bundle):
    """``check_loss: false`` on a nonfinite_loss bundle: the same NaN at the same step still reproduces."""
    edit_run(nan_bundle, lambda run: run["recorder"]["detect"].__setitem__("check_loss", False))
    assert B.verify(nan_bundle) == []  # a setting, not a lie about the window: replay checks the recorded kind anyway
    report = replay(nan_bundle, times=2)
    assert report.verdict == "deterministic", report.to_json()
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 1 and "REPRODUCED" in r.output, r.output


@pytest.mark.parametrize("edit, words", [
    (lambda run: run["recorder"]["detect"].__setitem__("spike_factor", None), "spike_factor is null"),
    (lambda run: run["refs"].__setitem__("predicates", []), "refs.predicates is empty"),
], ids=["spike-without-factor", "predicate-without-predicates"])
def test_a_failure_kind_replay_cannot_check_is_an_invalid_bundle(nan_bundle, edit, words):
    failure = json.loads((nan_bundle / B.FAILURE).read_text())
    failure["kind"] = "loss_spike" if "spike" in words else "predicate"
    (nan_bundle / B.FAILURE).write_text(json.dumps(failure))
    edit_run(nan_bundle, edit)
    assert any(words in p["problem"] for p in B.verify(nan_bundle))
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 3 and words in r.output, r.output


@pytest.mark.slow
def test_the_pytest_plugin_reports_a_bundle_that_cannot_fail_as_an_error(shared_nan_bundle, tmp_path, fork_server):
    """``python -m pytest -p reprokit.testing`` as a process of its own, forked from the fork server (no torch import
    of its own), as test_testing_plugin runs the plugin."""
    folder = tmp_path / "regressions"
    for case, (edit, _) in CANNOT_FAIL.items():
        edit_run(Path(shutil.copytree(shared_nan_bundle, folder / case / shared_nan_bundle.name)), edit)
    # Forked from a server that imported reprokit, pytest cannot rewrite the plugin's package and warns so.
    proc = fork_server.capture(["-p", "reprokit.testing", "-p", "no:cacheprovider", "-q", "-rA",
                                "-W", "ignore::pytest.PytestAssertRewriteWarning", "--reprokit-bundles", folder],
                               module="pytest", cwd=tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "2 error" in proc.stdout and "passed" not in proc.stdout, out


# --- lies that used to end in "internal error" (exit 70) instead of a documented code ----------------------------

def _state_tensor(bundle: Path, key: str, fn: Callable) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(bundle / B.STATE_TENSORS)
    tensors[key] = fn(tensors[key])
    save_file(tensors, bundle / B.STATE_TENSORS)
    reseal(bundle)


@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_a_parameter_stored_as_an_integer_is_an_invalid_bundle(nan_bundle, dtype):
    import torch

    _state_tensor(nan_bundle, "model/0.weight", lambda t: t.to(getattr(torch, dtype)))
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 3 and "'0.weight'" in r.output and "floating point" in r.output, r.output


@pytest.mark.parametrize("provenance, words", [
    ({"seq_window": [1]}, "provenance.seq_window must be [start, end]"),
    ({"passes": {"rows": 5}}, "provenance.passes.rows must be an object"),
    ([1, 2], "provenance must be an object"),
    ({"kept_rows": "0,1"}, "provenance.kept_rows must be a list"),
    ({"kept_rows": [[1, 2, 3]]}, "provenance.kept_rows[0] must be a row or [micro-batch, row]"),
    ({"state_check": "state"}, "provenance.state_check must be an object"),
], ids=["seq-window-of-one", "pass-stats-number", "list", "rows-string", "micro-row-triple", "state-check-string"])
def test_provenance_is_held_to_its_schema(nan_bundle, provenance, words):
    edit_run(nan_bundle, lambda run: run.__setitem__("provenance", provenance))
    for cmd in ("inspect", "replay"):
        r = cli(cmd, str(nan_bundle))
        assert r.exit_code == 3 and words in r.output, (cmd, r.output)


def _code(bundle: Path, text: str, name: str = "rk_mlp.py") -> None:
    (bundle / "code" / name).write_text(text)
    m = json.loads((bundle / B.MANIFEST).read_text())
    m["files"].setdefault(f"code/{name}", {"sha256": "", "size": 0})
    (bundle / B.MANIFEST).write_text(json.dumps(m))
    reseal(bundle)


@pytest.mark.parametrize("deep", ["x = " + "-" * 200_000 + "1\n", "x = " + "+".join(["a"] * 300_000) + "\n"],
                         ids=["memory-error", "recursion-error"])
@pytest.mark.slow
def test_code_too_deep_to_parse_is_refused_by_verify_and_pack(nan_bundle, tmp_path, deep):
    _code(nan_bundle, (nan_bundle / "code" / "rk_mlp.py").read_text() + deep)
    assert any("nested too deeply" in p["problem"] for p in B.verify(nan_bundle))
    for args in (["verify", str(nan_bundle)], ["pack", str(nan_bundle), "-o", str(tmp_path / "r.tar")],
                 ["replay", str(nan_bundle)]):
        r = cli(*args)
        assert r.exit_code in (1, 3) and "nested too deeply" in r.output, (args, r.output)


def test_a_code_file_over_the_limit_is_refused_before_it_is_read(nan_bundle, monkeypatch):
    from reprokit import code

    monkeypatch.setattr(code, "MAX_CODE_BYTES", 10_000)  # stands for 20 MiB (and a file larger than memory)
    _code(nan_bundle, "# padding\n" * 2_000, "big.py")
    problems = B.verify(nan_bundle)
    assert any(p["file"] == "code/big.py" and "at most 10000 bytes" in p["problem"] for p in problems), problems
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 3 and "code/big.py" in r.output, r.output


def test_a_snapshot_file_named_for_an_optional_dependency_of_torch_is_refused(nan_bundle):
    """``code/triton.py``: torch imports triton when it is there (at the first compile), installed here or not."""
    _code(nan_bundle, "raise SystemExit('the bundle ran code/triton.py')\n", "triton.py")
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 3 and "shadow triton" in r.output, r.output
