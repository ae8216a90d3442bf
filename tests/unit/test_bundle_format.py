"""The bundle format: manifest, verification, versions, and the golden v1 bundle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import reprokit
from reprokit import bundle as B

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


# Not run.json: verify holds run.json to its schema, and these tests are about the container. A file of the bundle
# layout (anything else is a verify problem) that no schema reads: a code file (JSON is a Python expression too).
NOTES = "code/notes.py"
TENSORS = "state/rng.safetensors"


def write_tiny(tmp_path: Path) -> Path:
    w = B.BundleWriter(tmp_path, "b")
    w.write_json(NOTES, {"x": float("nan")})
    w.write_tensors(TENSORS, {"a": torch.arange(4)})
    return w.commit()


def test_manifest_is_last_and_lists_every_file(tmp_path):
    path = write_tiny(tmp_path)
    manifest = json.loads((path / B.MANIFEST).read_text())
    assert manifest["format"] == B.FORMAT and manifest["version"] == B.VERSION
    assert set(manifest["files"]) == {NOTES, TENSORS}
    assert json.loads((path / NOTES).read_text()) == {"x": "nan"}, "strict JSON on disk"
    assert B.verify(path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["b"], "no temp dir left behind"


def test_second_bundle_with_same_name_does_not_overwrite(tmp_path):
    a, b = write_tiny(tmp_path), write_tiny(tmp_path)
    assert a != b and a.exists() and b.exists()


def test_interrupted_write_is_never_valid(tmp_path):
    w = B.BundleWriter(tmp_path, "b")
    w.write_json(B.RUN, {})
    # A crash here leaves the temp dir without a manifest.
    assert B.verify(w.tmp) == [{"file": "manifest.json", "problem": "missing (an interrupted write, or not a bundle)"}]
    with pytest.raises(reprokit.BundleError, match="manifest.json"):
        B.open_bundle(w.tmp)


def test_future_version_is_refused_with_a_clear_message(tmp_path):
    path = write_tiny(tmp_path)
    m = json.loads((path / B.MANIFEST).read_text())
    m["version"] = B.VERSION + 1
    (path / B.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(reprokit.BundleVersionError, match=f"version {B.VERSION + 1}.*Upgrade reprokit"):
        B.verify(path)


def test_unsafe_manifest_paths_are_problems(tmp_path):
    path = write_tiny(tmp_path)
    m = json.loads((path / B.MANIFEST).read_text())
    m["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "size": 1}
    (path / B.MANIFEST).write_text(json.dumps(m))
    assert B.verify(path)[0]["problem"].startswith("checksum mismatch (the manifest itself was altered)")
    m["self_sha256"] = B._self_digest(m)  # an attacker who re-signs the manifest
    (path / B.MANIFEST).write_text(json.dumps(m))
    assert {"file": "../../etc/passwd", "problem": "unsafe path in manifest"} in B.verify(path)


@pytest.mark.parametrize("version_dir", sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()))
def test_golden_bundles_still_open_and_replay(version_dir, tmp_path):
    src = GOLDEN / version_dir / "demo-nan"
    path = tmp_path / "golden"
    shutil.copytree(src, path)
    b = B.open_bundle(path)
    assert b.failure.kind == "nonfinite_loss" and b.failure.step == 6
    assert b.steps == [4, 5, 6]
    batch, rng, rng_tensors = b.step(6)
    assert batch["x"].shape == (16, 16) and batch["x"].dtype == torch.float32
    assert not torch.isfinite(batch["x"]).all(), "the poisoned sample is in the failing batch"
    assert "rng/torch" in rng_tensors
    report = reprokit.replay(b, times=2)
    assert report.verdict == "deterministic" and report.fidelity["bit_exact"] and report.fidelity["runs_bit_identical"]


def test_golden_manifest_bytes_are_stable():
    """Pin the exact layout of the v1 manifest's header fields."""
    m = json.loads((GOLDEN / "v1" / "demo-nan" / B.MANIFEST).read_text())
    assert list(m) == ["created", "files", "format", "reprokit_version", "version"], "v1 as first shipped"
    assert m["format"] == "reprokit-bundle" and m["version"] == 1
    assert sorted({f.split("/")[0] for f in m["files"]}) == ["env.json", "failure.json", "run.json", "state", "steps"]


