"""Host time the Recorder spends on the critical path of each step, measured inside the training loop (CUDA).

    PYTHONPATH=bench python bench/probes/step_start_probe.py [--steps 300]

bench/probes/host_sensitivity.py shows that on the bench model only host time before the
step function (the GPU is idle: the previous step's loss read synchronised) and
after the loss read lands on the step time; host time inside the step is hidden
behind the GPU. This prints, per step, the microseconds of each piece of the
recorder in those two places, timed inside a real loop: right after a training
step the same code runs many times slower than in a micro-benchmark (cold caches,
the C allocator tidying what the step freed), so micro-benchmarks mislead here.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import numpy as np
import torch
from recorder_overhead import build, make_batch, train_step

import reprokit
import reprokit.record as R


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prefault", action="store_true",
                    help="experiment: allocate 8 KB (and free it) right after the step function returns")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = {"layers": 12, "d": 768, "heads": 12, "vocab": 50304, "ctx": 1024, "batch": 8, "device": device}
    if device == "cpu":
        cfg.update(layers=2, d=64, heads=4, vocab=256, ctx=32, batch=2)
    state = build(cfg)
    g = torch.Generator(device=device).manual_seed(1)
    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp())
    spent: dict[str, list[float]] = {}
    marks: dict[str, float] = {}

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                marks[label] = t1 = time.perf_counter()
                spent.setdefault(label, []).append(t1 - t0)
        setattr(owner, name, timed)

    if args.prefault:
        after = rec._after_step
        rec._after_step = lambda: (after(), bytearray(8192))[0]  # type: ignore[method-assign]
    wrap(rec, "_record_step_start", "record_step_start (all)")
    wrap(rec, "_encode_batch", "  batch (encode + slots)")
    wrap(R, "_batch_bytes", "  batch bytes (budget)")
    wrap(rec, "_fits", "  budget check")
    wrap(R, "capture_rng", "  capture_rng (public reads)")
    wrap(random, "getstate", "    random.getstate")
    wrap(np.random, "get_state", "    np.random.get_state")
    wrap(torch, "get_rng_state", "    torch.get_rng_state")
    wrap(rec.monitor, "_read", "_read (waits for the GPU)")
    for _ in range(105):  # every pinned slot and the snapshot buffers exist
        rec.step(make_batch(cfg, g)).item()
    spent.clear()
    tails = []
    for _ in range(args.steps):
        batch = make_batch(cfg, g)
        if device == "cuda":
            torch.cuda.synchronize()
        loss = rec.step(batch)
        tails.append(time.perf_counter() - marks["_read (waits for the GPU)"])
        loss.item()
    spent["after the read, until step() returns"] = tails
    print(f"{cfg['device']}: {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}, torch {torch.__version__}"
          f", {args.steps} steps{', prefault' if args.prefault else ''}; host microseconds per step (median, mean)")
    for label, xs in spent.items():
        print(f"  {label:<40}{statistics.median(xs) * 1e6:9.1f}{statistics.mean(xs) * 1e6:9.1f}")


if __name__ == "__main__":
    main()
