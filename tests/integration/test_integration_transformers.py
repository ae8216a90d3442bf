"""The Hugging Face Trainer, recorded by ``ReprokitCallback`` alone: bundle, bit-exact replay, shrink to the sample.

A real ``Trainer`` (transformers, CPU, no downloads) trains a tiny GPT-2 made here on a synthetic
dataset with one poisoned sample; dropout is on, so replay is bit-exact only if the RNG, the
micro-batches and the Trainer's own step (loss scaling, clipping, AdamW, the LR schedule) are all
replayed as they ran.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import rk_hf_guard  # noqa: F401 - skips this module where transformers has no torch
import torch
import transformers  # the test extra installs it: a missing one must fail, not skip
from click.testing import CliRunner
from rk_testing import PROJECTS, bundle_of, record, reseal, torchrun
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from reprokit import TrainingFailure
from reprokit import bundle as B
from reprokit.cli import main
from reprokit.integrations.transformers import ReprokitCallback
from reprokit.pack import frameworks_needed

pytestmark = pytest.mark.slow  # importing the Trainer alone takes seconds; the fits and the torchrun case take more

VOCAB = 48
SEQ = 8
ROOT = Path(__file__).resolve().parents[2]


class Tokens(torch.utils.data.Dataset):
    """``n`` random token rows; sample ``bad`` has a token id past the vocabulary or no target at all."""

    def __init__(self, n: int, bad: int, poison: str):
        self.ids = torch.randint(1, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(0))
        self.bad, self.poison = bad, poison

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i].clone()
        labels = ids.clone()
        if i == self.bad and self.poison == "token":
            ids[3] = VOCAB + 5  # IndexError in the embedding
        if i == self.bad and self.poison == "labels":
            labels[:] = -100  # no target in the whole batch: 0 / 0 = NaN loss
        return {"input_ids": ids, "labels": labels}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def train(tmp_path, dataset, *, batch_size: int, max_steps: int, accumulate: int = 1, model=None, trainer_cls=Trainer,
          args_kw=None, **callback):
    """The user's script: a stock Trainer with the callback added, nothing else."""
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulate, max_steps=max_steps, seed=3,
                             report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             **(args_kw or {"use_cpu": True}))
    trainer = trainer_cls(model=model or tiny_gpt2(), args=args, train_dataset=dataset,
                      callbacks=[ReprokitCallback(out_dir=tmp_path / "repros", **callback)])
    trainer.train()


def replay_json(bundle) -> dict:
    result = CliRunner().invoke(main, ["replay", str(bundle), "--json"])
    assert result.exit_code == 1, result.output
    return json.loads(result.output)


def shrink_json(bundle, out) -> dict:
    result = CliRunner().invoke(main, ["shrink", str(bundle), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_token_past_vocab_records_replays_bit_exact_and_shrinks_to_the_sample(tmp_path, monkeypatch):
    bad = 13
    with pytest.raises(IndexError) as info:
        train(tmp_path, Tokens(16, bad, "token"), batch_size=4, max_steps=8, snapshot_every=3)
    note = next(n for n in info.value.__notes__ if "bundle written to" in n)
    bundle = tmp_path / "repros" / note.rsplit(" ", 1)[-1].split("/")[-1]
    assert B.verify(bundle) == []
    run = json.loads((bundle / "run.json").read_text())
    assert run["refs"]["build"] == {"module": "reprokit.integrations.transformers", "qualname": "build"}
    assert not (bundle / "code").exists()  # stock GPT-2 and Trainer: nothing of the user's code is needed
    assert run["config"]["model"]["config"]["n_layer"] == 2 and run["config"]["args"]["seed"] == 3
    failed = json.loads((bundle / "failure.json").read_text())["step"]
    assert failed >= 1, "the poisoned sample must come after a healthy step for the loss comparison to mean anything"
    # The grad check ran in the optimizer's pre-hook on every healthy update of the window.
    healthy = [h for h in run["history"] if h["step"] < failed]
    assert healthy and all(h["grad_norm"] is not None and h["grad_norm"] > 0 for h in healthy)

    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    d = replay_json(bundle)
    assert d["verdict"] == "deterministic" and d["failure"]["exception_type"] == "IndexError"
    assert list((tmp_path / "cwd").iterdir()) == [], "replay writes nothing (no trainer output_dir)"
    assert d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] >= 1

    s = shrink_json(bundle, tmp_path / "small")
    assert s["steps_after"] == 1 and s["rows_after"] == 1 and s["dataset_indices"] == [bad]
    assert replay_json(tmp_path / "small")["verdict"] == "deterministic"


def test_all_ignored_labels_nan_loss_replays_bit_exact_and_shrinks_to_the_sample(tmp_path):
    bad = 5
    with pytest.raises(TrainingFailure) as info:
        train(tmp_path, Tokens(8, bad, "labels"), batch_size=1, max_steps=8, snapshot_every=4)
    bundle = info.value.bundle
    assert info.value.failure.kind == "nonfinite_loss"
    d = replay_json(bundle)
    assert d["verdict"] == "deterministic" and d["failure"]["kind"] == "nonfinite_loss"
    assert d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] >= 2
    s = shrink_json(bundle, tmp_path / "small")
    assert s["steps_after"] == 1 and s["dataset_indices"] == [bad]

    # run.json's config comes from whoever sent the bundle: build() imports only transformers' or the project's
    # classes of the expected kind, and instantiates nothing else.
    for where, ref, why in [("model", {"module": "subprocess", "qualname": "Popen"}, "no code folder is being replayed"),
                            ("trainer", {"module": "transformers", "qualname": "pipeline"}, "not a subclass of")]:
        hostile = shutil.copytree(bundle, tmp_path / f"hostile-{where}")
        reseal_config(hostile, lambda config, where=where, ref=ref: config[where].update({"class": ref}))
        r = CliRunner().invoke(main, ["replay", str(hostile)])
        assert r.exit_code == 125 and why in r.output, r.output


