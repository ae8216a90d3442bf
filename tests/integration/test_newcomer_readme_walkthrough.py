"""What a newcomer following README.md met, each pinned by a test that failed before its fix.

- The Python API block of README.md did not run as printed (``MyModel``, ``cfg`` and ``loader`` undefined).
- A folder one level above bundles that is not a multi-rank run (a project folder holding its ``repros/``,
  a folder of unpacked ``repro-*/bundle`` archives) was named "incident folders of a multi-rank run", with a
  ``reprokit replay`` command that then failed.
- Any folder that is not a bundle (a project, a download) read "failed verification ... Ask the sender for an
  intact copy".
- A truncated archive said what was wrong but not what to do.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

import reprokit
from reprokit.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _error(result) -> dict:
    assert "Traceback" not in result.output, result.output
    return json.loads(result.stdout)["error"]


@pytest.mark.slow
def test_the_readmes_python_api_block_runs_as_printed(tmp_path, fork_server):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Python API\n"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "no python block under ## Python API"
    (tmp_path / "train.py").write_text(code.group(1))
    proc = fork_server.capture([], script=tmp_path / "train.py", cwd=tmp_path, timeout=300)  # python train.py
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "deterministic True", proc.stdout
    (written,) = (tmp_path / "repros").iterdir()
    assert written.name.endswith("-step00000057-nonfinite_loss"), written.name


def test_a_folder_above_bundles_that_is_no_incident_names_the_bundles_not_incidents(shared_nan_bundle, tmp_path):
    # /tmp/work: proj/repros/bundle-... is two levels down; repro-abc/bundle (an unpacked archive) one level.
    top = tmp_path / "work"
    shutil.copytree(shared_nan_bundle.parent, top / "proj" / "repros")
    shutil.copytree(shared_nan_bundle, top / "repro-abc" / "bundle")
    for words in (["replay"], ["inspect"], ["bisect", "steps"]):
        r = CliRunner().invoke(main, [*words, str(top), "--json"])
        err = _error(r)
        assert r.exit_code == 3, r.output
        assert "incident" not in err["message"], err
        assert "repro-abc/bundle" in err["message"], err
    # the unpacked repro itself (repro-abc/, its bundle in bundle/): one bundle of one process, no incident
    err = _error(CliRunner().invoke(main, ["inspect", str(top / "repro-abc"), "--json"]))
    assert f"e.g. {top / 'repro-abc' / 'bundle'}" in err["message"] and "incident" not in err["message"], err
    # and the path it suggests is one that works
    suggested = _error(CliRunner().invoke(main, ["inspect", str(top), "--json"]))["message"].rsplit("e.g. ", 1)[1]
    r = CliRunner().invoke(main, ["inspect", suggested.strip(), "--json"])
    assert r.exit_code == 0, r.output


def test_a_folder_that_is_no_bundle_says_so_instead_of_asking_the_sender(tmp_path):
    other = tmp_path / "downloads"
    (other / "sub").mkdir(parents=True)
    (other / "notes.txt").write_text("hello")
    for words in (["replay"], ["inspect"], ["shrink", "-o", str(tmp_path / "small")]):
        r = CliRunner().invoke(main, [*words, str(other), "--json"])
        err = _error(r)
        assert r.exit_code == 3, r.output
        assert "is not a bundle folder" in err["message"] and "whoever sent it" not in err["message"], err
    # a bundle folder missing only its manifest (an interrupted copy) still reads as a damaged bundle
    (other / "run.json").write_text("{}")
    err = _error(CliRunner().invoke(main, ["inspect", str(other), "--json"]))
    assert "failed verification" in err["message"] and "whoever sent it" in err["message"], err


def test_a_truncated_archive_says_to_fetch_it_again(shared_nan_bundle, tmp_path):
    tar = tmp_path / "repro.tar"
    r = CliRunner().invoke(main, ["pack", str(shared_nan_bundle), "-o", str(tar)])
    assert r.exit_code == 0, r.output
    cut = tmp_path / "cut.tar"
    cut.write_bytes(tar.read_bytes()[: tar.stat().st_size // 2])
    for words in (["inspect"], ["replay"]):
        r = CliRunner().invoke(main, [*words, str(cut), "--json"])
        err = _error(r)
        assert r.exit_code == 3 and "truncated" in err["message"], err
        assert "Copy or download the archive again" in err["message"], err


def test_bisect_given_a_bundle_where_the_axis_goes_names_the_axes(shared_nan_bundle):
    r = CliRunner().invoke(main, ["bisect", str(shared_nan_bundle), "--json"])
    err = _error(r)
    assert r.exit_code == 2, r.output
    assert f"reprokit bisect steps|layers|precision|commits {shared_nan_bundle}" in err["message"], err
    # a mistyped axis still gets click's suggestion
    r = CliRunner().invoke(main, ["bisect", "step", str(shared_nan_bundle)])
    assert r.exit_code == 2 and "Did you mean 'steps'?" in r.output, r.output


UNGUARDED = '''\
import torch, reprokit

def build(config):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

def train_step(state, batch):
    loss = (state.model(batch["x"]) ** 2).mean()
    loss.backward(); state.optimizer.step(); state.optimizer.zero_grad()
    return loss

# the loop at module level, no `if __name__ == "__main__":` (a newcomer's first script)
rec = reprokit.Recorder(build({}), train_step, build=build, config={}, out_dir="repros", snapshot_every=2)
for step in range(6):
    x = torch.ones(2, 4) * (float("nan") if step == 4 else 1.0)
    try:
        rec.step({"x": x})
    except reprokit.TrainingFailure as e:
        print(e.bundle)
        break
'''


@pytest.mark.slow
def test_a_script_that_trains_when_imported_is_told_to_guard_its_loop(tmp_path, monkeypatch, fork_server):
    (tmp_path / "train.py").write_text(UNGUARDED)
    proc = fork_server.capture([], script=tmp_path / "train.py", cwd=tmp_path, timeout=120)  # python train.py
    assert proc.returncode == 0, proc.stderr
    (recorded,) = (tmp_path / "repros").iterdir()
    monkeypatch.chdir(tmp_path)  # where the script's out_dir "repros" resolves, as when a user replays
    r = CliRunner().invoke(main, ["replay", str(recorded), "--json"])
    err = _error(r)
    assert r.exit_code == 125, r.output
    assert 'if __name__ == "__main__":' in err["message"] and "train.py" in err["message"], err
    assert "--code" not in err["message"], err  # not import's generic advice (point --code at a checkout)
    assert list((tmp_path / "repros").iterdir()) == [recorded], "replay recorded a second bundle"


def test_demo_out_on_a_bundle_folder_is_refused_before_training_and_leaves_it_intact(shared_nan_bundle, tmp_path):
    target = tmp_path / "bundle"
    shutil.copytree(shared_nan_bundle, target)
    before = sorted(p.relative_to(target) for p in target.rglob("*"))
    r = CliRunner().invoke(main, ["demo", "--out", str(target), "--json"])
    err = _error(r)
    assert r.exit_code == 2 and "is a bundle folder" in err["message"], err
    assert sorted(p.relative_to(target) for p in target.rglob("*")) == before
    assert CliRunner().invoke(main, ["verify", str(target)]).exit_code == 0


def test_replay_of_an_archive_names_its_code_inside_the_archive_not_a_removed_temp_folder(shared_nan_bundle, tmp_path):
    tar = tmp_path / "repro.tar"
    assert CliRunner().invoke(main, ["pack", str(shared_nan_bundle), "-o", str(tar)]).exit_code == 0
    r = CliRunner().invoke(main, ["replay", str(tar), "--trust", "--json"])
    assert r.exit_code == 1, r.output
    code = json.loads(r.stdout)["code"]
    assert re.fullmatch(re.escape(f"{tar}: ") + r"repro-[0-9a-f]{12}/bundle/code", code), code


def test_verify_folds_many_unexpected_files_of_one_folder_into_one_line(shared_nan_bundle, tmp_path):
    target = tmp_path / "bundle"
    shutil.copytree(shared_nan_bundle, target)
    (target / "junk").mkdir()
    for k in range(6):
        (target / "junk" / f"f{k}.txt").write_text("x")
    (target / "stray.txt").write_text("x")
    r = CliRunner().invoke(main, ["verify", str(target)])
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert lines[0] == f"{target}: 7 problem(s)", lines
    assert "  junk/: 6 unexpected files (junk/f0.txt, ...; --json lists each)" in lines, lines
    assert "  stray.txt: unexpected file" in lines and len(lines) == 3, lines
    problems = json.loads(CliRunner().invoke(main, ["verify", str(target), "--json"]).stdout)["problems"]
    assert sorted(p["file"] for p in problems) == [*(f"junk/f{k}.txt" for k in range(6)), "stray.txt"], problems


@pytest.mark.slow
def test_a_failure_in_training_names_the_commands_to_run_next(tmp_path, monkeypatch, fork_server):
    # the same script, letting TrainingFailure end it with a traceback, as a first script does
    script = UNGUARDED.replace("    except reprokit.TrainingFailure as e:\n        print(e.bundle)\n        break\n",
                               "    finally:\n        pass\n")
    assert script != UNGUARDED
    (tmp_path / "train.py").write_text(script)
    proc = fork_server.capture([], script=tmp_path / "train.py", cwd=tmp_path, timeout=120)  # python train.py
    assert proc.returncode == 1 and "TrainingFailure" in proc.stderr, proc.stderr
    (recorded,) = (tmp_path / "repros").iterdir()
    rel = f"repros/{recorded.name}"
    assert f"reprokit: next: `reprokit replay {rel} --times 3` (exit 1 while it fails)" in proc.stderr, proc.stderr
    monkeypatch.chdir(tmp_path)  # the command works as printed, from where the script ran
    assert CliRunner().invoke(main, ["inspect", rel]).exit_code == 0


def test_pack_does_not_replace_an_existing_tarball_unasked(shared_nan_bundle, tmp_path):
    """``pack -o repro.tar`` over a tarball packed earlier (perhaps of another bundle, perhaps sent already) replaced
    it silently; ``shrink -o`` refuses an existing folder. Now exit 2 before packing, and ``--force`` replaces it."""
    out = tmp_path / "repro.tar"
    out.write_bytes(b"an earlier tarball")
    r = CliRunner().invoke(main, ["pack", str(shared_nan_bundle), "-o", str(out)])
    assert r.exit_code == 2 and "already exists" in r.output and "--force" in r.output, r.output
    assert out.read_bytes() == b"an earlier tarball"
    r = CliRunner().invoke(main, ["pack", str(shared_nan_bundle), "-o", str(out), "--force"])
    assert r.exit_code == 0, r.output
    assert tarfile.is_tarfile(out) and (tmp_path / "repro.tar.sha256").exists()


def test_the_next_commands_note_quotes_a_path_with_spaces(tmp_path):
    """The note's commands are copy-pasted into a shell: a bundle folder under "my runs/" split into two arguments."""
    import importlib
    import shlex

    from rk_testing import record

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "projects"))
    try:
        mlp = importlib.import_module("rk_mlp")
    finally:
        sys.path.pop(0)
    _, exc = record(mlp, {}, mlp.batches({}, 4, poison_step=2), tmp_path / "my runs", snapshot_every=2)
    (note,) = [n for n in exc.__notes__ if n.startswith("reprokit: next:")]
    bundle = str(exc.bundle)
    assert " " in bundle and f"`reprokit replay {shlex.quote(bundle)} --times 3`" in note, note
    assert shlex.split(note.split("`")[1]) == ["reprokit", "replay", bundle, "--times", "3"]


