"""Soak: a tiny model trained for 20,000 steps under the recorder; memory, file handles and speed.

    python bench/soak.py                 # 20,000 steps with the recorder, 20,000 bare, interleaved
    python bench/soak.py --quick --json  # smoke run for the test suite (1,000 steps; timings meaningless)

Questions it answers:
- Does host memory stay flat over a long run? RSS (``/proc/self/statm``) is sampled every
  ``--sample`` steps of the recorder run; the report gives its growth from the first sample
  after warm-up (snapshot buffers, batch pool and allocator settled) to the last, and the slope
  of a least-squares line through the samples (bytes per 1,000 steps).
- Are file handles leaked? ``/proc/self/fd`` is counted at the same points (the recorder dumps
  nothing in a healthy run, but its worker threads, spill files and hooks must not pile up).
- What does the recorder cost here? The bare loop and the recorder run in alternating blocks
  of ``--block`` steps in one process (two models built alike), so drift of the machine hits
  both; the ratio is recorder / bare mean step time.

The model is a 2-layer MLP (64 -> 128 -> 1) on batches of 32, AdamW, snapshot every 100 steps
(the default). On such a tiny step the recorder's fixed per-step cost dominates: the ratio is
an upper bound of what a real model sees, not a typical figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from io_bench import _commit
from memory_budget import build, train_step  # the same MLP (bench/ is the script's folder)

import reprokit


def batches(cfg, g):
    while True:
        x = torch.randn(cfg["batch"], cfg["d"], generator=g)
        yield {"x": x, "y": x[:, 0].sin()}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def slope_per_1000(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of (step, value), per 1,000 steps."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(s for s, _ in points) / n
    my = sum(v for _, v in points) / n
    var = sum((s - mx) ** 2 for s, _ in points)
    return 1000 * sum((s - mx) * (v - my) for s, v in points) / var if var else 0.0


def run(steps: int, block: int, sample: int, warmup: int, cfg: dict, out_dir: str) -> dict:
    bare_state, rec_state = build(cfg), build(cfg)
    rec = reprokit.Recorder(rec_state, train_step, build=build, config=cfg, out_dir=out_dir)
    g_bare, g_rec = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    bare_data, rec_data = batches(cfg, g_bare), batches(cfg, g_rec)
    times = {"bare": 0.0, "recorder": 0.0}
    samples: list[dict] = []
    done = 0
    while done < steps:
        n = min(block, steps - done)
        t0 = time.perf_counter()
        for _ in range(n):
            train_step(bare_state, next(bare_data)).item()
        t1 = time.perf_counter()
        for i in range(n):
            rec.step(next(rec_data)).item()
            k = done + i + 1
            if k % sample == 0 or k == steps:
                samples.append({"step": k, "rss_bytes": rss_bytes(), "open_fds": open_fds()})
        t2 = time.perf_counter()
        times["bare"] += t1 - t0
        times["recorder"] += t2 - t1
        done += n
    settled = [s for s in samples if s["step"] > warmup] or samples
    rss = [(s["step"], s["rss_bytes"]) for s in settled]
    fds = [s["open_fds"] for s in settled]
    stats = rec.stats()
    rec.close()
    return {
        "steps": steps,
        "bare_step_ms": 1000 * times["bare"] / steps,
        "recorder_step_ms": 1000 * times["recorder"] / steps,
        "ratio": times["recorder"] / times["bare"],
        "rss_first_bytes": rss[0][1],
        "rss_last_bytes": rss[-1][1],
        "rss_max_bytes": max(v for _, v in rss),
        "rss_growth_bytes": rss[-1][1] - rss[0][1],
        "rss_slope_bytes_per_1000_steps": slope_per_1000(rss),
        "fds_first": fds[0],
        "fds_last": fds[-1],
        "fds_max": max(fds),
        "samples_after_warmup": len(settled),
        "recorder_stats": stats,
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 steps: the smoke run of the test suite")
    ap.add_argument("--steps", type=int, default=None, help="steps per variant (default 20,000; quick 1,000)")
    ap.add_argument("--block", type=int, default=500, help="steps per alternating block")
    ap.add_argument("--sample", type=int, default=None, help="sample RSS and fds every this many steps")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON report here")
    a = ap.parse_args()
    steps = a.steps or (1000 if a.quick else 20_000)
    sample = a.sample or max(1, steps // 100)
    warmup = min(steps // 10, 2000)
    torch.set_num_threads(1)
    cfg = {"d": 64, "hidden": 128, "batch": 32}
    commit = _commit()
    with tempfile.TemporaryDirectory(prefix="reprokit-soak-") as out_dir:
        result = run(steps, min(a.block, steps), sample, warmup, cfg, out_dir)
        leftovers = sorted(os.listdir(out_dir))
    report = {"commit": commit, "device": "cpu", "torch": torch.__version__, "threads": 1, "config": cfg,
              "block": a.block, "sample_every": sample, "warmup_steps": warmup, "out_dir_entries": leftovers,
              **result}
    if a.save:
        a.save.write_text(json.dumps(report, indent=1) + "\n")
    if a.json:
        print(json.dumps(report))
        return
    mib = 1 / (1 << 20)
    print(f"soak: {steps} steps each, bare and recorder in alternating blocks of {a.block} (commit {commit}, cpu)")
    print(f"  step: bare {report['bare_step_ms']:.3f} ms, recorder {report['recorder_step_ms']:.3f} ms, "
          f"ratio {report['ratio']:.3f}")
    print(f"  RSS after warm-up ({warmup} steps): {report['rss_first_bytes'] * mib:.1f} -> "
          f"{report['rss_last_bytes'] * mib:.1f} MiB (max {report['rss_max_bytes'] * mib:.1f}), slope "
          f"{report['rss_slope_bytes_per_1000_steps'] / 1024:.1f} KiB / 1,000 steps")
    print(f"  open fds: {report['fds_first']} -> {report['fds_last']} (max {report['fds_max']}); "
          f"out_dir entries: {leftovers}")


if __name__ == "__main__":
    main()
