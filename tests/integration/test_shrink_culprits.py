"""Shrink names the right culprit, or none: the state that fails on any data, the micro-batch that holds the bad
sample, the row dimension of stacked micro-batches.

Every failure here is forced with a wide margin (an LR multiplied by 1e24, a NaN in one sample), so the answers
do not depend on the CPU's last float bits.
"""

from __future__ import annotations

import json

from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.cli import main
from reprokit.report import format_shrink


def shrink_json(bundle, out) -> dict:
    result = CliRunner().invoke(main, ["shrink", str(bundle), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_state_that_fails_on_any_data_names_no_sample(projects, tmp_path):
    rk_mlp = projects("rk_mlp")
    # The LR schedule multiplies the LR by 1e24 at step 6: AdamW moves every weight by ~1e24, and step 7's loss
    # overflows to inf whatever its batch holds.
    config = {"scheduler": "jump", "batch_size": 4}
    _, exc = record(rk_mlp, config, rk_mlp.batches(config, 20), tmp_path / "repros", snapshot_every=4)
    bundle = bundle_of(exc)
    d = shrink_json(bundle, tmp_path / "small")
    check = d["state_check"]
    assert check["verdict"] == "state" and check["step"] == 7
    assert [t["batch_of"] for t in check["tried"]] == [6, 5, 4]
    assert all(t["result"] == "same failure" for t in check["tried"])
    assert "upstream of this batch" in check["message"]
    # No sample named, no row cut; fewer steps is still a smaller repro.
    assert d["kept_rows"] is None and d["dataset_indices"] is None
    assert d["rows_after"] == d["rows_before"] == 4 and d["tokens_after"] == d["tokens_before"]
    assert d["steps_after"] == 1 and set(d["passes"]) == {"steps"}

    text = format_shrink(d)
    assert "no data culprit: the state fails on any data" in text and "kept rows" not in text
    inspected = CliRunner().invoke(main, ["inspect", str(tmp_path / "small")]).output
    assert "data     the batch of step 7 is not the cause: the state fails on any data" in inspected
    diag = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "small"), "--json"]).output)["diagnosis"]
    assert diag["state_check"]["verdict"] == "state"
    assert json.loads((tmp_path / "small" / "run.json").read_text())["provenance"]["dataset_indices"] is None


def test_a_bad_sample_is_still_named_once_healthy_batches_pass(projects, tmp_path):
    rk_mlp = projects("rk_mlp")
    _, exc = record(rk_mlp, {}, rk_mlp.batches({}, 8, poison_step=5), tmp_path / "repros", snapshot_every=4)
    d = shrink_json(bundle_of(exc), tmp_path / "small")
    check = d["state_check"]
    assert check["verdict"] == "data" and check["tried"] == [{"batch_of": 4, "result": "it passed"}]
    assert d["rows_after"] == 1 and d["dataset_indices"] == [5 * 16 + 3]  # row 3 of step 5 holds the NaN
