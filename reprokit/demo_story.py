"""The story ``reprokit demo`` tells: train, fail, record, replay, shrink, localise, pack, verify."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from reprokit import demo
from reprokit.archive import bundle_dir
from reprokit.bisect import bisect_layers
from reprokit.bundle import open_bundle
from reprokit.bundle import verify as verify_bundle
from reprokit.errors import ReprokitError, TrainingFailure
from reprokit.pack import pack
from reprokit.record import Recorder
from reprokit.replayer import replay
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
    if failure is not None and failure.bundle is None:
        raise ReprokitError(f"the demo run failed as designed ({failure.failure.describe()}), but the recorder could "
                            f"not write its bundle into {out} (its warning above says why); give --out a folder you "
                            "can write to, with room for a few MB")
    if failure is None or failure.bundle is None:
        raise ReprokitError("the demo run did not fail as designed; please report this as a bug")
    f = failure.failure
    say(f"2. Training died: {f.describe()}.")
    say(f"   The recorder wrote {failure.bundle}")
    say(f"   (the snapshot at step {open_bundle(failure.bundle).run['window']['start']} plus every batch since).")
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
    say("5. Localising: replaying the failing step with every module and op watched...")
    layers = bisect_layers(open_bundle(small.output))
    origin = layers.get("origin") or {}
    first = layers.get("first_nonfinite") or {}
    if first:
        how = ("its input was already non-finite: the data brought it in" if first["inputs_already_nonfinite"]
               else f"made by {first['op']}")
        say(f"   first module with a non-finite value: {first['module']} ({first['class']}), {first['phase']}; {how}.")
    else:
        say(f"   origin: {origin.get('summary', 'not found')}")
    say("6. Packing the shrunk bundle into one checksummed tarball...")
    packed = pack(small.output, out / "repro.tar.gz")
    say(f"   wrote {packed.output} ({packed.size / 1e3:.1f} kB), sha256 {packed.sha256[:16]}...")
    say("7. Verifying the tarball (its sha256, every member, every file) and replaying it...")
    with bundle_dir(packed.output) as folder:
        problems = verify_bundle(folder)
        again = replay(open_bundle(folder))
    if problems:
        raise ReprokitError(f"the demo's own tarball failed verification ({problems[0]}); please report this as a bug")
    said = "reproduces the failure" if again.reproduced else f"replays {again.verdict}"  # one run: not "deterministic"
    say(f"   ok: every file matches; the tarball {said} "
        f"({again.failed_runs}/{len(again.runs)} runs), {fidelity_word(again.fidelity)}.")
    say(f"Next: reprokit inspect {packed.output}, or send it: tar xzf {packed.output} && python {packed.folder}/repro.py")
    return {"bundle": str(failure.bundle), "failure": f.to_json(), "replay": report.to_json(),
            "shrink": small.to_json(), "layers": layers, "pack": packed.to_json(),
            "verify": {"problems": problems, "replay": again.to_json()}}


def fidelity_word(fid: dict[str, Any]) -> str:
    return "losses bit-exact" if fid["bit_exact"] else f"losses within {fid['max_abs_diff']:.3g}"
