"""Which host time lands on the critical path of the bench step (GPT-2-124M, CUDA)?

    PYTHONPATH=bench python bench/probes/host_sensitivity.py [--rounds 40] [--delay-ms 1.0] [--json]

Adds a busy wait of ``--delay-ms`` to the bare step at one place at a time: before
the step function (where the recorder records the batch and RNG), in an optimizer
step pre-hook (where it takes the grad norm), and after the step function returns
but before the loss is read (where it queues batch copies). A place where the wait
costs ~0 is hidden behind the GPU; one where it costs the whole wait is on the
critical path. Also prints how far ahead of the GPU the host is when the step
function returns (the bare loop's wait inside ``loss.item()``). Same protocol as
recorder_overhead.py: 10-step blocks, order rotated every round, 95% intervals over
per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time

import torch
from recorder_overhead import build, cuda_bench_config, make_batch, train_step

import reprokit


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--delay-ms", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = cuda_bench_config()
    state = build(cfg)
    g = torch.Generator(device="cuda").manual_seed(1)
    delay = args.delay_ms / 1e3
    recs = {name: reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp(), **kw)
            for name, kw in (("recorder", {}), ("recorder-no-grad-check", {"check_grads": False}))}
    for r in recs.values():
        r.detach()
    ahead: list[float] = []

    def run_block(name: str, n: int) -> list[float]:
        rec = recs.get(name)
        hook = None
        if rec:
            rec.attach()
        if name == "wait-in-optimizer-hook":
            hook = state.optimizer.register_step_pre_hook(lambda *_: busy(delay))
        times = []
        for _ in range(n):
            batch = make_batch(cfg, g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if name == "wait-before-step":
                busy(delay)
            if rec:
                loss = rec.step(batch)
            else:
                loss = train_step(state, batch)
                if name == "wait-after-step":
                    busy(delay)
            t1 = time.perf_counter()
            loss.item()
            t2 = time.perf_counter()
            times.append(t2 - t0)
            if name == "bare":
                ahead.append(t2 - t1)
        if rec:
            rec.detach()
        if hook:
            hook.remove()
        return times

    variants = ["bare", "wait-before-step", "wait-in-optimizer-hook", "wait-after-step", "recorder",
                "recorder-no-grad-check", "bare (A/A)"]
    for v in variants:
        run_block("bare" if v == "bare (A/A)" else v, 105)  # warm: kernels, pinned slots, one snapshot
    ahead.clear()
    blocks: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args.rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            blocks[v].append(statistics.mean(run_block("bare" if v == "bare (A/A)" else v, args.block)))
    bare = statistics.mean(blocks["bare"])
    table = {}
    for v, per_round in blocks.items():
        r = [m / b for m, b in zip(per_round, blocks["bare"])]
        half = 1.96 * statistics.stdev(r) / math.sqrt(len(r))
        table[v] = {"mean_ms": statistics.mean(per_round) * 1e3, "ratio": statistics.mean(r),
                    "ratio_ci95": [statistics.mean(r) - half, statistics.mean(r) + half],
                    "extra_ms": (statistics.mean(per_round) - bare) * 1e3}
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "delay_ms": args.delay_ms,
              "variants": table, "bare_host_ahead_ms_median": statistics.median(ahead) * 1e3}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"device {report['device']}, torch {report['torch']}; busy wait {args.delay_ms} ms")
    for v, r in table.items():
        print(f"{v:<26}{r['mean_ms']:>9.2f} ms {r['ratio']:>7.3f}x  [{r['ratio_ci95'][0]:.3f}, "
              f"{r['ratio_ci95'][1]:.3f}]  {r['extra_ms']:+.3f} ms")
    print(f"bare: the host returns from the step function {report['bare_host_ahead_ms_median']:.2f} ms "
          "(median) before the GPU finishes it")


if __name__ == "__main__":
    main()
