"""Device-error bundles, end to end on the CPU: recorded, replayed (the CPU face reproduces, the culprit is named) and
shrunk to the one row.

The runs are real seeded loops of ``rk_vocab`` (an ``nn.Embedding`` of 64 rows; a sample holds the id 64) and
``rk_hf_vocab`` (a Hugging Face Trainer). On a machine without a GPU a device error is recorded as the GPU would
raise it: with ``RK_GPU_FACE=1`` the project's own step raises ``RuntimeError("CUDA error: device-side assert
triggered")`` where the CPU raises its IndexError. Replay runs without it, and meets the IndexError itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner
from rk_testing import PROJECTS, bundle_of, record, reseal

import reprokit
from reprokit import bundle as B
from reprokit.cli import main

BAD_STEP, BAD_ROW, BAD_POS = 6, 5, 3
DATASET_INDEX = 100 + BAD_STEP * 8 + BAD_ROW


def _record(tmp: Path, task: str = "lm", gpu_face: bool = True, steps: int = 9, snapshot_every: int = 4):
    sys.path.insert(0, str(PROJECTS))
    before = os.environ.get("RK_GPU_FACE")
    if gpu_face:
        os.environ["RK_GPU_FACE"] = "1"
    try:
        import rk_vocab

        return record(rk_vocab, {"task": task}, rk_vocab.batches(steps, BAD_STEP, BAD_ROW, BAD_POS, task=task),
                      tmp / "repros", snapshot_every=snapshot_every)
    finally:
        sys.path.remove(str(PROJECTS))
        if before is None:
            os.environ.pop("RK_GPU_FACE", None)


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    _, exc = _record(tmp_path_factory.mktemp("lm"))
    return bundle_of(exc)


@pytest.fixture(scope="module")
def cls(tmp_path_factory) -> Path:
    _, exc = _record(tmp_path_factory.mktemp("cls"), task="cls")
    return bundle_of(exc)


def replay(bundle: Path, *extra: str) -> tuple[int, dict]:
    r = CliRunner().invoke(main, ["replay", str(bundle), "--json", *extra])
    return r.exit_code, json.loads(r.output)


def test_an_id_equal_to_the_vocabulary_size_on_the_cpu_writes_a_bundle_of_the_index_error(tmp_path):
    rec, exc = _record(tmp_path, gpu_face=False)
    assert isinstance(exc, IndexError) and rec.step_index == BAD_STEP + 1
    b = B.open_bundle(bundle_of(exc))
    assert (b.failure.kind, b.failure.exc_type, b.failure.step) == ("exception", "IndexError", BAD_STEP)
    code, d = replay(b.path)
    assert code == 1 and d["triage"] is None  # an ordinary exception bundle: no triage


def test_a_device_error_is_written_from_host_memory_as_a_device_error_bundle(lm):
    assert B.verify(lm) == []
    b = B.open_bundle(lm)
    f = b.failure
    assert (f.kind, f.exc_type, f.step, f.message) == ("device_error", "RuntimeError", BAD_STEP,
                                                       "CUDA error: device-side assert triggered")
    assert f.detail["device_error"] == {"error": "CUDA error: device-side assert triggered", "surfaced_at_step": BAD_STEP,
                                        "rank": None, "snapshot": "current"}
    assert b.steps == [4, 5, 6] and b.step(BAD_STEP)[0]["input_ids"][BAD_ROW, BAD_POS] == 64


def test_replay_runs_on_the_cpu_first_and_names_the_row_position_value_and_table(lm):
    code, d = replay(lm)
    assert code == 1 and d["verdict"] == "deterministic", d
    assert d["failure"]["exception_type"] == "IndexError" and d["failure"]["step"] == BAD_STEP
    t = d["triage"]
    assert t["reproduced_as"] == "cpu_face" and t["cpu"]["cpu_face"] and t["cpu"]["verdict"] == "reproduced"
    assert t["gpu"] == {"checked": False, "why_not": "no CUDA device here"}
    c = t["culprit"]
    assert (c["op"], c["module"], c["leaf"], c["row"], c["position"], c["value"], c["bound"], c["dataset_index"]) == \
        ("embedding", "wte", "input_ids", BAD_ROW, BAD_POS, 64, 64, DATASET_INDEX)
    assert c["message"] == (f"step {BAD_STEP}, input_ids row {BAD_ROW} (dataset index {DATASET_INDEX}), position "
                            f"{BAD_POS}: id 64 >= num_embeddings 64 of wte")
    human = CliRunner().invoke(main, ["replay", str(lm), "--device", "cpu"])
    assert human.exit_code == 1
    assert f"  culprit: {c['message']}" in human.output
    assert "reproduced as: its CPU face (IndexError at step 6" in human.output
    assert "on the GPU: not checked (--device cpu was asked for)" in human.output


def test_a_cross_entropy_target_past_the_classes_is_named_against_the_logits(cls):
    assert B.open_bundle(cls).failure.kind == "device_error"
    code, d = replay(cls)
    assert code == 1 and d["triage"]["reproduced_as"] == "cpu_face"
    c = d["triage"]["culprit"]
    assert (c["op"], c["leaf"], c["row"], c["value"], c["bound"], c["logits_shape"]) == \
        ("cross_entropy", "labels", BAD_ROW, 10, 10, [8, 10])
    assert c["message"] == f"step {BAD_STEP}, labels row {BAD_ROW} (dataset index {DATASET_INDEX}): target 10 >= 10 " \
                           "classes of cross_entropy (logits 8x10)"


@pytest.mark.slow
@pytest.mark.parametrize("which, passes", [("lm", "steps,rows,sequence,tokens"), ("cls", "steps,rows")])
def test_shrink_of_a_device_error_ends_at_the_one_row_and_still_replays_as_a_device_error(lm, cls, tmp_path, which,
                                                                                          passes):
    source = {"lm": lm, "cls": cls}[which]
    r = CliRunner().invoke(main, ["shrink", str(source), "-o", str(tmp_path / "small"), "--passes", passes, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["rows_after"] == 1 and d["dataset_indices"] == [DATASET_INDEX] and d["isolation"] is None, d
    if which == "lm":
        assert d["tokens_after"] == 1 and d["seq_after"] == 1
    small = B.open_bundle(tmp_path / "small")
    assert small.failure.kind == "device_error"  # its GPU face on a GPU, its CPU face here
    assert small.failure.detail["cpu_face"]["exception_type"] == "IndexError"
    code, replayed = replay(small.path)
    assert code == 1 and replayed["triage"]["culprit"]["dataset_index"] == DATASET_INDEX


def test_after_a_device_error_the_recorder_writes_no_other_bundle(tmp_path):
    """The device is gone for the process: a loop that catches the error and goes on gets no second bundle of it."""
    sys.path.insert(0, str(PROJECTS))
    os.environ["RK_GPU_FACE"] = "1"
    try:
        import rk_vocab

        state = rk_vocab.build({})
        rec = reprokit.Recorder(state, rk_vocab.train_step, build=rk_vocab.build, config={}, out_dir=tmp_path,
                                snapshot_every=4)
        raised = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for k, b in enumerate(rk_vocab.batches(12, BAD_STEP)):
                if k == 9:
                    b["input_ids"][0, 0] = 64
                try:
                    rec.step(b)
                except RuntimeError as e:
                    raised.append((k, e))
    finally:
        sys.path.remove(str(PROJECTS))
        os.environ.pop("RK_GPU_FACE", None)
    assert [k for k, _ in raised] == [BAD_STEP, 9]
    assert len(rec.bundles) == 1 and len(list(tmp_path.glob("bundle-*"))) == 1
    assert any("the device died earlier and its bundle is" in str(w.message) for w in caught)
    assert rec.stats()["window_steps"] == 3  # steps 4 to 6: nothing recorded since the device died
    rec.close()


@pytest.mark.slow
def test_reprokit_replay_of_a_device_error_bundle_as_a_user_runs_it(lm):
    proc = subprocess.run([sys.executable, "-m", "reprokit", "replay", str(lm)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"culprit: step {BAD_STEP}, input_ids row {BAD_ROW}" in proc.stdout


@pytest.mark.slow
def test_a_trainer_update_names_the_micro_batch_and_the_dataset_index(fork_server, tmp_path):
    """The Hugging Face Trainer (a 4-layer GPT-2 made in code, ReprokitCallback): sample 21 holds the id 1000 of a
    1000-token vocabulary. The run is a process of its own (``RK_GPU_FACE`` in its environment alone), forked from the
    server that imported torch (tests/rk_forked.py): its start-up is not what this checks."""
    pytest.importorskip("transformers")
    script = tmp_path / "train_hf.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(PROJECTS)!r})\nimport rk_hf_vocab as m\n\n"
                      f"m.main({str(tmp_path / 'repros')!r}, device='cpu', trainer_cls=m.GpuFaceTrainer)\n")
    run = fork_server.capture([], script=script, cwd=tmp_path, env={"RK_GPU_FACE": "1", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["bundle"] and out["error"] == "RuntimeError: CUDA error: device-side assert triggered", run.stderr
    code, d = replay(Path(out["bundle"]))
    assert code == 1, d
    c = d["triage"]["culprit"]
    assert c["message"] == (f"step {d['recorded_failure']['step']}, micro 0, input_ids row {c['row']} (dataset index "
                            "21), position 7: id 1000 >= num_embeddings 1000 of transformer.wte")
    # As a GPU would have recorded it (bf16 on one GPU): the CPU part of the triage tells the Trainer it has none.
    gpu = tmp_path / "as-on-a-gpu"
    shutil.copytree(out["bundle"], gpu)
    run = json.loads((gpu / "run.json").read_text())
    run["config"]["args"].update(bf16=True, use_cpu=False)
    run["config"]["n_gpu"] = 1
    (gpu / "run.json").write_text(json.dumps(run))
    reseal(gpu)
    code, d = replay(gpu)
    assert code == 1 and d["triage"]["culprit"]["message"] == c["message"], d


def test_the_cpu_triage_of_code_that_needs_a_gpu_to_start_runs_again_in_a_child_that_sees_the_gpus(lm, monkeypatch):
    """On a machine with GPUs the CPU triage runs in a child that sees none; a ``build`` that puts the model on
    ``cuda`` fails there ("No CUDA GPUs are available", made here by rk_vocab when RK_BUILD_NEEDS_GPU is set and the
    child's CUDA_VISIBLE_DEVICES is empty). Then it runs again in a child that sees them, still on the CPU, and
    says so."""
    from reprokit import triage

    monkeypatch.setenv("RK_BUILD_NEEDS_GPU", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PROJECTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    t = triage.cpu_in_child(B.open_bundle(lm), None)
    assert t["cpu"]["error"] is None and t["cpu"]["cpu_face"], t["cpu"]
    assert "No CUDA GPUs are available" in t["cpu"]["gpus_visible"], t["cpu"]
    assert t["culprit"]["message"].startswith(f"step {BAD_STEP}, input_ids row {BAD_ROW}"), t["culprit"]
