"""Split the Recorder's per-step start cost (RNG capture vs batch recording) on the bench model (CUDA)."""

import tempfile
import time

import torch
from recorder_overhead import build, make_batch, train_step

import reprokit
from reprokit import pytree
from reprokit.state import capture_rng

cfg = {"layers": 12, "d": 768, "heads": 12, "vocab": 50304, "ctx": 1024, "batch": 8, "device": "cuda"}
state = build(cfg)
g = torch.Generator(device="cuda").manual_seed(1)
rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp())
for _ in range(205):  # two full windows: every pinned slot exists
    rec.step(make_batch(cfg, g)).item()
acc = {"rng": 0.0, "encode": 0.0, "record_step_start": 0.0, "step_total": 0.0, "make_batch": 0.0}
n = 90
for _ in range(n):
    t0 = time.perf_counter()
    b = make_batch(cfg, g)
    t1 = time.perf_counter()
    capture_rng()
    t2 = time.perf_counter()
    rec._slot, rec._leaf = 99, 0
    pytree.encode(b, "batch", copy=rec._batch_copy)
    t3 = time.perf_counter()
    rec._record_step_start(rec.step_index, b)
    t4 = time.perf_counter()
    rec.step_index -= 0
    loss = rec.step(b)
    loss.item()
    t5 = time.perf_counter()
    for k, v in (("make_batch", t1 - t0), ("rng", t2 - t1), ("encode", t3 - t2), ("record_step_start", t4 - t3),
                 ("step_total", t5 - t4)):
        acc[k] += v
for k, v in acc.items():
    print(f"{k:<20} {v / n * 1e3:8.3f} ms")
