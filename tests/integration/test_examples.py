"""Every script in examples/ runs (in --quick mode) and tells its story.

The scripts and the benchmarks' smoke runs run as processes of their own forked from one server that imported torch
(the ``fork_server`` fixture, tests/rk_forked.py), without a torch import each; what a benchmark times in fresh
processes it starts itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from zoo_cases import ZOO

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# The failure-zoo examples (tests/zoo_cases.py) run in test_zoo.py, as the first step of their journey.
EXPECT = {
    "tinylm.py": ["TinyLM (", "loss 2.78 -> "],
}


@pytest.fixture(autouse=True)
def _scratch_in_tmp_path(tmp_path, monkeypatch):
    """The scripts keep their output in a temporary folder for the user to look at: here, inside pytest's own."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES) == sorted([*EXPECT, *ZOO])


@pytest.mark.parametrize("script", [p for p in EXAMPLES if p.name not in ZOO], ids=lambda p: p.name)
@pytest.mark.slow
def test_example_runs(script, tmp_path, fork_server):
    proc = fork_server.capture(["--quick"], script=script, cwd=tmp_path, env={"TMPDIR": os.environ["TMPDIR"]},
                               timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in EXPECT[script.name]:
        assert line in proc.stdout, proc.stdout


@pytest.fixture
def bench_json(fork_server):
    """``bench_json(NAME)``: run ``bench/NAME.py --quick --json`` (the smoke run) and return what it printed."""
    import json

    def run(name: str) -> dict | list:
        proc = fork_server.capture(["--quick", "--json"], script=ROOT / "bench" / f"{name}.py", cwd=Path.cwd(),
                                   env={"TMPDIR": os.environ["TMPDIR"]}, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    return run


@pytest.mark.slow
def test_shrink_bench_quick_runs(bench_json):
    rows = bench_json("shrink_bench")
    assert len(rows) == 4 and all(r["after"]["rows"] <= r["before"]["rows"] for r in rows)


@pytest.mark.slow
def test_extract_size_bench_quick_runs_and_replays_standalone(bench_json):
    report = bench_json("extract_size")
    for name, module in (("attention module", "blocks.0.attn"), ("attention inline", "blocks.0")):
        res = report["variants"][name]
        assert res["extract"]["module"] == module and res["extract"]["op"] == "aten._softmax.default", res
        assert res["replays_standalone"] and res["op_repro"]["exit"] == 1, res
        assert res["packed_extract_bytes"] < res["bundle_bytes"], res


@pytest.mark.slow
def test_recorder_overhead_bench_quick_runs(bench_json):
    report = bench_json("recorder_overhead")
    assert {"bare", "recorder", "recorder+checks", "detect_anomaly"} <= report["variants"].keys()
    assert report["variants"]["bare"]["ratio"] == 1.0


@pytest.mark.slow
def test_flight_overhead_bench_quick_times_every_record_kind(bench_json):
    report = bench_json("flight_overhead")
    assert report["batch_bytes"] == 2 * 8 * 1024 * 8
    assert all(t["median_us"] > 0 for t in report["records"].values()), report["records"]
    assert {"step record (CPU batch, training thread)", "end record (training thread)"} <= report["records"].keys()
    assert report["steps"]["durable_step_us"] > 0


@pytest.mark.slow
def test_memory_budget_bench_quick_runs_and_stays_under_its_budget(bench_json):
    report = bench_json("memory_budget")
    small = report["variants"]["recorder (budget 2 MiB)"]
    assert small["early_snapshots"] >= 1 and small["peak_buffers_bytes"] <= small["budget_bytes"], small


@pytest.mark.slow
def test_ddp_overhead_bench_quick_runs_two_ranks_and_writes_both_windows(bench_json):
    report = bench_json("ddp_overhead")
    assert report["world_size"] == 2 and [r["rank"] for r in report["ranks"]] == [0, 1]
    # rank 1 fed the NaN; rank 0 got it through the all-reduce; both wrote their window
    assert {r["rank"]: r["failure"] for r in report["ranks"]} == {0: "nonfinite_grad", 1: "nonfinite_loss"}
    assert all(r["dump_s"] is not None and r["bundle_bytes"] > 0 for r in report["ranks"]), report["ranks"]


@pytest.mark.slow
def test_io_bench_quick_runs(bench_json):
    report = bench_json("io_bench")
    assert {"dump", "load", "verify", "pack", "open_archive"} <= report["figures"].keys()
    assert all(f["ratio"] > 0 and f["limit_Bps"] > 0 for f in report["figures"].values()), report["figures"]
    assert report["inspect_exit"] == 0 and report["archive"]["name"] == "repro.tar"


@pytest.mark.slow
def test_spill_bench_quick_records_and_replays_a_spilled_state(bench_json):
    report = bench_json("spill_bench")
    s = report["summary"]
    assert s["verdict"] == "deterministic" and report["replay"]["bit_exact"], report
    assert s["state_GB"] > 0 and s["spill_GBps"] > 0 and s["replay_peak_rss_GB"] > 0, s
    assert report["record"]["stats"]["snapshots_spilled"] is None, "spill_dir was asked for: not a budget fallback"


@pytest.mark.slow
def test_first_window_bench_quick_times_both_kinds_in_fresh_processes(bench_json):
    report = bench_json("first_window")
    assert len(report["bare_window_s"]) == len(report["recorder_window_s"]) == 1 and report["ratio"] > 0, report
    # The timed steps are the first window and the step that takes the second snapshot (a window of one step after).
    assert report["recorder_stats"]["window_steps"] == 1, report["recorder_stats"]
    assert set(report["parts_ms"]["recorder"]) == {"step_0", "steps_1_to_n-1", "step_n"}, report["parts_ms"]
    assert report["ratio_in_process"] > 0 and report["ratio_in_process_aa"] > 0, report


@pytest.mark.slow
def test_cli_gpt2_bench_quick_times_every_command_on_a_recorded_failure(bench_json):
    report = bench_json("cli_gpt2")
    assert set(report["seconds"]) == {"--help", "--version", "inspect", "verify", "replay", "replay --times 2",
                                      "pack", "verify archive", "replay archive"}, report["seconds"]
    assert all(s > 0 for s in report["seconds"].values()) and report["bundle_write_s"] > 0, report
    assert report["bundle_bytes"] > 0 and report["archive_bytes"] >= report["bundle_bytes"], report


@pytest.mark.slow
def test_replay_start_bench_quick_times_the_phases_of_a_fresh_replay(bench_json):
    report = bench_json("replay_start")
    assert report["reproduced"] and report["steps_replayed"] == report["window_steps"], report
    assert report["load_s"] > 0 and report["to_first_step_s"] > 0 and report["first_step_ms"] > 0, report
    assert report["to_first_step_over_train_step"] > 0 and report["train_step_ms"] > 0, report
    assert report["disk_read_Bps"] > 0 and report["state_read_over_disk_read"] > 0, report
    ref = report["without_preload"]  # the side-by-side replay with Session(preload=False)
    assert ref["reproduced"] and ref["state_read_s"] > 0 and ref["restore_ms"] > 0, ref


@pytest.mark.slow
def test_soak_bench_quick_runs_without_leaking_file_handles(bench_json):
    report = bench_json("soak")
    assert report["steps"] == 1000 and report["samples_after_warmup"] >= 50
    assert report["fds_last"] <= report["fds_first"], report  # nothing the recorder opens piles up
    assert report["rss_growth_bytes"] < 64 << 20, report
    assert report["out_dir_entries"] == [], "a healthy run writes no bundle"


@pytest.mark.slow
def test_skip_cost_bench_quick_skips_the_poisoned_sample_and_prices_a_restart(bench_json):
    report = bench_json("skip_cost")
    skip, restart = report["skip"], report["restart"]
    assert skip["dataset_indices"] == [13 * 4 + 3] and skip["steps_replayed_since_snapshot"] == 5, skip
    assert skip["step_s"] > 0 and skip["journal_seconds_lost"] > 0 and restart["total_s"] > 0, report
    assert report["skip_over_restart"] == skip["lost_s"] / restart["total_s"], report