def test_trainer_gpu_count_is_recorded_and_another_count_under_data_parallel_is_refused(tmp_path):
    """A Trainer not launched distributed runs on every GPU it sees (DataParallel when several): replayed on another
    count, its update is another one. The count is recorded; another one where DataParallel is in play is refused."""
    with pytest.raises(TrainingFailure) as info:
        train(tmp_path, Tokens(8, 5, "labels"), batch_size=1, max_steps=8, snapshot_every=4)
    bundle = info.value.bundle
    assert json.loads((bundle / B.RUN).read_text())["config"]["n_gpu"] == 0  # use_cpu: no GPU
    on_two = shutil.copytree(bundle, tmp_path / "on-two-gpus")
    reseal_config(on_two, lambda config: config.update(n_gpu=2))
    r = CliRunner().invoke(main, ["replay", str(on_two)])
    assert r.exit_code == 125, r.output
    assert "ran on 2 GPUs (DataParallel)" in r.output and "CUDA_VISIBLE_DEVICES" in r.output, r.output
    assert "Traceback" not in r.output
    # An older bundle does not say: replayed as before where this Trainer runs on one GPU or none.
    unknown = shutil.copytree(bundle, tmp_path / "unknown")
    reseal_config(unknown, lambda config: config.pop("n_gpu"))
    assert replay_json(unknown)["verdict"] == "deterministic"


def one_gpu(*argv: str) -> subprocess.CompletedProcess:
    """``python *argv`` in a child that sees only the first GPU this process sees: its Trainer runs as on a one-GPU
    host (no DataParallel), however many GPUs this host has."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", ROOT / "tests" / "integration"))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": first, "PYTHONPATH": path}
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)


def record_on_one_gpu(tmp_path, args_kw: dict) -> Path:
    """The poisoned run (sample 5 has no target: NaN loss) with ``args_kw``, recorded in a one-GPU child."""
    child = f"import test_integration_transformers as t; t.poisoned_run({str(tmp_path)!r}, {json.dumps(args_kw)!r})"
    r = one_gpu("-c", child)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return Path(next(line for line in r.stdout.splitlines() if line.startswith("BUNDLE ")).split(" ", 1)[1])


def poisoned_run(out: str, args_kw: str) -> None:
    """The child's body (see :func:`record_on_one_gpu`); prints ``BUNDLE <path>``."""
    with pytest.raises(TrainingFailure) as info:
        train(Path(out), Tokens(8, 5, "labels"), batch_size=1, max_steps=8, snapshot_every=4,
              args_kw=json.loads(args_kw))
    assert info.value.failure.kind == "nonfinite_loss", info.value.failure.describe()
    print("BUNDLE", info.value.bundle)


def cli_on_one_gpu(*argv: str, expect: int) -> dict:
    r = one_gpu("-m", "reprokit", *argv, "--json")
    assert r.returncode == expect, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trainer_on_the_gpu_replays_with_its_scaler_and_autocast(tmp_path, precision):
    """fp16 on CUDA: the Trainer's GradScaler and autocast are part of the step that replays (bf16: autocast alone).

    Recorded and replayed on one GPU, in children, whatever this host has: with several, a Trainer in this process
    would run DataParallel and put two samples in each update (no NaN from the poisoned one)."""
    bundle = record_on_one_gpu(tmp_path, {precision: True})
    run = B.open_bundle(bundle).run
    assert run["device"].startswith("cuda") and run["config"]["n_gpu"] == 1, (run["device"], run["config"]["n_gpu"])
    d = cli_on_one_gpu("replay", str(bundle), expect=1)
    assert d["verdict"] == "deterministic" and d["device"].startswith("cuda"), d
    assert d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] >= 2, d["fidelity"]
    s = cli_on_one_gpu("shrink", str(bundle), "-o", str(tmp_path / "small"), expect=0)
    assert s["dataset_indices"] == [5]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs or more (a Trainer that runs DataParallel)")
