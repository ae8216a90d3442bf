"""``on_failure="skip"`` under torchrun (two CPU ranks, gloo, DDP): a poisoned sample on rank 1 is skipped on rank 1,
rank 0 rolls back and replays with it, both finish, and every rank's final weights, optimizer state and RNG are
those of a run whose rank 1 never held the sample. A rank that cannot roll back stops every rank."""

from __future__ import annotations

import pytest
import torch
from rk_testing import PROJECTS, torchrun
from safetensors.torch import load_file

import reprokit
from reprokit.skip_journal import read_journal

pytestmark = pytest.mark.slow


def test_a_sample_poisoned_on_rank_1_is_skipped_there_and_every_rank_ends_as_the_clean_run(projects, tmp_path):
    ddp = projects("rk_skip_ddp")

    runs = {}
    for mode in ("skip", "clean"):
        out = tmp_path / mode
        out.mkdir()
        r = torchrun(PROJECTS / "rk_skip_ddp.py", out, mode, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
        runs[mode] = r
    for rank in (0, 1):
        skipped = load_file(str(tmp_path / "skip" / f"final-rank{rank}.safetensors"))
        clean = load_file(str(tmp_path / "clean" / f"final-rank{rank}.safetensors"))
        assert sorted(skipped) == sorted(clean)
        assert [k for k in skipped if not torch.equal(skipped[k], clean[k])] == []
    (entry,) = read_journal(tmp_path / "skip")
    assert entry["rank"] == 1 and entry["step"] == ddp.POISON_STEP and entry["rows"] == [ddp.POISON_ROW]
    assert entry["dataset_indices"] == [ddp.poisoned_index()]
    assert entry["evidence"]["ranks"] == {"rolled_back": [0, 1], "culprits": {"1": [ddp.POISON_ROW]}}
    assert entry["incident"] and entry["bundle"].startswith(str(tmp_path / "skip" / entry["incident"]))
    assert reprokit.skip_list(tmp_path / "skip") == [ddp.poisoned_index()]
    err = runs["skip"].stderr
    assert f"rank 1: step {ddp.POISON_STEP} failed" in err and f"skipped dataset indices [{ddp.poisoned_index()}]" in err
    assert f"rank 0: step {ddp.POISON_STEP} failed" in err and "rank(s) 1 skipped their proven culprit rows" in err


def test_a_rank_that_cannot_roll_back_stops_every_rank(projects, tmp_path):
    ddp = projects("rk_skip_ddp")

    r = torchrun(PROJECTS / "rk_skip_ddp.py", tmp_path, "rank0-raises", cwd=tmp_path)
    assert r.returncode != 0
    # rank 0 says at once that it does not skip: rank 1 stops with that reason, not after 5 s of silence
    assert f"did not skip step {ddp.POISON_STEP} (distributed): rank 0 does not skip failures (its Recorder has " \
           'on_failure="raise"): every rank stops' in r.stderr, r.stderr[-6000:]
    assert not (tmp_path / "skips.jsonl").exists()
    assert not list(tmp_path.glob("final-rank*"))
