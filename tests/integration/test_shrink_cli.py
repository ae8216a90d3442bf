"""`reprokit shrink` through the CLI, in-process and with --isolate."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import entries, record

from reprokit import bundle as B
from reprokit.cli import main


def test_shrink_json(nan_bundle, tmp_path):
    out = tmp_path / "small"
    result = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert {"replays", "steps_before", "steps_after", "rows_before", "rows_after", "seq_before", "seq_after",
            "kept_rows", "output"} <= d.keys()
    assert (d["steps_before"], d["steps_after"], d["rows_before"], d["rows_after"]) == (3, 1, 16, 1)
    assert d["kept_rows"] == [3] and d["dataset_indices"] == [6 * 16 + 3] and d["output"] == str(out)
    assert B.verify(out) == []
    prov = json.loads((out / "run.json").read_text())["provenance"]
    assert prov["source_manifest_sha256"] == B.sha256_file(nan_bundle / "manifest.json")
    assert prov["replays"] == d["replays"] and prov["kept_rows"] == [3]
    assert set(prov["passes"]) == {"steps", "micro", "rows", "sequence", "tokens"}
    replay = CliRunner().invoke(main, ["replay", str(out), "--json"])
    assert replay.exit_code == 1 and json.loads(replay.output)["fidelity"]["bit_exact"]


def test_shrink_human_summary(nan_bundle, tmp_path):
    result = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    assert "kept rows [3] of the failing batch" in result.output and "still fails: nonfinite_loss" in result.output


@pytest.mark.slow
def test_isolated_shrink_matches_in_process(nan_bundle, tmp_path):
    a = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(tmp_path / "a"), "--passes", "steps,rows",
                                  "--json"])
    b = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(tmp_path / "b"), "--passes", "steps,rows",
                                  "--isolate", "--timeout", "120", "--json"])
    assert a.exit_code == 0 and b.exit_code == 0, b.output
    da, db = json.loads(a.output), json.loads(b.output)
    assert (da["kept_rows"], da["steps_after"], da["replays"]) == (db["kept_rows"], db["steps_after"], db["replays"])


def test_shrink_errors(nan_bundle, tmp_path, projects):
    bad = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(tmp_path / "x"), "--passes", "rows,nope"])
    assert bad.exit_code == 2 and "unknown shrink pass(es) nope" in bad.output
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    busy = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(tmp_path / "full")])
    assert busy.exit_code == 2 and "already exists" in busy.output
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    src = (nan_bundle / "code" / "rk_mlp.py").read_text().replace(
        "def train_step(state, batch):\n",
        "def train_step(state, batch):\n    batch = {**batch, 'x': torch.nan_to_num(batch['x'])}\n")
    (fixed / "rk_mlp.py").write_text(src)
    gone = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(tmp_path / "y"), "--code", str(fixed),
                                     *entries(nan_bundle)])
    assert gone.exit_code == 1 and "does not reproduce" in gone.output


@pytest.mark.slow
def test_a_result_larger_on_disk_says_so_and_why(projects, tmp_path):
    # A wide model, snapshot at step 0 (Adam has no moments yet), NaN at step 3: the steps pass starts the result
    # from a later state, which holds Adam's moments, so the result is larger on disk though it replays 1 step.
    mlp = projects("rk_mlp")
    cfg = {"batch_size": 4, "dim": 96, "tied": True, "optimizer": "adam"}
    _, exc = record(mlp, cfg, mlp.batches(cfg, 5, poison_step=3), tmp_path / "repros", snapshot_every=100)
    out = tmp_path / "small"
    result = CliRunner().invoke(main, ["shrink", str(exc.bundle), "-o", str(out)])
    assert result.exit_code == 0, result.output
    on_disk = next(line for line in result.output.splitlines() if line.strip().startswith("on disk"))
    assert "larger on disk: it starts from a later state" in result.output, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    after = sum(e["size"] for e in manifest["files"].values())
    assert on_disk.split()[-2:] == [f"{after / 1e6:.2f}", "MB"] or on_disk.endswith(f"{after / 1e3:.1f} kB")
    d = json.loads(CliRunner().invoke(main, ["shrink", str(exc.bundle), "-o", str(tmp_path / "j"), "--json"]).output)
    assert d["steps_after"] < d["steps_before"] and d["bytes_after"] > d["bytes_before"] == sum(
        e["size"] for e in json.loads((exc.bundle / "manifest.json").read_text())["files"].values())
    assert d["state_bytes_after"] > d["state_bytes_before"] > 0
    # Keeping the original start keeps the original state: no longer larger for that reason.
    kept = CliRunner().invoke(main, ["shrink", str(exc.bundle), "-o", str(tmp_path / "k"), "--passes",
                                     "rows,sequence,tokens", "--json"])
    k = json.loads(kept.output)
    assert k["steps_after"] == k["steps_before"] and k["state_bytes_after"] == k["state_bytes_before"]


@pytest.mark.parametrize("command", ["shrink", "extract"])
def test_an_output_that_is_a_mount_point_is_refused_before_any_work(nan_bundle, command):
    # The result is renamed onto OUTPUT; onto a mount point (an empty `docker -v ./out:/out`, say) that fails with
    # EBUSY, which was an internal error (exit 70) after the whole shrink. "/" is a mount point on every machine.
    result = CliRunner().invoke(main, [command, str(nan_bundle), "-o", "/"])
    assert result.exit_code == 2, result.output
    assert "/ is a mount point" in result.output and "Name a new folder inside it" in result.output, result.output
