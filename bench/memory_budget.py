"""Host memory and step time of the recorder on a large-batch CPU run, side by side in one process.

    python bench/memory_budget.py            # 16 MB batches, an MLP on the CPU, snapshot_every=10**9
    python bench/memory_budget.py --quick    # smoke run for the test suite (timings meaningless)
    python bench/memory_budget.py --json

Questions it answers:
- What does copying every CPU batch at step start cost next to the step? (the recorder
  copies batches so that a loader refilling its buffers cannot rewrite a recording)
- With ``snapshot_every=10**9`` and a budget, does the recorder's memory stay under it,
  and what does the budget cost in step time (early snapshots)?

Variants run in interleaved blocks (the order rotates each round): bare loop; recorder
with the defaults (snapshot every 100 steps, warmed for 101 steps so its buffers are
reused, as in a long run); recorder with the default budget and no snapshots after the
first (its window only grows: every step allocates a fresh buffer); recorder with a
budget of ``--budget-mb`` and no scheduled snapshots (early snapshots keep it inside). Reported per variant:
mean step time and its ratio to bare, the recorder's peak pinned + pageable bytes
(``rec.stats()``), the peak of what its buffers really hold, early snapshots, and the
process's peak RSS growth. Also: the time of one batch ``memcpy`` into a reused buffer
and into a fresh one, against the bare step.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(0)
    d, h = config["d"], config["hidden"]
    model = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, 1))
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))


def train_step(state, batch):
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def loader(cfg, steps):
    """One batch buffer, refilled in place every step (as many real loaders do)."""
    g = torch.Generator().manual_seed(1)
    buf = {"x": torch.empty(cfg["batch"], cfg["d"]), "y": torch.empty(cfg["batch"])}
    for _ in range(steps):
        buf["x"].normal_(generator=g)
        buf["y"].copy_(buf["x"][:, 0])
        yield buf


def held(rec) -> int:
    engine = rec._engine
    ts = list(rec._pool.slots.values()) + list(engine._buffers.values())
    return sum(t.untyped_storage().nbytes() for t in ts) + rec._ring_other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--budget-mb", type=float, default=None, help="the small budget (default 256 MB, quick 4 MB)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from io_bench import _commit  # bench/ is the script's folder
    commit = _commit()
    cfg = {"d": 256 if args.quick else 4096, "hidden": 16 if args.quick else 256, "batch": 256 if args.quick else 1024}
    rounds = args.rounds or (3 if args.quick else 12)
    block = args.block or (5 if args.quick else 10)
    budget = int((args.budget_mb or (2 if args.quick else 256)) * 2**20)
    batch_bytes = cfg["batch"] * (cfg["d"] + 1) * 4
    state = build(cfg)
    out = tempfile.mkdtemp(prefix="reprokit-bench-")
    recs = {"recorder (defaults: snapshot_every=100)": reprokit.Recorder(state, train_step, build=build, config=cfg,
                                                                         out_dir=out),
            "recorder (default budget, never snapshots)": reprokit.Recorder(state, train_step, build=build,
                                                                            config=cfg, out_dir=out,
                                                                            snapshot_every=10**9),
            f"recorder (budget {budget / 2**20:.0f} MiB)": reprokit.Recorder(
                state, train_step, build=build, config=cfg, out_dir=out, snapshot_every=10**9,
                host_memory_budget=budget)}
    warm = 3 if args.quick else 101  # the defaults recorder reuses its buffers from its second window on
    for r in recs.values():
        r.detach()
    batches = loader(cfg, 10**9)
    first = recs["recorder (defaults: snapshot_every=100)"]
    first.attach()
    for _ in range(warm):
        first.step(next(batches)).item()
    first.detach()
    variants = ["bare", *recs]
    times: dict[str, list[float]] = {v: [] for v in variants}
    peaks = {v: 0 for v in recs}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for i in range(rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            rec = recs.get(v)
            if rec:
                rec.attach()
            for _ in range(block):
                b = next(batches)
                t0 = time.perf_counter()
                (rec.step(b) if rec else train_step(state, b)).item()
                times[v].append(time.perf_counter() - t0)
                if rec:
                    peaks[v] = max(peaks[v], held(rec))
            if rec:
                rec.detach()
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    x = next(batches)["x"]
    reused = torch.empty_like(x)
    copies = {"reused": [], "fresh": []}
    for _ in range(5):
        t0 = time.perf_counter()
        reused.copy_(x)
        t1 = time.perf_counter()
        x.clone()
        copies["reused"].append(t1 - t0)
        copies["fresh"].append(time.perf_counter() - t1)
    bare = statistics.mean(times["bare"])
    report = {"commit": commit, "device": "cpu", "torch": torch.__version__, "config": cfg, "batch_bytes": batch_bytes,
              "steps_per_variant": rounds * block,
              "bare_step_ms": bare * 1e3,
              "batch_copy_ms": {k: statistics.median(v) * 1e3 for k, v in copies.items()},
              "batch_copy_over_step": statistics.median(copies["reused"]) / bare,
              "process_peak_rss_growth_bytes": rss_growth, "variants": {}}
    for v in recs:
        s = recs[v].stats()
        report["variants"][v] = {"mean_ms": statistics.mean(times[v]) * 1e3, "ratio": statistics.mean(times[v]) / bare,
                                 "budget_bytes": s["budget_bytes"], "peak_accounted_bytes": s["peak_pinned_bytes"]
                                 + s["peak_pageable_bytes"], "peak_buffers_bytes": peaks[v],
                                 "early_snapshots": s["early_snapshots"], "window_steps": s["window_steps"]}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"cpu, torch {torch.__version__}; batch {batch_bytes / 2**20:.1f} MiB, bare step {bare * 1e3:.2f} ms, "
          f"{rounds * block} steps per variant, snapshot_every=10**9")
    print(f"batch memcpy: {report['batch_copy_ms']['reused']:.2f} ms into a reused buffer "
          f"({report['batch_copy_over_step']:.3f} of a step), {report['batch_copy_ms']['fresh']:.2f} ms into a fresh one")
    print(f"{'variant':<44}{'mean ms':>9}{'x bare':>8}{'budget MiB':>12}{'peak MiB (stats)':>18}"
          f"{'peak MiB (buffers)':>20}{'early snaps':>12}{'window':>8}")
    for v, r in report["variants"].items():
        print(f"{v:<44}{r['mean_ms']:>9.2f}{r['ratio']:>8.3f}{r['budget_bytes'] / 2**20:>12.0f}"
              f"{r['peak_accounted_bytes'] / 2**20:>18.1f}{r['peak_buffers_bytes'] / 2**20:>20.1f}"
              f"{r['early_snapshots']:>12}{r['window_steps']:>8}")
    print(f"process peak RSS grew by {rss_growth / 2**20:.0f} MiB over the run")


if __name__ == "__main__":
    main()
