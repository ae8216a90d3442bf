"""What does the step that takes a snapshot cost, and where? (GPT-2-124M, CUDA)

    PYTHONPATH=bench python bench/probes/snapshot_step_probe.py [--snapshots 8] [--json]

Runs the default Recorder with a snapshot every ``--every`` steps and times every step
as recorder_overhead.py does (the training stream synchronised before each step, the
loss read after it). The snapshot step's extra time is its time minus the median of
the other steps; the step after it is reported too (the copy may spill into it). Host
time is split into the snapshot's start (``_take_snapshot``, before the step function:
all of it on the critical path) and the optimizer pre-hook that stops the copy thread
and stages what it had not issued. Each configuration of the copy thread (chunk size,
chunks in flight, Python's thread switch interval) runs in turn.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch
from recorder_overhead import build, cuda_bench_config, make_batch, timed, train_step

import reprokit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshots", type=int, default=8, help="snapshots timed per configuration")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = cuda_bench_config()
    state = build(cfg)
    g = torch.Generator(device="cuda").manual_seed(1)
    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp(),
                            snapshot_every=args.every)
    eng = rec._engine
    spent: dict[str, float] = {}
    timed(spent, rec, "_take_snapshot")
    timed(spent, eng, "_before_optimizer_step")
    # The hook was registered with the bound method: re-register it so the timed wrapper runs.
    eng.detach()
    eng.attach()

    def run(n: int) -> list[float]:
        times = []
        for _ in range(n):
            batch = make_batch(cfg, g)
            torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter()
            loss = rec.step(batch)
            loss.item()
            times.append(time.perf_counter() - t0)
        return times

    run(2 * args.every)  # warm: pinned buffers, kernels
    configs = {"default (32 MB x 4, no staging)": {}, "staged on device": {"stage_on_device": True},
               "64 MB x 2": {"chunk_bytes": 64 << 20, "chunks_in_flight": 2},
               "16 MB x 2": {"chunk_bytes": 16 << 20, "chunks_in_flight": 2},
               "switch interval 0.5 ms": {"switch": 5e-4}}
    defaults = {"chunk_bytes": eng.chunk_bytes, "chunks_in_flight": eng.chunks_in_flight,
                "stage_on_device": eng.stage_on_device}
    out = {}
    for name, c in configs.items():
        for k, v in defaults.items():
            setattr(eng, k, c.get(k, v))
        old_switch = sys.getswitchinterval()
        sys.setswitchinterval(c.get("switch", old_switch))
        try:
            start = rec.step_index
            spent.clear()
            times = run(args.snapshots * args.every)
        finally:
            sys.setswitchinterval(old_switch)
        snaps = [i for i in range(len(times)) if (start + i - rec._snapshot.step) % args.every == 0]
        others = [t for i, t in enumerate(times) if i not in snaps and i - 1 not in snaps]
        base = statistics.median(others)
        out[name] = {"median_step_ms": base * 1e3,
                     "snapshot_step_extra_ms": [(times[i] - base) * 1e3 for i in snaps],
                     "next_step_extra_ms": [(times[i + 1] - base) * 1e3 for i in snaps if i + 1 < len(times)],
                     "take_host_ms": spent.get("_take_snapshot", 0) / len(snaps) * 1e3,
                     "prehook_host_ms": spent.get("_before_optimizer_step", 0) / len(snaps) * 1e3,
                     "staged_MB": eng.stats["staged_bytes"] / 1e6, "prepared": eng.stats["prepared"]}
    for k, v in defaults.items():
        setattr(eng, k, v)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "every": args.every,
              "configs": out}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['device']}, torch {report['torch']}, snapshot every {args.every} steps")
    for name, r in out.items():
        ex = r["snapshot_step_extra_ms"]
        print(f"{name:<34} step {r['median_step_ms']:.2f} ms; snapshot step +{statistics.mean(ex):.1f} ms "
              f"(min {min(ex):.1f}, max {max(ex):.1f}); next step +{statistics.mean(r['next_step_extra_ms']):.2f};"
              f" host: take {r['take_host_ms']:.2f} ms, pre-hook {r['prehook_host_ms']:.2f} ms; staged "
              f"{r['staged_MB']:.0f} MB")


if __name__ == "__main__":
    main()