def test_manifest_written_now_carries_its_own_digest(tmp_path):
    m = json.loads((write_tiny(tmp_path) / B.MANIFEST).read_text())
    assert list(m) == ["created", "files", "format", "reprokit_version", "self_sha256", "version"]
    assert m["self_sha256"] == B._self_digest(m)


def test_inspect_state_sizes_count_bytes_per_dtype(tmp_path):
    from reprokit.report import _state_sizes

    w = B.BundleWriter(tmp_path, "b")
    tensors = {"model/a": torch.zeros(10, dtype=torch.float32), "model/b": torch.zeros(10, dtype=torch.bfloat16),
               "optimizer/c": torch.zeros(10, dtype=torch.bool)}
    if hasattr(torch, "float8_e4m3fn"):
        tensors["optimizer/d"] = torch.zeros(10, dtype=torch.float8_e4m3fn)
    w.write_tensors(B.STATE_TENSORS, tensors)
    path = w.commit()
    sizes = _state_sizes(B.Bundle(path=path, manifest=json.loads((path / B.MANIFEST).read_text())))
    assert sizes == {"model": 60, "optimizer": 10 + (10 if "optimizer/d" in tensors else 0)}


def test_inspect_state_sizes_sum_every_state_file(tmp_path):
    """A state split over state.safetensors, state-1.safetensors, ... (format version 2) is summed over
    every part the manifest lists (read from the headers: the tensors are not read)."""
    from reprokit.report import _state_sizes

    w = B.BundleWriter(tmp_path, "b")
    w.write_tensors(B.STATE_TENSORS, {"model/a": torch.zeros(10), "optimizer/m": torch.zeros(3)})
    w.write_tensors("state/state-1.safetensors", {"model/b": torch.zeros(5, dtype=torch.float16)})
    w.write_tensors("steps/00000001.safetensors", {"x": torch.zeros(100)})  # a batch, not the state
    path = w.commit()
    sizes = _state_sizes(B.Bundle(path=path, manifest=json.loads((path / B.MANIFEST).read_text())))
    assert sizes == {"model": 40 + 10, "optimizer": 12}


def test_one_renamed_byte_does_not_switch_the_self_digest_off(tmp_path):
    path = write_tiny(tmp_path)
    raw = (path / B.MANIFEST).read_text()
    assert raw.count('"self_sha256"') == 1
    (path / B.MANIFEST).write_text(raw.replace('"self_sha256"', '"self_sha257"'))
    problems = B.verify(path)
    assert len(problems) == 1 and problems[0]["file"] == B.MANIFEST
    assert "no self_sha256 digest" in problems[0]["problem"] and "'self_sha257'" in problems[0]["problem"]
    # Removing the key outright: only the first release's exact layout may lack it; one extra field (or a
    # renamed one) is refused.
    m = json.loads(raw)
    del m["self_sha256"]
    m["note"] = "x"
    (path / B.MANIFEST).write_text(json.dumps(m))
    assert "no self_sha256 digest" in B.verify(path)[0]["problem"]


def test_a_bundle_is_not_committed_when_out_dir_vanishes_while_writing(tmp_path):
    out = tmp_path / "repros"
    w = B.BundleWriter(out, "b")
    w.write_json(B.RUN, {"x": 1})
    w.write_tensors("state/t.safetensors", {"a": torch.arange(4)})
    shutil.rmtree(out)  # a cleanup job or quota script, mid-write
    with pytest.raises(reprokit.BundleError, match="vanished while the bundle was being written"):
        w.write_json("steps/00000001.json", {})
    with pytest.raises(reprokit.BundleError, match="nothing was committed"):
        w.commit()
    assert not out.exists(), "the folder is not recreated"


