"""The failures that kill the GPU, on a GPU: a device-side assert gives a bundle written from host memory, replay
names the culprit and confirms the device error in a child, and shrink ends at the one row.

A device-side assert poisons the CUDA context of the process it happens in, so every recording here runs in a
process of its own (``python -c "import rk_vocab; rk_vocab.main(...)"``), and so do replay and shrink (``python -m
reprokit ...``, as a user runs them); the test process only reads what they leave in ``out_dir`` and print. Each
recording prints the time from the error to the bundle on disk (``-rP`` shows it, under ``-n`` too).

Run on the GPU machine: ``python -m pytest -rP -m cuda tests/integration/test_device_error_on_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reprokit import bundle as B

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")]

TESTS = Path(__file__).resolve().parents[1]
PROJECTS = TESTS / "projects"
ROOT = TESTS.parent
BAD_STEP, BAD_ROW, BAD_POS = 6, 5, 3
DATASET_INDEX = 100 + BAD_STEP * 8 + BAD_ROW
TIMEOUT = 900


def _env() -> dict[str, str]:
    """The children see one GPU (the first visible one): on a host with more, the Hugging Face Trainer would wrap its
    model in DataParallel, which is another failure path (``Caught AcceleratorError in replica 0``), not this file's."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    return {**os.environ, "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": first,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(PROJECTS), os.environ.get("PYTHONPATH", "")])}


def _run(args: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT, env=_env(), cwd=str(ROOT))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} ran past {TIMEOUT} s; its output so far:\n{e.stdout}\n{e.stderr}")