def test_a_demo_whose_bundle_cannot_be_written_says_so_not_that_it_is_a_bug(tmp_path):
    # A read-only mount and a path under a file fail the same way: the bundle write (a RecorderWarning, training's
    # own failure goes on). The demo said "did not fail as designed; please report this as a bug".
    from reprokit.demo_story import run_demo
    from reprokit.errors import RecorderWarning, ReprokitError

    (tmp_path / "a_file").write_text("")
    with pytest.warns(RecorderWarning, match="cannot write into|could not write a bundle"), \
            pytest.raises(ReprokitError, match="failed as designed .* but the recorder could not write its bundle"):
        run_demo(tmp_path / "a_file" / "out", say=lambda s: None)


def test_an_out_dir_that_cannot_be_written_is_said_when_the_recorder_is_made(projects, tmp_path):
    # Not hours later at the failure: the warning comes at attach, and nothing is created by the check.
    mlp = projects("rk_mlp")
    (tmp_path / "a_file").write_text("")
    with pytest.warns(reprokit.RecorderWarning, match="cannot write into .*a_file .*a failure would give no bundle"):
        rec = reprokit.Recorder(mlp.build({}), mlp.train_step, build=mlp.build, out_dir=tmp_path / "a_file" / "repros")
    rec.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a writable one, existing or not, says nothing and is not created
        reprokit.Recorder(mlp.build({}), mlp.train_step, build=mlp.build, out_dir=tmp_path / "new" / "repros").close()
    assert not (tmp_path / "new").exists()
    # A name the file system refuses (too long) is said too, never raised into the user's script.
    with pytest.warns(reprokit.RecorderWarning, match="cannot write into"):
        reprokit.Recorder(mlp.build({}), mlp.train_step, build=mlp.build,
                          out_dir=tmp_path / ("a" * 300) / "repros").close()


def test_replaying_the_bundle_of_a_failure_that_wrote_none_says_so():
    # README's example replays e.bundle; with a read-only out_dir that is None, and replay gave a bare TypeError.
    with pytest.raises(reprokit.BundleError, match="no bundle to open: got None .*RecorderWarning says why"):
        reprokit.replay(None)
