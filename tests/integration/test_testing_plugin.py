"""Bundles as regression tests: reprokit.testing.assert_fixed and the pytest plugin, on examples/bad_batch.py.

The bug: a batch whose labels are all ignore_index makes a mean cross-entropy 0/0. The fix
(applied here to a copy of the example): sum the loss and divide by max(1, labelled tokens).

The example and each ``python -m pytest`` run as processes of their own forked from one server that imported torch
(the ``fork_server`` fixture, tests/rk_forked.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from reprokit.pack import pack
from reprokit.testing import DifferentFailure, StillFails, assert_fixed, find_bundles

ROOT = Path(__file__).resolve().parents[2]
BUGGY = 'loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)'
FIXED = ('labels = batch["labels"].flatten()\n    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels, '
         'ignore_index=-100, reduction="sum") / (labels != -100).sum().clamp(min=1)')


@pytest.fixture(scope="module")
def regression(tmp_path_factory, fork_server):
    """A folder holding the bad_batch bundle and its packed tarball, plus fixed and broken checkouts."""
    tmp = tmp_path_factory.mktemp("plugin")
    out = tmp / "regressions"
    proc = fork_server.capture(["--quick", "--out", out], script=ROOT / "examples" / "bad_batch.py", cwd=tmp,
                               timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (bundle,) = out.glob("bundle-*")
    pack(bundle, out / "bad_batch.tar.gz")
    pack(bundle, out / "bad_batch.tar")  # what `reprokit pack` writes by default
    source = (ROOT / "examples" / "bad_batch.py").read_text()
    assert BUGGY in source
    checkouts = {}
    for name, text in {"buggy": source, "fixed": source.replace(BUGGY, FIXED),
                       "broken": source.replace("    logits = state.model", "    raise ValueError('a broken refactor')\n"
                                                                          "    logits = state.model")}.items():
        (tmp / name).mkdir()
        (tmp / name / "bad_batch.py").write_text(text)
        checkouts[name] = tmp / name
    return out, bundle, checkouts


@pytest.mark.slow
def test_assert_fixed_passes_fails_and_errors(regression):
    out, bundle, code = regression
    assert assert_fixed(bundle, code=code["fixed"]).verdict == "not_reproduced"
    with pytest.raises(StillFails, match="still fails with the code in .*nonfinite_loss .* at step 45"):
        assert_fixed(bundle, code=code["buggy"])
    with pytest.raises(StillFails):
        assert_fixed(bundle)  # the bundle's own code snapshot still has the bug
    with pytest.raises(DifferentFailure, match="ValueError: a broken refactor"):
        assert_fixed(bundle, code=code["broken"])
    assert find_bundles(out) == [out / "bad_batch.tar", out / "bad_batch.tar.gz", bundle]


@pytest.fixture
def run_pytest(fork_server):
    """``run_pytest(FOLDER, ARGS...)``: ``python -m pytest -p reprokit.testing ARGS`` run from FOLDER."""

    def run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
        # Forked from a server that imported reprokit, pytest cannot rewrite the plugin's package and warns so (its
        # own frames then appear in the output); a fresh `python -m pytest` imports reprokit with the plugin.
        return fork_server.capture(["-p", "reprokit.testing", "-p", "no:cacheprovider", "-q", "-rA",
                                    "-W", "ignore::pytest.PytestAssertRewriteWarning", *args],
                                   module="pytest", cwd=tmp, timeout=300)

    return run


@pytest.mark.slow
def test_plugin_each_bundle_is_a_test_item(regression, run_pytest, tmp_path):
    out, _, code = regression
    fixed = run_pytest(tmp_path, "--reprokit-bundles", str(out), "--reprokit-code", str(code["fixed"]))
    assert fixed.returncode == 0 and "3 passed" in fixed.stdout, fixed.stdout + fixed.stderr
    # Each item is named by its bundle's path, as a test file names its tests; the bundles found are counted.
    assert "regressions/bad_batch.tar::reprokit\n" in fixed.stdout, fixed.stdout
    assert f"reprokit: 3 bundles from {out}, one test each" in fixed.stdout, fixed.stdout
    buggy = run_pytest(tmp_path, "--reprokit-bundles", str(out), "--reprokit-code", str(code["buggy"]),
                    "-k", "tar")
    assert buggy.returncode == 1 and "2 failed, 1 deselected" in buggy.stdout, buggy.stdout + buggy.stderr
    assert "still fails" in buggy.stdout
    broken = run_pytest(tmp_path, "--reprokit-bundles", str(out), "--reprokit-code", str(code["broken"]),
                     "-m", "reprokit_bundle", "-k", "not tar")
    assert broken.returncode == 1 and "1 error" in broken.stdout and "fails differently" in broken.stdout, \
        broken.stdout + broken.stderr
    # reprokit's message, not a page of pytest's and pluggy's frames around it.
    assert "pluggy" not in broken.stdout and "_pytest" not in broken.stdout, broken.stdout


@pytest.mark.slow
def test_plugin_is_inert_without_bundles_and_refuses_a_missing_folder(run_pytest, tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    assert "1 passed" in run_pytest(tmp_path).stdout
    missing = run_pytest(tmp_path, "--reprokit-bundles", str(tmp_path / "nope"))
    assert missing.returncode == 4 and "no such folder" in missing.stderr, missing.stdout + missing.stderr


def test_plugin_is_registered_as_a_pytest11_entry_point():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; reprokit supports 3.10)
    section = text.split("[project.entry-points.pytest11]\n", 1)[1].split("\n[", 1)[0]
    assert section.splitlines()[0].startswith('"reprokit.testing" = "reprokit.testing"'), section