def record(tmp: Path, module: str, **kw) -> dict:
    """Record ``module.main(out_dir, **kw)`` in a process of its own; its JSON line, the bundle checked to exist."""
    call = f"import {module} as m; m.main({str(tmp / 'repros')!r}, " + ", ".join(f"{k}={v!r}" for k, v in kw.items())
    run = _run([sys.executable, "-c", call + ")"], f"recording {module} {kw}")
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the recording printed no result (exit {run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}"
    out = json.loads(lines[-1])
    assert out["bundle"], f"no bundle was written: {out}\n{run.stderr[-4000:]}"
    assert "device-side assert triggered" in out["error"], out
    print(f"\n{module} {kw}: {out['error']}; bundle on disk {out.get('write_seconds')} s after the error reached the "
          f"recorder; exit {run.returncode}")
    assert B.verify(Path(out["bundle"])) == [], B.verify(Path(out["bundle"]))
    return out


def reprokit_json(*args: str) -> tuple[int, dict]:
    run = _run([sys.executable, "-m", "reprokit", *args, "--json"], f"reprokit {' '.join(args)}")
    try:
        return run.returncode, json.loads(run.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"reprokit {' '.join(args)} exited {run.returncode} without JSON:\n{run.stdout}\n{run.stderr}")


def check_replay(bundle: str, message: str) -> dict:
    code, d = reprokit_json("replay", bundle)
    assert code == 1, f"replay exited {code}, not 1 (reproduced): {json.dumps(d, indent=1)[:4000]}"
    t = d["triage"]
    assert t["reproduced_as"] == "device_error" and t["gpu"]["checked"], t
    assert t["cpu"]["cpu_face"], t["cpu"]
    assert t["culprit"] and t["culprit"]["message"] == message, t["culprit"]
    return d


def check_shrink(bundle: str, tmp: Path, *extra: str) -> dict:
    code, d = reprokit_json("shrink", bundle, "-o", str(tmp / "small"), *extra)
    assert code == 0, d
    assert d["rows_after"] == 1, d
    return d


def test_an_out_of_range_id_on_the_gpu_gives_a_bundle_a_named_culprit_and_a_one_row_shrink(tmp_path):
    out = record(tmp_path, "rk_vocab", device="cuda", steps=12, bad_step=BAD_STEP, snapshot_every=4)
    b = B.open_bundle(Path(out["bundle"]))
    f = b.failure
    assert f.kind == "device_error" and f.step == BAD_STEP, f
    assert f.detail["device_error"]["surfaced_at_step"] >= BAD_STEP
    assert b.steps[-1] == BAD_STEP and b.step(BAD_STEP)[0]["input_ids"][BAD_ROW, BAD_POS] == 64
    check_replay(out["bundle"], f"step {BAD_STEP}, input_ids row {BAD_ROW} (dataset index {DATASET_INDEX}), position "
                                f"{BAD_POS}: id 64 >= num_embeddings 64 of wte")
    d = check_shrink(out["bundle"], tmp_path)  # on the GPU: each candidate in a child process
    assert d["dataset_indices"] == [DATASET_INDEX] and d["isolation"] is not None, d


def test_a_cross_entropy_target_past_the_classes_on_the_gpu(tmp_path):
    out = record(tmp_path, "rk_vocab", device="cuda", task="cls", steps=12, bad_step=BAD_STEP, snapshot_every=4)
    assert B.open_bundle(Path(out["bundle"])).failure.step == BAD_STEP
    check_replay(out["bundle"], f"step {BAD_STEP}, labels row {BAD_ROW} (dataset index {DATASET_INDEX}): target 10 >= "
                                "10 classes of cross_entropy (logits 8x10)")
    d = check_shrink(out["bundle"], tmp_path, "--device", "cpu", "--passes", "steps,rows")
    assert d["dataset_indices"] == [DATASET_INDEX] and d["isolation"] is None, d  # the CPU needs no children


def test_a_fault_in_the_step_that_takes_a_snapshot_gives_a_bundle_from_a_snapshot_whose_copy_landed(tmp_path):
    """512 MiB of state: its copy, on a side stream, is still in flight when the faulting embedding runs at step 8's
    start. The bundle starts from step 8's snapshot only where its host marker says the copy landed (seen on an
    H200: the copy finished although the training stream had died), else from step 4's, with its batches."""
    out = record(tmp_path, "rk_vocab", device="cuda", steps=12, bad_step=8, snapshot_every=4, pad_mb=512)
    b = B.open_bundle(Path(out["bundle"]))
    which = b.failure.detail["device_error"]["snapshot"]
    assert b.failure.step == 8 and (b.steps, which.split()[0]) in (([4, 5, 6, 7, 8], "previous"), ([8], "current")), \
        (b.steps, b.failure.detail)
    print(f"the bundle starts from the {which} snapshot")
    check_replay(out["bundle"], f"step 8, input_ids row {BAD_ROW} (dataset index {100 + 8 * 8 + BAD_ROW}), position "
                                f"{BAD_POS}: id 64 >= num_embeddings 64 of wte")


def test_a_hugging_face_trainer_with_an_id_equal_to_the_vocabulary_size(tmp_path):
    pytest.importorskip("transformers")
    out = record(tmp_path, "rk_hf_vocab", device="cuda")
    b = B.open_bundle(Path(out["bundle"]))
    assert b.failure.kind == "device_error", b.failure
    d = check_replay(out["bundle"], _hf_message(b))
    assert d["failure"]["step"] == b.failure.step
    s = check_shrink(out["bundle"], tmp_path, "--passes", "steps,micro,rows")
    assert s["dataset_indices"] == [21], s


def _hf_message(b: B.Bundle) -> str:
    """The culprit line of rk_hf_vocab's bundle: sample 21, wherever the Trainer's shuffle put it in the update."""
    batch = b.step(b.failure.step)[0]
    for m, micro in enumerate(batch["micro"]):
        rows = [r for r, i in enumerate(micro["index"].tolist()) if i == 21]
        if rows:
            return (f"step {b.failure.step}, micro {m}, input_ids row {rows[0]} (dataset index 21), position 7: id "
                    "1000 >= num_embeddings 1000 of transformer.wte")
    raise AssertionError(f"sample 21 is not in the failing update: {batch}")


def test_markers_land_in_stream_order_and_the_last_snapshot_stays_intact_while_the_next_one_copies(tmp_path):
    """In this process (nothing faults): what the device-error path relies on."""
    sys.path.insert(0, str(PROJECTS))
    try:
        import rk_vocab

        import reprokit
        from reprokit.device_error import HostMarker

        mark = HostMarker(torch.device("cuda"))
        assert mark.last() is None
        torch.cuda._sleep(50_000_000)  # the mark waits behind ~30 ms of GPU work: not landed yet
        mark.mark(70000)  # past the table's period: read back modulo it
        assert mark.last() is None
        torch.cuda.synchronize()
        assert mark.last() == 70000 and mark.landed(69999) and not mark.landed(70001)

        config = {"device": "cuda"}
        state = rk_vocab.build(config)
        rec = reprokit.Recorder(state, rk_vocab.train_step, build=rk_vocab.build, config=config, out_dir=tmp_path,
                                snapshot_every=2)
        batches = rk_vocab.batches(5, device="cuda")
        rec.step(next(batches))
        rec.step(next(batches))
        first = rec._snapshot
        kept = {k: t.clone() for k, t in first.tensors.items()}
        rec.step(next(batches))  # step 2 takes the next snapshot into the other set of buffers
        assert rec._snapshot is not first and rec._engine.previous_kept
        assert rec._kept is not None and rec._kept.snapshot is first and [r.step for r in rec._kept.ring] == [0, 1]
        assert all(rec._snapshot.tensors[k].data_ptr() != t.data_ptr() for k, t in first.tensors.items()
                   if t.is_pinned())
        torch.cuda.synchronize()
        assert all(torch.equal(first.tensors[k], t) for k, t in kept.items()), "the last snapshot was written"
        assert rec._engine.complete(rec._snapshot.serial) and rec._marks[torch.device("cuda", 0)].last() == 2
        rec.step(next(batches))  # step 3 reads that step 2's snapshot landed: the previous window is let go
        assert rec._kept is None
        rec.close()
    finally:
        sys.path.remove(str(PROJECTS))


def test_a_fault_in_the_first_step_is_a_device_error_whichever_call_meets_it_first(tmp_path):
    """At step 0 the first matmul after the bad lookup may be the one that creates cuBLAS's handle, on the context
    the assert has just killed: the step then raises ``CUBLAS_STATUS_INTERNAL_ERROR``, not the assert. The bundle's
    failure is the device error either way (the first exception kept as ``surfaced_as``), and replays as one."""
    call = (f"import rk_vocab as m; m.main({str(tmp_path / 'repros')!r}, device='cuda', steps=4, bad_step=0, "
            "snapshot_every=4)")
    run = _run([sys.executable, "-c", call], "recording a fault at step 0")
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines and json.loads(lines[-1])["bundle"], f"no bundle (exit {run.returncode}):\n{run.stderr[-4000:]}"
    out = json.loads(lines[-1])
    f = B.open_bundle(Path(out["bundle"])).failure
    print(f"\nthe step raised {out['error']}; failure {f.kind} {f.exc_type}: {f.message}; detail {f.detail}")
    assert f.kind == "device_error" and f.step == 0 and "device-side assert" in f.message, f
    if "device-side assert" not in out["error"]:
        assert f.detail["device_error"]["surfaced_as"].endswith(out["error"].split(": ", 1)[1]), f.detail
    check_replay(out["bundle"], f"step 0, input_ids row {BAD_ROW} (dataset index {100 + BAD_ROW}), position "
                                f"{BAD_POS}: id 64 >= num_embeddings 64 of wte")