def test_commit_checks_every_file_is_in_place(tmp_path):
    w = B.BundleWriter(tmp_path, "b")
    w.write_json(B.RUN, {})
    w.write_json(B.ENV, {})
    (w.tmp / B.ENV).unlink()  # a cleanup that took one file only
    with pytest.raises(reprokit.BundleError, match=r"1 of 2 files .* env.json \(missing\)"):
        w.commit()
    assert list(tmp_path.iterdir()) == [], "nothing committed, temp dir removed"


def _steps_then_ctrl_c():
    yield B.StepRecord(1, {"x": 1}, {"x": torch.ones(3)}, {})
    raise KeyboardInterrupt


def test_ctrl_c_while_writing_leaves_no_temp_folder(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        B.write_bundle(B.BundleWriter(tmp_path, "b"), failure={}, run={}, env={}, state=({}, {"a": torch.zeros(2)}),
                       steps=_steps_then_ctrl_c())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt), B.BundleWriter(tmp_path, "c") as w:
        w.write_json(B.RUN, {})
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with B.BundleWriter(tmp_path, "d") as w:
        w.write_json(NOTES, {})
        done = w.commit()
    assert [p.name for p in tmp_path.iterdir()] == ["d"] and B.verify(done) == []


def test_leftovers_are_judged_by_owner_and_age(tmp_path):
    import os
    import time

    live = B.BundleWriter(tmp_path, "live")  # this process: alive
    live.write_json(B.RUN, {})
    old = tmp_path / ".tmp-bundle-x-0123abcd"  # named before owners were recorded
    old.mkdir()
    (old / "run.json").write_bytes(b"{}")
    recent = tmp_path / ".tmp-bundle-y-pid1.5-on-elsewhere-89abcdef"  # another host, just written
    recent.mkdir()
    (tmp_path / ".tmp-unrelated").mkdir()  # not a writer's name: never touched
    week = time.time() - 7 * 86400
    for p in (old, old / "run.json"):
        os.utime(p, (week, week))
    found = {x.path.name: x for x in B.find_leftovers(tmp_path)}
    assert set(found) == {live.tmp.name, old.name, recent.name}
    assert found[live.tmp.name].state == "writing" and found[live.tmp.name].owner.startswith(f"pid {os.getpid()} ")
    assert found[old.name].state == "abandoned" and found[old.name].bytes == 2 and found[old.name].owner == "unknown"
    assert found[recent.name].state == "recent"
    assert [x.path.name for x in B.remove_leftovers(tmp_path, dry_run=True) if x.removed] == []
    assert old.exists()
    removed = [x.path.name for x in B.remove_leftovers(tmp_path) if x.removed]
    assert removed == [old.name] and not old.exists() and live.tmp.exists() and recent.exists()
    live.abort()


def test_a_state_part_numbered_past_the_parts_listed_costs_nothing_and_is_refused(tmp_path):
    """The check for gaps is sized by how many parts the manifest lists, never by a part's number."""
    w = B.BundleWriter(tmp_path, "b")
    w.write_json(B.STATE_JSON, {"state": {}, "rng": {}})
    path = w.commit()
    m = json.loads((path / B.MANIFEST).read_text())
    m["files"]["state/state-999999999999.safetensors"] = {"sha256": "0" * 64, "size": 1}
    m["self_sha256"] = B._self_digest(m)
    (path / B.MANIFEST).write_text(json.dumps(m))
    problems = B.verify(path)
    assert {"file": B.STATE_TENSORS, "problem": "not in the manifest, which lists 1 other part(s) of the state: the "
            "state is incomplete"} in problems, problems
    with pytest.raises(reprokit.BundleError, match="state is incomplete"):
        B.open_bundle(path)
