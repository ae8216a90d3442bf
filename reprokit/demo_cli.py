"""The story ``reprokit demo`` tells: train, fail, record, replay."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from reprokit import demo
from reprokit.errors import ReprokitError, TrainingFailure
from reprokit.record import Recorder
from reprokit.replay import replay
from reprokit.shrink import shrink


def run_demo(out: Path, say: Callable[[str], None] = print, config: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = {**demo.DEFAULT_CONFIG, **(config or {})}
    say(f"1. Training a small MLP on {cfg['samples']} samples, batch {cfg['batch_size']} "
        "(one sample is poisoned)...")
    state = demo.build(cfg)
    rec = Recorder(state, demo.train_step, build=demo.build, config=cfg, out_dir=out)
    failure = None
    for batch in demo.batches(cfg):
        try:
            rec.step(batch)
        except TrainingFailure as e:
            failure = e
            break
    if failure is None or failure.bundle is None:
        raise ReprokitError("the demo run did not fail as designed; please report this as a bug")
    f = failure.failure
    say(f"2. Training died: {f.describe()}.")
    say(f"   The recorder wrote {failure.bundle}")
    say(f"   (the snapshot at step {f.step - f.step % rec.snapshot_every} plus every batch since).")
    say("3. Replaying the bundle 3 times from scratch...")
    report = replay(failure.bundle, times=3)
    fid = report.fidelity
    exact = "losses bit-exact" if fid["bit_exact"] else f"losses within {fid['max_abs_diff']:.3g}"
    say(f"   reproduced {report.failed_runs}/{len(report.runs)}, {report.verdict}, {exact} "
        f"({fid['steps_compared']} steps compared).")
    say("4. Shrinking it to the smallest case that fails the same way...")
    small = shrink(failure.bundle, out / "shrunk")
    a, b = small.after, small.before
    say(f"   {b['steps']} steps x {b['rows']} rows -> {a['steps']} step x {a['rows']} row in {small.replays} replays: "
        f"row {small.kept_rows} of the batch, dataset index {small.dataset_indices}, "
        f"{a['tokens']} non-zero value(s) left.")
    say(f"   wrote {small.output}")
    say(f"Next: reprokit inspect {small.output}")
    return {"bundle": str(failure.bundle), "failure": f.to_json(), "replay": report.to_json(),
            "shrink": small.to_json()}