def test_one_gpu_recording_is_refused_where_the_replay_trainer_would_run_data_parallel(tmp_path):
    bundle = record_on_one_gpu(tmp_path, {"use_cpu": False})  # fp32 on the GPU
    assert B.open_bundle(bundle).run["config"]["n_gpu"] == 1
    r = CliRunner().invoke(main, ["replay", str(bundle)])  # this process sees every GPU: its Trainer would not match
    assert r.exit_code == 125, r.output
    assert "ran on one GPU" in r.output and f"run on {torch.cuda.device_count()} GPUs (DataParallel)" in r.output, r.output
    assert "CUDA_VISIBLE_DEVICES=0 reprokit replay" in r.output and "Traceback" not in r.output, r.output


def reseal_config(bundle, edit) -> None:
    """Edit run.json's config in place (``edit(config)``) and re-sign the manifest, as a sender could."""
    run = json.loads((bundle / B.RUN).read_text())
    edit(run["config"])
    (bundle / B.RUN).write_text(json.dumps(run))
    reseal(bundle)
    assert B.verify(bundle) == []


def test_packed_trainer_repro_names_and_checks_transformers(tmp_path):
    with pytest.raises(TrainingFailure) as info:
        train(tmp_path, Tokens(8, 5, "labels"), batch_size=1, max_steps=8, snapshot_every=4)
    env = json.loads((info.value.bundle / "env.json").read_text())
    assert env["frameworks"]["transformers"] == transformers.__version__
    assert env["frameworks"]["accelerate"] == importlib.metadata.version("accelerate")
    out = tmp_path / "repro.tar.gz"
    assert CliRunner().invoke(main, ["pack", str(info.value.bundle), "-o", str(out)]).exit_code == 0
    with tarfile.open(out) as tf:
        tf.extractall(tmp_path / "x", filter="data")
    folder = next((tmp_path / "x").iterdir())
    assert f"transformers {transformers.__version__}" in (folder / "README.md").read_text()
    assert (folder / "reprokit" / "integrations" / "transformers.py").is_file()
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the vendored runtime, not this checkout
    ok = subprocess.run([sys.executable, "repro.py"], cwd=folder, capture_output=True, text=True, env=clean)
    assert ok.returncode == 1 and "REPRODUCED" in ok.stdout, ok.stderr
    # Without transformers: a clear message and exit 125 (its code does not import here), not an ImportError.
    hide = "import sys, runpy; sys.modules['transformers'] = None; runpy.run_path('repro.py', run_name='__main__')"
    missing = subprocess.run([sys.executable, "-c", hide], cwd=folder, capture_output=True, text=True, env=clean)
    assert missing.returncode == 125, missing.stderr
    assert f"pip install transformers=={transformers.__version__}" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_project_model_and_trainer_classes_replay_from_the_code_snapshot(tmp_path, projects):
    own = projects("rk_hf_model")
    torch.manual_seed(0)
    model = own.ScaledGPT2(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))
    with pytest.raises(TrainingFailure) as info:
        train(tmp_path, Tokens(8, 5, "labels"), batch_size=1, max_steps=8, snapshot_every=4, model=model,
              trainer_cls=own.MaskedMeanTrainer)
    bundle = info.value.bundle
    config = json.loads((bundle / "run.json").read_text())["config"]
    assert config["model"]["class"] == {"module": "rk_hf_model", "qualname": "ScaledGPT2"}
    assert config["trainer"]["class"] == {"module": "rk_hf_model", "qualname": "MaskedMeanTrainer"}
    assert (bundle / "code" / "rk_hf_model.py").is_file()
    d = replay_json(bundle)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] >= 2
    assert d["code"] == str(bundle / "code")


