"""CLI UX from a newcomer's run: what a wrong argument says, and that --help tells enough.

Each test here failed before its fix: the recorder's ``out_dir`` passed where a bundle is expected read
"manifest.json: missing" (or, for replay, "not a rank's bundle"); ``shrink -o FILE`` was an internal error
(exit 70); ``--variants ,`` ran every variant; ``inspect --plot`` did not say where the plot went; the
help of ``bisect precision`` named no variant.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from reprokit.cli import main


@pytest.fixture
def out_dir(shared_nan_bundle) -> Path:
    """The recorder's out_dir, holding one bundle of a NaN loss (the shared one: read-only)."""
    return shared_nan_bundle.parent


def _bundle(out_dir: Path) -> Path:
    (bundle,) = [p for p in out_dir.iterdir() if p.name.startswith("bundle-")]
    return bundle


def _json(result) -> dict:
    assert "Traceback" not in result.output, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("words", [["replay"], ["inspect"], ["shrink", "-o", "{tmp}/small"], ["extract", "-o", "{tmp}/x"],
                                   ["bisect", "steps"], ["bisect", "layers"], ["pack", "-o", "{tmp}/r.tar"]])
def test_the_recorders_out_dir_is_refused_with_the_bundle_it_holds_named(out_dir, tmp_path, words):
    args = [w.format(tmp=tmp_path) for w in words] + [str(out_dir), "--json"]
    r = CliRunner().invoke(main, args)
    err = _json(r)["error"]
    assert r.exit_code == 3, r.output
    assert _bundle(out_dir).name in err["message"], err
    assert "Pass one of them" in err["message"] or "Pass one bundle folder" in err["message"], err
    assert not (tmp_path / "small").exists() and not (tmp_path / "r.tar").exists()


def test_verify_lists_a_folder_of_bundles_as_its_problem_with_exit_1(out_dir):
    r = CliRunner().invoke(main, ["verify", str(out_dir), "--json"])
    assert r.exit_code == 1, r.output
    (problem,) = _json(r)["problems"]
    assert problem["file"] == "manifest.json" and _bundle(out_dir).name in problem["problem"], problem


def test_replay_of_a_folder_of_one_process_bundles_names_them(out_dir):
    # A folder holding a bundle of one process is not an incident folder: replay says so and names the bundle.
    r = CliRunner().invoke(main, ["replay", str(out_dir)])
    assert r.exit_code == 3, r.output
    assert "nor the incident folder of a multi-rank run" in r.output and _bundle(out_dir).name in r.output


def test_shrink_and_extract_into_a_file_are_usage_errors_not_internal_errors(out_dir, tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    for cmd in ("shrink", "extract"):
        r = CliRunner().invoke(main, [cmd, str(_bundle(out_dir)), "-o", str(target), "--json"])
        assert r.exit_code == 2, r.output
        assert "is a file" in _json(r)["error"]["message"]
    assert target.read_text() == "mine\n"


def test_variants_that_name_nothing_are_a_usage_error(out_dir):
    r = CliRunner().invoke(main, ["bisect", "precision", str(_bundle(out_dir)), "--variants", " , ", "--json"])
    assert r.exit_code == 2, r.output
    assert "names no variant" in _json(r)["error"]["message"]


def test_precision_help_lists_every_variant_and_replay_axes_give_their_exit_codes():
    from reprokit.bisect.precision import VARIANTS

    text = " ".join(CliRunner().invoke(main, ["bisect", "precision", "--help"]).output.split())
    assert all(name in text for name in VARIANTS), text
    for axis in ("steps", "layers", "precision"):
        out = " ".join(CliRunner().invoke(main, ["bisect", axis, "--help"]).output.split())
        assert "1 when the recorded failure does not reproduce" in out and "125" in out, (axis, out)


def test_inspect_says_where_the_plot_went(out_dir, tmp_path):
    png = tmp_path / "history.png"
    r = CliRunner().invoke(main, ["inspect", str(_bundle(out_dir)), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert png.stat().st_size > 0
    assert f"wrote {png}" in r.output


def test_a_copy_of_the_out_dir_with_two_bundles_names_both(out_dir, tmp_path):
    two = tmp_path / "two"
    shutil.copytree(out_dir, two)
    src = _bundle(two)
    shutil.copytree(src, two / (src.name + "-copy"))
    r = CliRunner().invoke(main, ["inspect", str(two), "--json"])
    message = _json(r)["error"]["message"]
    assert r.exit_code == 3 and "2 bundle folder(s)" in message and src.name + "-copy" in message, message


@pytest.mark.parametrize("words", [["pack", "{b}", "-o", "{o}/x.tar"], ["shrink", "{b}", "-o", "{o}/small"],
                                   ["extract", "{b}", "-o", "{o}/x"], ["inspect", "{b}", "--plot", "{o}/p.png"],
                                   ["demo", "--out", "{o}/demo"]])
def test_an_output_path_that_cannot_be_created_is_a_usage_error_before_any_work(out_dir, tmp_path, words):
    # A file where a folder must go: before, each was an internal error (exit 70), shrink's after the whole
    # search, and the demo trained, failed to write its bundle and then said it "did not fail as designed".
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine\n")
    args = [w.format(b=_bundle(out_dir), o=blocker) for w in words] + ["--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    message = _json(r)["error"]["message"]
    assert f"{blocker} is a file" in message and "cannot be created" in message, message
    assert blocker.read_text() == "mine\n"


def test_pack_refuses_an_archive_name_that_is_not_a_tarball(out_dir, tmp_path):
    r = CliRunner().invoke(main, ["pack", str(_bundle(out_dir)), "-o", str(tmp_path / "repro.zip")])
    assert r.exit_code == 2 and "does not end in .tar, .tar.gz or .tgz" in r.output and "repro.tar" in r.output
    assert not (tmp_path / "repro.zip").exists()


@pytest.mark.parametrize("command", ["replay", "inspect"])
def test_an_empty_folder_is_named_as_such(tmp_path, command):
    empty = tmp_path / "nothing"
    empty.mkdir()
    r = CliRunner().invoke(main, [command, str(empty)])
    assert r.exit_code == 3 and "is an empty folder, not a bundle" in r.output and "Ask the sender" not in r.output
