"""Shrinker benchmark: replays used and wall time for the quality-test cases, on this machine.

    python bench/shrink_bench.py          # all cases
    python bench/shrink_bench.py --quick  # smaller cases (a smoke run for the test suite)
    python bench/shrink_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "projects"))

import rk_lm  # noqa: E402
import rk_mlp  # noqa: E402
import rk_pair  # noqa: E402

import reprokit  # noqa: E402
from reprokit.shrink import shrink  # noqa: E402


def record(mod, cfg, batches, out, **kw):
    rec = reprokit.Recorder(mod.build(cfg), mod.train_step, build=mod.build, config=cfg, out_dir=out, **kw)
    for b in batches:
        try:
            rec.step(b)
        except Exception:  # noqa: BLE001 - any failure is what we want to shrink
            return rec.bundles[-1]
    raise SystemExit("case did not fail")


def cases(quick: bool):
    rows = 64 if quick else 512
    seq = 64 if quick else 256
    yield (f"one poisoned row of {rows}", rk_mlp, {"batch_size": rows, "optimizer": "sgd"},
           lambda c: rk_mlp.batches(c, 6, poison_step=4), {"snapshot_every": 100}, ["rows"])
    yield (f"two rows needed together, of {rows}", rk_pair, {}, lambda c: rk_pair.batches(rows, 5, 3, (11, rows - 14)),
           {}, ["steps", "rows"])
    cfg = {"vocab": 40, "max_len": seq, "nan_token": 13}
    yield (f"one NaN token in a {seq}-token sequence, 4 rows, 2-step window", rk_lm, cfg,
           lambda c: rk_lm.batches(c, 6, seq=seq, bs=4, bad=(4, 2, seq * 2 // 3)), {"snapshot_every": 3}, None)
    cfg = {"vocab": 30, "max_len": 16, "pos_table": True}
    yield ("sequence of 60 past a 16-entry position table", rk_lm, cfg,
           lambda c: rk_lm.batches(c, 10, long_step=7, long_len=60), {"snapshot_every": 5}, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, mod, cfg, batches, kw, passes) in enumerate(cases(args.quick)):
            bundle = record(mod, cfg, batches(cfg), Path(tmp) / f"r{i}", **kw)
            t0 = time.perf_counter()
            r = shrink(bundle, Path(tmp) / f"s{i}", passes=passes or ("steps", "rows", "sequence", "tokens"))
            rows.append({"case": name, "replays": r.replays, "seconds": round(time.perf_counter() - t0, 3),
                         "before": r.before, "after": r.after})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"reprokit shrink benchmark - {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'case':<58}{'replays':>8}{'seconds':>9}  before -> after (steps/rows/seq/tokens)")
    for r in rows:
        print(f"{r['case']:<58}{r['replays']:>8}{r['seconds']:>9.2f}  {_dims(r['before'])} -> {_dims(r['after'])}")


def _dims(d: dict) -> str:
    return "/".join(str(d[k]) for k in ("steps", "rows", "seq", "tokens"))


if __name__ == "__main__":
    main()