def test_pack_needs_only_what_replay_imports(tmp_path, projects, monkeypatch):
    """A hand-written loop whose own module imports transformers needs it; one whose snapshot merely holds such a
    file (imported elsewhere in the process) does not."""
    projects("rk_hf_model")  # imports transformers; lands in every later snapshot of tests/projects
    mlp = projects("rk_mlp")
    _, exc = record(mlp, {}, mlp.batches({}, 4, poison_step=2), tmp_path / "mlp", snapshot_every=4)
    plain = B.open_bundle(bundle_of(exc))
    assert (plain.path / "code" / "rk_hf_model.py").is_file() and frameworks_needed(plain) == {}
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "rk_hf_loop.py").write_text(
        "import rk_mlp\n\n\ndef build(config):\n    import transformers  # noqa: F401\n    return rk_mlp.build(config)\n"
        "\n\ndef train_step(state, batch):\n    return rk_mlp.train_step(state, batch)\n")
    monkeypatch.syspath_prepend(str(tmp_path / "proj"))
    loop = importlib.import_module("rk_hf_loop")
    _, exc = record(loop, {}, mlp.batches({}, 4, poison_step=2), tmp_path / "loop", snapshot_every=4)
    assert frameworks_needed(B.open_bundle(bundle_of(exc))) == {"transformers": transformers.__version__}


def test_gradient_accumulation_replays_every_micro_batch(tmp_path):
    with pytest.raises(IndexError) as info:
        train(tmp_path, Tokens(24, 17, "token"), batch_size=2, accumulate=3, max_steps=4, snapshot_every=4)
    bundle = tmp_path / "repros" / next(n for n in info.value.__notes__ if "bundle written" in n).rsplit("/", 1)[-1]
    step = json.loads((bundle / "steps" / f"{json.loads((bundle / 'run.json').read_text())['window']['start']:08d}"
                                          ".json").read_text())
    assert len(step["batch"]["micro"]) == 3
    d = replay_json(bundle)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"]


def test_bisect_layers_on_a_later_micro_batch_shows_only_the_forward_that_raised(tmp_path):
    """Sample 8 lands in micro-batch 2 of step 3: the embedding raises first thing in that forward. The frames
    shown were micro-batch 1's backward (20 rows of another pass); now none, so no table."""
    from reprokit.bisect import bisect_layers

    with pytest.raises(IndexError) as info:
        train(tmp_path, Tokens(24, 8, "token"), batch_size=2, accumulate=3, max_steps=4, snapshot_every=4)
    bundle = bundle_of(info.value)
    assert len(B.open_bundle(bundle).step(3)[0]["micro"]) == 3
    d = bisect_layers(B.open_bundle(bundle))
    assert d["raised_in"]["module"] == "transformer.wte" and d["frames"] == []
    assert d["raised_in"]["out_of_range"] == {"id": VOCAB + 5, "at": [0, 3], "count": 1, "num_embeddings": VOCAB}
    out = CliRunner().invoke(main, ["bisect", "layers", str(bundle)])
    assert out.exit_code == 0 and "backward" not in out.output and "|min|" not in out.output, out.output


def test_grad_check_fires_inside_the_trainer(tmp_path):
    model = tiny_gpt2()
    model.transformer.h[1].mlp.c_fc.weight.register_hook(lambda g: g * float("inf"))  # finite loss, inf gradient
    with pytest.raises(TrainingFailure) as info:
        train(tmp_path, Tokens(8, -1, "token"), batch_size=2, max_steps=2, model=model)
    assert info.value.failure.kind == "nonfinite_grad" and info.value.failure.step == 0
    assert B.verify(info.value.bundle) == []


def test_callback_refuses_a_build_of_its_own():
    with pytest.raises(Exception, match="drop build="):
        ReprokitCallback(out_dir="x", build=tiny_gpt2)


def test_trainer_under_torchrun_records_every_rank_and_the_incident_replays(tmp_path):
    run = torchrun(PROJECTS / "rk_hf_ddp.py", tmp_path, cwd=tmp_path)
    assert run.returncode != 0, "rank 0's IndexError stops the run"
    (incident,) = [p for p in (tmp_path / "repros").iterdir() if p.name.startswith("incident-")]
    bundles = sorted(p.name.rsplit("-", 2)[-2:] for p in incident.iterdir() if p.name.startswith("bundle-"))
    assert bundles == [["exception", "rank0of2"], ["peer", "rank1of2"]], run.stderr[-3000:]
    # Sequential sampling, batch 2 over 2 ranks: rank 0 feeds samples 0,1 then 4,5; its own dataset indices are kept.
    (failed,) = [B.open_bundle(p) for p in incident.iterdir() if p.name.endswith("exception-rank0of2")]
    assert failed.failure.step == 1
    assert failed.step(1)[0]["micro"][0]["index"].tolist() == [4, 5]
    d = json.loads(CliRunner().invoke(main, ["replay", str(incident), "--nproc", "2", "--json"]).output)
    assert d["verdict"] == "deterministic" and d["failing_rank"] == 0
    rank0 = d["ranks"][0]
    assert rank0["failure"]["exception_type"] == "IndexError" and rank0["fidelity"]["bit_exact"], rank0
