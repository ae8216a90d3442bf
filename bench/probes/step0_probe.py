"""Where does the recorder's step 0 go? (GPT-2-124M on one GPU, a fresh process)

    PYTHONPATH=bench python bench/probes/step0_probe.py [--top 35]

Builds the model, runs 20 bare steps, makes a Recorder, then runs the recorder's first steps under cProfile
(host time, on the training thread: a function waiting for the device or the CUDA driver shows as its own time)
and prints the functions by cumulative and by own time, beside each step's wall time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time

import torch
from recorder_overhead import build, make_batch

import reprokit

from gpt import GPT2, train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--steps", type=int, default=3, help="recorder steps profiled (step 0 first)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = {**GPT2, "device": "cuda"}
    state = build(cfg)
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [make_batch(cfg, g) for _ in range(8)]
    for i in range(20):
        train_step(state, batches[i % 8]).item()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp(), snapshot_every=100)
    torch.cuda.synchronize()
    print(f"making the Recorder: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    prof = cProfile.Profile()
    for i in range(args.steps):
        t0 = time.perf_counter()
        prof.enable()
        rec.step(batches[i % 8]).item()
        prof.disable()
        print(f"recorder step {i}: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    for i in range(3):
        t0 = time.perf_counter()
        train_step(state, batches[i % 8]).item()
        print(f"bare step: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue())
    rec.close()


if __name__ == "__main__":
    main()
