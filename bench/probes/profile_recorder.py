"""Where the recorder's host time goes, per step, on the GPT-2-124M bench model (cProfile; CUDA)."""

import cProfile
import pstats
import tempfile
import time

import torch
from recorder_overhead import build, make_batch, train_step

import reprokit

cfg = {"layers": 12, "d": 768, "heads": 12, "vocab": 50304, "ctx": 1024, "batch": 8, "device": "cuda"}
state = build(cfg)
g = torch.Generator(device="cuda").manual_seed(1)
rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp())
for _ in range(5):
    rec.step(make_batch(cfg, g)).item()
t0 = time.perf_counter()
prof = cProfile.Profile()
prof.enable()
for _ in range(100):
    rec.step(make_batch(cfg, g)).item()
prof.disable()
print(f"{(time.perf_counter() - t0) * 10:.2f} ms/step under the profiler")
st = pstats.Stats(prof)
st.sort_stats("tottime").print_stats(12)
st.sort_stats("cumulative").print_stats("reprokit", 15)
st.print_callees("capture_rng")
st.print_callees("_record_step_start")
