"""What the recorder's first window costs over bare steps, each measured in a fresh process.

    python bench/first_window.py --save bench/results/first_window-<device>-<commit>.json   # GPU: GPT-2 124M
    python bench/first_window.py --quick --json                                           # CPU smoke run

Steady-state overhead (``recorder_overhead.py``) leaves out what a recorder pays once: pinning its host buffers
(the CUDA driver pins about 3 GB/s), its first snapshot, the batch slots of its first window. The caching host
allocator keeps pinned blocks once freed, so a second recorder in the same process would find them for free:
every run here is a new process. Each builds the model, runs ``--warmup`` bare steps (kernels, allocator), then
times ``--steps`` steps: bare, or through a Recorder made right then (``snapshot_every`` = the steps timed,
so the window is exactly the first one), and the step after it, which takes the second snapshot: state that
appeared after step 0 (AdamW's moments) needs its buffers by then. Making the Recorder is timed apart: it pins
the state's buffers ahead (one-time setup, like building the model). Each process then times as many bare
steps again: the window over those is free of the spread between processes (bare runs give the A/A floor).
Runs alternate bare / recorder for ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import reprokit

sys.path.insert(0, str(Path(__file__).parent))
from io_bench import _commit, save_and_print  # noqa: E402
from recorder_overhead import build, make_batch  # noqa: E402

from gpt import GPT2, train_step  # noqa: E402

QUICK = {"layers": 2, "d": 64, "heads": 4, "vocab": 256, "ctx": 32, "batch": 2}


def phase(kind: str, steps: int, warmup: int, quick: bool) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not quick
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    cfg = {**(QUICK if quick else GPT2), "device": "cuda" if cuda else "cpu"}
    state = build(cfg)
    g = torch.Generator(device=cfg["device"]).manual_seed(0)
    batches = [make_batch(cfg, g) for _ in range(8)]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for i in range(warmup):
        train_step(state, batches[i % 8]).item()
    sync()
    made_s = 0.0
    step = train_step
    rec = None
    if kind == "recorder":
        t0 = time.perf_counter()
        rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp(),
                                snapshot_every=steps)
        sync()
        made_s = time.perf_counter() - t0
        step = lambda s, b: rec.step(b)  # noqa: E731
    def window(step) -> tuple[float, list[float]]:
        times = []
        t_all = time.perf_counter()
        for i in range(steps + 1):  # the window, and the step that takes the second snapshot (its new buffers)
            t0 = time.perf_counter()
            step(state, batches[i % 8]).item()
            times.append(time.perf_counter() - t0)
        sync()
        return time.perf_counter() - t_all, times

    total, times = window(step)
    out: dict[str, Any] = {"kind": kind, "total_s": total, "step_ms": [t * 1e3 for t in times],
                           "recorder_made_s": made_s}
    if rec is not None:
        out["stats"] = {k: v for k, v in rec.stats().items() if isinstance(v, (int, float, str, type(None)))}
        rec.close()
    # The same number of bare steps again in this process: a reference free of the process-to-process spread.
    out["bare_after_s"] = window(train_step)[0]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    steps = 4 if args.quick else args.steps
    warmup = 2 if args.quick else args.warmup
    rounds = 1 if args.quick else args.rounds
    runs: dict[str, list[dict[str, Any]]] = {"bare": [], "recorder": []}
    for r in range(rounds):
        for kind in (("bare", "recorder") if r % 2 == 0 else ("recorder", "bare")):
            cmd = [sys.executable, __file__, "--phase", kind, "--steps", str(steps), "--warmup", str(warmup)]
            proc = subprocess.run(cmd + (["--quick"] if args.quick else []), capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{kind} run failed:\n{proc.stderr[-3000:]}")
            runs[kind].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    bare = statistics.mean(r["total_s"] for r in runs["bare"])
    rec = statistics.mean(r["total_s"] for r in runs["recorder"])

    def parts(kind: str) -> dict[str, float]:
        """Mean ms of step 0 (first snapshot), steps 1..n-1 together, and step n (second snapshot)."""
        ms = [r["step_ms"] for r in runs[kind]]
        return {"step_0": statistics.mean(m[0] for m in ms), "steps_1_to_n-1": statistics.mean(sum(m[1:-1]) for m in ms),
                "step_n": statistics.mean(m[-1] for m in ms)}
    cuda = torch.cuda.is_available() and not args.quick
    return {"benchmark": "first_window", "commit": _commit(), "torch": torch.__version__,
            "python": platform.python_version(), "cores": os.cpu_count(),
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})",
            "steps": steps, "warmup": warmup, "rounds": rounds,
            "bare_window_s": [r["total_s"] for r in runs["bare"]],
            "recorder_window_s": [r["total_s"] for r in runs["recorder"]],
            "ratio": rec / bare,
            # Each process's window over the bare steps it ran next: the recorder's runs, and the bare runs (A/A).
            "ratio_in_process": statistics.mean(r["total_s"] / r["bare_after_s"] for r in runs["recorder"]),
            "ratio_in_process_aa": statistics.mean(r["total_s"] / r["bare_after_s"] for r in runs["bare"]),
            "parts_ms": {k: parts(k) for k in runs},
            "recorder_made_s": statistics.mean(r["recorder_made_s"] for r in runs["recorder"]),
            "recorder_stats": runs["recorder"][-1].get("stats"),
            "first_steps_ms": {k: [round(x, 2) for x in runs[k][0]["step_ms"][:5]] for k in runs}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="steps timed (the recorder's first window)")
    ap.add_argument("--warmup", type=int, default=20, help="bare steps before timing, in every process")
    ap.add_argument("--rounds", type=int, default=3, help="bare/recorder process pairs")
    ap.add_argument("--quick", action="store_true", help="tiny GPT on the CPU (smoke run; figures meaningless)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON result here")
    ap.add_argument("--phase", choices=("bare", "recorder"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.steps, args.warmup, args.quick)))
        return
    res = run(args)
    if save_and_print(res, args.save, args.json):
        return
    print(f"{res['device']}, commit {res['commit']}: {res['steps']} steps after {res['warmup']} warm-up steps, "
          f"{res['rounds']} rounds, a fresh process each")
    print(f"  bare window      {', '.join(f'{t:.3f}' for t in res['bare_window_s'])} s")
    print(f"  recorder window  {', '.join(f'{t:.3f}' for t in res['recorder_window_s'])} s")
    print(f"  first window / bare: {res['ratio']:.3f}   (making the Recorder, pinning ahead: {res['recorder_made_s']:.3f} s)")
    print(f"  window / the same process's bare steps after it: recorder {res['ratio_in_process']:.3f}, "
          f"bare (A/A) {res['ratio_in_process_aa']:.3f}")
    print(f"  first steps ms: {res['first_steps_ms']}")
    for part in res["parts_ms"]["bare"]:
        b, r = res["parts_ms"]["bare"][part], res["parts_ms"]["recorder"][part]
        print(f"  {part:<16} bare {b:9.1f} ms   recorder {r:9.1f} ms   (+{r - b:.1f} ms)")


if __name__ == "__main__":
    main()
