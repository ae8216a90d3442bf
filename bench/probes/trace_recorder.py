"""GPU-time attribution of the Recorder on the bench model, from torch.profiler (CUDA).

    PYTHONPATH=bench python bench/probes/trace_recorder.py [--steps 100]

Profiles the same number of bare and recorded steps (the recorded ones include one
snapshot) and prints device time per step for each, the kernels and copies that only
the recorder adds (per step), and the host time spent in the recorder's own calls.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from recorder_overhead import build, make_batch, train_step
from torch.profiler import ProfilerActivity, profile

import reprokit


def device_us(evt) -> float:
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    cfg = {"layers": 12, "d": 768, "heads": 12, "vocab": 50304, "ctx": 1024, "batch": 8, "device": "cuda"}
    torch.backends.cuda.matmul.allow_tf32 = True
    state = build(cfg)
    g = torch.Generator(device="cuda").manual_seed(1)
    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp(),
                            snapshot_every=args.steps)
    for _ in range(args.steps + 2):  # warm: pinned slots and snapshot buffers exist
        rec.step(make_batch(cfg, g)).item()
    rec.detach()
    batches = [make_batch(cfg, g) for _ in range(args.steps)]
    for _ in range(3):
        train_step(state, batches[0]).item()
    torch.cuda.synchronize()

    def run(recorded: bool):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for b in batches:
                (rec.step(b) if recorded else train_step(state, b)).item()
            torch.cuda.synchronize()
        return {e.key: e for e in prof.key_averages()}

    bare = run(False)
    rec.attach()
    rec.step_index = rec._snapshot.step + args.steps - 1 if rec._snapshot else 0  # one snapshot in the block
    recd = run(True)
    n = args.steps
    tot_b = sum(device_us(e) for e in bare.values()) / n
    tot_r = sum(device_us(e) for e in recd.values()) / n
    print(f"device time per step: bare {tot_b / 1e3:.3f} ms, recorded {tot_r / 1e3:.3f} ms "
          f"(+{(tot_r - tot_b):.1f} us, {100 * (tot_r - tot_b) / tot_b:+.2f}%)")
    diffs = []
    for key in set(bare) | set(recd):
        d = (device_us(recd[key]) if key in recd else 0.0) - (device_us(bare[key]) if key in bare else 0.0)
        diffs.append((d / n, key))
    print("device time the recorder adds, per step (us):")
    for d, key in sorted(diffs, reverse=True)[:12]:
        print(f"  {d:9.1f}  {key[:100]}")
    print("host (CPU) time the recorder adds, per step (us):")
    host = []
    for key in set(bare) | set(recd):
        d = (recd[key].self_cpu_time_total if key in recd else 0.0) - (bare[key].self_cpu_time_total if key in bare else 0.0)
        host.append((d / n, key))
    for d, key in sorted(host, reverse=True)[:12]:
        print(f"  {d:9.1f}  {key[:100]}")

if __name__ == "__main__":
    main()
