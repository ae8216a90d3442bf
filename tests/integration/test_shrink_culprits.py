"""Shrink names the right culprit, or none: the state that fails on any data, the micro-batch that holds the bad
sample, the row dimension of stacked micro-batches.

Every failure here is forced with a wide margin (an LR multiplied by 1e24, a NaN in one sample), so the answers
do not depend on the CPU's last float bits.
"""

from __future__ import annotations

import json

import pytest
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


@pytest.mark.slow
def test_hf_accumulation_cuts_each_micro_batch_on_its_own_and_names_the_culprits_own_index(tmp_path):
    from rk_hf_data import Embeds, tiny
    from transformers import Trainer, TrainingArguments

    from reprokit import TrainingFailure
    from reprokit.bundle import open_bundle
    from reprokit.integrations.transformers import ReprokitCallback

    bad = 58  # the Trainer's shuffle (seed 3) feeds it in update 1, as row 4 of micro-batch 1 (row 4 of micro-batch 0: 2)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
                             gradient_accumulation_steps=4, seed=3, max_steps=6, report_to=[], logging_strategy="no",
                             save_strategy="no", disable_tqdm=True, use_cpu=True)
    trainer = Trainer(model=tiny(), args=args, train_dataset=Embeds(64, bad=bad),
                      callbacks=[ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=4)])
    with pytest.raises(TrainingFailure) as info:
        trainer.train()
    source = open_bundle(info.value.bundle)
    micros = [m["index"].tolist() for m in source.step(source.failure.step)[0]["micro"]]
    (where,) = [[k, ids.index(bad)] for k, ids in enumerate(micros) if bad in ids]
    assert where[0] != 0 and len(micros) == 4, micros  # not in micro-batch 0: its row would name another sample

    result = CliRunner().invoke(main, ["shrink", str(info.value.bundle), "-o", str(tmp_path / "small"), "--json",
                                       "--passes", "steps,micro,rows"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["kept_rows"] == [where] and d["dataset_indices"] == [bad]
    assert d["rows_before"] == 32 and d["rows_after"] == 1
    assert d["passes"]["micro"]["accepted"] >= 1
    small = open_bundle(tmp_path / "small")
    assert [m["index"].tolist() for m in small.step(small.failure.step)[0]["micro"]] == [[bad]]
    assert f"kept micro-batch {where[0]} row {where[1]} of the failing batch (dataset indices [{bad}])" \
        in format_shrink(d)


@pytest.mark.slow
def test_stacked_micro_batches_take_their_row_dimensions_from_the_index_leaf(projects, tmp_path):
    lm = projects("rk_lm")
    config = {"vocab": 32, "max_len": 16, "nan_token": 7}
    step, k, row = 2, 2, 1  # a corrupted embedding row's token in row 1 of micro-batch 2: NaN loss, forced
    _, exc = record(lm, config, lm.stacked_batches(config, 6, bad=(step, k, row)), tmp_path / "repros",
                    step=lm.stacked_step, snapshot_every=4)
    bundle = bundle_of(exc)
    d = shrink_json(bundle, tmp_path / "small")
    index = 30000000 + 32 * (step * 16 + k * 4 + row)
    assert d["state_check"]["verdict"] == "data"
    assert d["rows_before"] == 16 and d["rows_after"] == 1  # 4 micro-batches of 4 rows, not 4 rows
    assert d["seq_before"] == 8 and d["seq_after"] < 8  # the sequence is dim 2, not the micro-batch's rows
    assert d["kept_rows"] == [[k, row]] and d["dataset_indices"] == [index]
    small = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "small"), "--json"]).output)
    assert small["batch"]["index"]["shape"] == [1, 1] and small["batch"]["x"]["shape"][:2] == [1, 1]


@pytest.mark.slow
def test_stacked_micro_batches_without_an_index_leaf_are_said_to_be_ambiguous(projects, tmp_path):
    lm = projects("rk_lm")
    config = {"vocab": 32, "max_len": 16, "nan_token": 7}
    _, exc = record(lm, config, lm.stacked_batches(config, 6, bad=(2, 2, 1), index=False), tmp_path / "repros",
                    step=lm.stacked_step, snapshot_every=4)
    d = shrink_json(bundle_of(exc), tmp_path / "small")
    # [4, 4, 8] token ids: rows along dim 0 would call 4 micro-batches 4 rows and their rows a sequence.
    assert "x is int64[4, 4, 8]: its rows may be dim 0, or dims 0 and 1" in d["rows_ambiguous"]
    assert d["rows_before"] is None and d["seq_before"] is None and d["kept_rows"] is None
    assert set(d["passes"]) == {"steps", "tokens"}
    assert "rows not cut: x is int64[4, 4, 8]" in format_shrink(d)
