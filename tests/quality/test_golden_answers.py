"""Golden answers: the RIGHT answer of every command that answers something, for every example and attach path.

A person acts on what reprokit answers: goes to look at sample 352, switches to bf16, rewrites a LayerNorm. So each
row of ``CASES`` below names a scenario (a real tiny training run that fails), a command, and the answer that is
right for it, stated from how the scenario was built (the poisoned sample, the LR that was set too high, the commit
that broke the code), never copied from what the code printed. The test runs the command through the CLI with
``--json`` and checks the answer's keys.

Every failure is forced with a wide margin (a NaN or an out-of-range id in one sample, an LR 1e24 times too high,
logits far past a dtype's range), and only failure kinds, steps the data decides and step ranges are pinned, so the
answers hold on any x86-64 CPU (AVX2 or AVX-512, any thread count). Each scenario is recorded once per module and
shared by the commands that answer about it.

How to read a row: ``Case(scenario, command, expect)``: ``expect`` maps a dotted key of the command's JSON
(``state_check.verdict``, ``variants.fp32``, ``first_nonfinite.module``) to the value it must have, or to a
:class:`Check` (``within(range(61, 65))``, ``has("upstream of this batch")``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import runpy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import reprokit
from reprokit.cli import main

pytestmark = pytest.mark.slow  # every scenario trains to its failure and each command replays it: minutes in all

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = ROOT / "tests" / "projects"
EXAMPLES = ROOT / "examples"


# --- how an expected answer is written ----------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    """An expected value that is a property rather than one value (a range of steps, a substring)."""

    test: Callable[[Any], bool]
    text: str

    def __repr__(self) -> str:
        return self.text


def within(r: range) -> Check:
    return Check(lambda v: isinstance(v, int) and v in r, f"in {r}")


def has(text: str) -> Check:
    return Check(lambda v: isinstance(v, str) and text in v, f"contains {text!r}")


def starts(text: str) -> Check:
    return Check(lambda v: isinstance(v, str) and v.startswith(text), f"starts with {text!r}")


def one_of(*values: Any) -> Check:
    return Check(lambda v: v in values, f"one of {values}")


def above(x: float) -> Check:
    return Check(lambda v: isinstance(v, (int, float)) and v > x, f"> {x}")


def each(check: Check) -> Check:
    return Check(lambda v: isinstance(v, list) and bool(v) and all(check.test(x) for x in v), f"each {check}")


REPRODUCES = {"verdict": "deterministic", "fidelity.bit_exact": True}
NO_DATA_CULPRIT = {"state_check.verdict": "state", "dataset_indices": None, "kept_rows": None,
                   "state_check.message": has("upstream of this batch")}


@dataclass(frozen=True)
class Case:
    """One golden answer: ``command`` run on ``scenario``'s bundle answers ``expect``."""

    scenario: str
    command: str  # "replay", "shrink", "bisect layers", "bisect steps", "bisect precision", "extract", "bisect commits"
    expect: dict[str, Any]
    args: tuple[str, ...] = ()  # more options ("{good}" / "{bad}" / "{repo}" filled in from the scenario)
    exit_code: int = 0
    then_replays: bool = False  # the bundle the command wrote (shrink's, extract's) verifies and fails the same way
    writes: tuple[str, ...] = ()  # files the command must have written (relative to its output folder)
    slow: bool = False
    why: str = ""
    xfail: str = ""  # a known wrong answer, stated precisely (strict: the day it is right, the mark must go)
    warnings: tuple[str, ...] = ()  # filterwarnings entries for the framework's own warnings

    @property
    def id(self) -> str:
        return f"{self.scenario}-{self.command.replace(' ', '_')}"


# --- the scenarios: tiny real training runs that fail, recorded once per module ----------------------------

@dataclass
class Recorded:
    bundle: Path
    subs: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def on_path(*folders: Path) -> Iterator[None]:
    added = [str(f) for f in folders]
    sys.path[:0] = added
    try:
        yield
    finally:
        for f in added:
            sys.path.remove(f)


def project(name: str) -> Any:
    with on_path(PROJECTS):
        return importlib.import_module(name)


def train(mod: Any, config: dict, batches: Any, out: Path, step: Any = None, **kw: Any) -> Path:
    """Train ``mod`` under a Recorder until it fails; the bundle it wrote."""
    rec = reprokit.Recorder(mod.build(config), step or mod.train_step, build=mod.build, config=config, out_dir=out,
                            **kw)
    try:
        for b in batches:
            rec.step(b)
    except Exception:  # noqa: BLE001 - a TrainingFailure or the step's own exception: either wrote the bundle
        pass
    finally:
        rec.close()
    assert rec.bundles, "training did not fail"
    return Path(rec.bundles[-1])


def only_bundle(out: Path) -> Path:
    (bundle,) = sorted(out.glob("bundle-*"))
    return bundle


def example(script: str) -> Callable[[Path], Recorded]:
    """Run ``examples/SCRIPT --quick`` in this process, as ``python examples/SCRIPT --quick --out OUT`` would."""

    def run(tmp: Path) -> Recorded:
        argv = sys.argv
        sys.argv = [str(EXAMPLES / script), "--quick", "--out", str(tmp / "repros")]
        try:
            with on_path(EXAMPLES), pytest.raises(SystemExit) as done:
                runpy.run_path(str(EXAMPLES / script), run_name="__main__")
        finally:
            sys.argv = argv
            sys.modules.pop("tinylm", None)
        assert done.value.code == 0, f"{script} did not tell its story"
        return Recorded(only_bundle(tmp / "repros"))

    return run


def mlp_nan_sample(tmp: Path) -> Recorded:
    """rk_mlp (Linear-Tanh-Linear, AdamW), 16 rows a step: row 3 of step 5 (dataset index 83) holds a NaN."""
    mlp = project("rk_mlp")
    return Recorded(train(mlp, {}, mlp.batches({}, 8, poison_step=5), tmp, snapshot_every=4))


def mlp_lr_jump(tmp: Path) -> Recorded:
    """rk_mlp whose LR schedule multiplies the LR by 1e24 from step 6: step 7 overflows whatever its batch."""
    mlp = project("rk_mlp")
    config = {"scheduler": "jump", "batch_size": 4}
    return Recorded(train(mlp, config, mlp.batches(config, 20), tmp, snapshot_every=4))


def stacked_micro_batches(tmp: Path) -> Recorded:
    """nanoGPT-style ``[accum=4, B=4, T=8]`` batches; row 1 of micro-batch 2 of step 2 holds the token whose
    embedding row is NaN (dataset index 30000000 + 32 * (2*16 + 2*4 + 1) = 30001312)."""
    lm = project("rk_lm")
    config = {"vocab": 32, "max_len": 16, "nan_token": 7}
    return Recorded(train(lm, config, lm.stacked_batches(config, 6, bad=(2, 2, 1)), tmp, step=lm.stacked_step,
                          snapshot_every=4))


def gpt_lr_divergence(tmp: Path) -> Recorded:
    """rk_gpt (nanoGPT-style: clipping at 1.0, warmup, LR set inside train_step) at an LR of 1e5: step 0's update
    multiplies the weights, the residual stream grows, some op overflows float32 steps later."""
    gpt = project("rk_gpt")
    config = {"lr": 1e5, "warmup": 4}
    return Recorded(train(gpt, config, gpt.batches(config, 60), tmp))


def numerics(dtype: str, scale: float, optimizer: str = "sgd") -> Callable[[Path], Recorded]:
    """rk_numerics' naive-softmax net with ``dtype`` parameters and no autocast (the step casts the batch to the
    parameters' dtype); inputs scaled by ``scale`` from step 6 overflow its exp (float16 at ~11, float32 and bfloat16
    at ~88, float64 at ~709)."""

    def run(tmp: Path) -> Recorded:
        num = project("rk_numerics")
        config = {"softmax": True, "dtype": dtype, "optimizer": optimizer}
        return Recorded(train(num, config, num.batches(10, scale_from=6, scale=scale), tmp, snapshot_every=4))

    return run


def hf_trainer(accumulate: int) -> Callable[[Path], Recorded]:
    """A stock HF Trainer (tiny GPT-2 on ``inputs_embeds``, seed 3) with ReprokitCallback; dataset sample 58 holds a
    NaN. With accumulation 4 the shuffle puts it in micro-batch 1 of update 1 (row 4; row 4 of micro-batch 0 is
    another sample)."""

    def run(tmp: Path) -> Recorded:
        with on_path(ROOT / "tests"):
            from rk_hf_data import Embeds, tiny
        from transformers import Trainer, TrainingArguments

        from reprokit.integrations.transformers import ReprokitCallback

        args = TrainingArguments(output_dir=str(tmp / "out"), per_device_train_batch_size=8,
                                 gradient_accumulation_steps=accumulate, seed=3, max_steps=24 // accumulate,
                                 report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
                                 use_cpu=True)
        trainer = Trainer(model=tiny(), args=args, train_dataset=Embeds(64, bad=58),
                          callbacks=[ReprokitCallback(out_dir=tmp / "repros", snapshot_every=4)])
        with pytest.raises(reprokit.TrainingFailure):
            trainer.train()
        return Recorded(only_bundle(tmp / "repros"))

    return run


def lightning_tuple_batch(tmp: Path) -> Recorded:
    """Lightning, automatic optimization, ``(x, y)`` tuple batches of 4 from a TensorDataset: sample 18 (batch 4,
    row 2) holds a NaN."""
    from reprokit.integrations.lightning import ReprokitCallback

    L = project("rk_lightning")
    cb = ReprokitCallback(out_dir=tmp / "repros", snapshot_every=3)
    with pytest.raises(reprokit.TrainingFailure):
        L.trainer([cb]).fit(L.PairLit(), L.loader(L.pairs(nan=18), 4))
    return Recorded(only_bundle(tmp / "repros"))


def accelerate_loop(tmp: Path) -> Recorded:
    """A loop over accelerate-prepared model, optimizer, scheduler and dataloader; sample 21 (batch 5) is poisoned
    so its gradient goes non-finite."""
    acc = project("rk_accelerate")
    acc.build({})  # the Accelerator the loader is prepared with, as the user's script makes it first
    return Recorded(train(acc, {}, acc.loader(poison=21), tmp, snapshot_every=3))


def torchrun_gloo(tmp: Path) -> Recorded:
    """torchrun, 2 CPU ranks over gloo (DDP): rank 1 feeds a NaN at step 6; rank 0 gets NaN gradients through the
    all-reduce."""
    with on_path(ROOT / "tests"):
        from rk_testing import torchrun

    out = tmp / "repros"
    proc = torchrun(PROJECTS / "rk_ddp.py", out, "nan", "cpu", cwd=tmp, timeout=300)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    (incident,) = [p for p in out.iterdir() if p.name.startswith("incident-")]
    return Recorded(incident)


TRAINER = '''\
import torch
from torch import nn

import reprokit

SANITIZE = {sanitize}  # the commit that breaks it turns this off: NaN inputs reach the model


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def train_step(state, batch):
    x = torch.nan_to_num(batch["x"]) if SANITIZE else batch["x"]
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss
'''


def git_history(tmp: Path) -> Recorded:
    """A real git repository of 8 commits; commit 6 stops sanitising inputs, so step 5's NaN sample reaches the
    model. The failure is recorded at HEAD, in-process, as a user would."""
    import git

    proj = tmp / "proj"
    proj.mkdir()
    repo = git.Repo.init(proj)
    actor = git.Actor("Dev", "dev@example.com")
    shas = []
    for k in range(1, 9):
        (proj / "trainer.py").write_text(TRAINER.format(sanitize=k < 6))
        (proj / "CHANGES").write_text(f"change {k}\n")
        repo.index.add(["trainer.py", "CHANGES"])
        shas.append(repo.index.commit(f"commit {k}", author=actor, committer=actor).hexsha)
    sys.modules.pop("trainer", None)
    with on_path(proj):
        trainer = importlib.import_module("trainer")

    def batches() -> Iterator[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(3)
        for step in range(8):
            x = torch.randn(8, 4, generator=g)
            y = x.sum(-1)
            if step == 5:
                x[2, 1] = float("nan")
            yield {"x": x, "y": y}

    try:
        bundle = train(trainer, {}, batches(), tmp / "repros", snapshot_every=4)
    finally:
        sys.modules.pop("trainer", None)
    refs = json.loads((bundle / "run.json").read_text())["refs"]
    from reprokit.code import entry_args

    return Recorded(bundle, {"good": shas[0], "bad": shas[-1], "repo": str(proj), "first_bad": shas[5],
                             "entry": entry_args(refs)[1]})


SCENARIOS: dict[str, Callable[[Path], Recorded]] = {
    # the failure zoo (examples/), each run as its script runs
    "bad_batch": example("bad_batch.py"),
    "oov_token": example("oov_token.py"),
    "long_sample": example("long_sample.py"),
    "empty_document": example("empty_document.py"),
    "collate_dtype": example("collate_dtype.py"),
    "fp16_overflow": example("fp16_overflow.py"),
    "lr_no_warmup": example("lr_no_warmup.py"),
    "naive_softmax": example("naive_softmax.py"),
    "nondeterministic": example("nondeterministic.py"),
    "shuffled_labels": example("shuffled_labels.py"),
    "lr_x100": example("lr_x100.py"),
    "missing_zero_grad": example("missing_zero_grad.py"),
    "sum_reduction": example("sum_reduction.py"),
    "autocast_no_scaler": example("autocast_no_scaler.py"),
    # attach paths and dtypes (tests/projects)
    "mlp_nan_sample": mlp_nan_sample,
    "mlp_lr_jump": mlp_lr_jump,
    "stacked_micro_batches": stacked_micro_batches,
    "gpt_lr_divergence": gpt_lr_divergence,
    "float16_params": numerics("float16", 20.0),
    "bfloat16_params": numerics("bfloat16", 400.0, "adamw"),
    "float64_params": numerics("float64", 2000.0, "adamw"),
    "hf_trainer": hf_trainer(1),
    "hf_trainer_accumulation": hf_trainer(4),
    "lightning_tuple_batch": lightning_tuple_batch,
    "accelerate_loop": accelerate_loop,
    "torchrun_gloo": torchrun_gloo,
    "git_history": git_history,
}

LIGHTNING = ("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning",  # its own: not reprokit's
             "ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning")
PRECISION = ("--variants", "recorded,fp32,bf16,fp16")
ROWS = ("--passes", "steps,micro,rows")

CASES = [
    # --- examples/ (plain loops) --------------------------------------------------------------------------
    Case("bad_batch", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss", "failure.step": 45}, exit_code=1),
    Case("bad_batch", "shrink", {"steps_after": 1, "rows_after": 1, "state_check.verdict": "data",
                                 "dataset_indices": each(within(range(45 * 16, 46 * 16)))}, ROWS, then_replays=True,
         why="every label of step 45's batch is -100: any one of its 16 samples is the culprit"),
    Case("oov_token", "replay", {**REPRODUCES, "failure.exception_type": "IndexError"}, exit_code=1),
    Case("oov_token", "bisect layers", {"raised_in.module": "tok", "raised_in.class": "Embedding"}),
    Case("oov_token", "shrink", {"steps_after": 1, "rows_after": 1, "kept_rows": [2], "state_check.verdict": "data"},
         ROWS, then_replays=True, why="row 2 of step 33 holds id 65 of a 64-row embedding table"),
    Case("oov_token", "extract", {"module": "tok", "class": "Embedding"}, then_replays=True,
         writes=("code/rk_extract.py", "extract/op_repro.py")),
    Case("long_sample", "replay", {**REPRODUCES, "failure.exception_type": "IndexError"}, exit_code=1),
    Case("long_sample", "bisect layers", {"raised_in.module": "pos", "raised_in.class": "Embedding"}),
    Case("long_sample", "shrink", {"steps_after": 1, "rows_after": 1, "seq_after": 33,
                                   "dataset_indices": each(within(range(31 * 8, 32 * 8)))},
         ("--passes", "steps,rows,sequence"), then_replays=True,
         why="the batch is padded to its 40-position document: every row of step 31 overruns the 32 positions"),
    Case("empty_document", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss", "failure.step": 29},
         exit_code=1),
    Case("empty_document", "shrink", {"rows_after": 1, "kept_rows": [3], "dataset_indices": [29 * 8 + 3],
                                      "origin.op": starts("aten.div")}, ROWS, then_replays=True,
         why="row 3 of step 29 has an empty mask: its loss divides 0 by 0"),
    Case("collate_dtype", "replay", {**REPRODUCES, "failure.exception_type": "RuntimeError"}, exit_code=1),
    Case("collate_dtype", "shrink", {"steps_after": 1, "rows_after": 1, "state_check.verdict": "untested",
                                     "state_check.reason": has("no other step of the window has a batch of the")},
         ROWS, then_replays=True,
         why="every label of the ragged last batch is int32: any one row fails; no other batch has its 7 rows"),
    Case("fp16_overflow", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss", "failure.step": 55},
         exit_code=1),
    Case("fp16_overflow", "bisect precision", {"variants.recorded": "fail", "variants.fp32": "pass",
                                               "variants.bf16": "pass", "variants.fp16": "fail",
                                               "smallest_fix": "fp32"}, PRECISION,
         why="predictions past 65504 overflow fp16 autocast; fp32 and bf16 have the range"),
    Case("lr_no_warmup", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss", "failure.step": 16},
         exit_code=1),
    Case("lr_no_warmup", "bisect steps", {"failure_step": 16, "first_bad_step": within(range(0, 13))},
         why="the gradient norm more than doubles every step well before the NaN at 16"),
    Case("lr_no_warmup", "shrink", NO_DATA_CULPRIT, ROWS,
         why="the full LR from step 0 blows the weights up: any batch fails from that state"),
    Case("naive_softmax", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss"}, exit_code=1),
    Case("naive_softmax", "bisect layers", {"first_nonfinite.class": "NaiveSoftmax", "first_nonfinite.op": "exp",
                                            "first_nonfinite.made_inside": True, "origin.op": starts("aten.div"),
                                            "already_out_of_range": None}),
    Case("naive_softmax", "extract", {"class": "NaiveSoftmax", "phase": "forward", "level": "module",
                                      "op": starts("aten.div")}, then_replays=True,
         writes=("code/rk_extract.py", "code/naive_softmax.py", "extract/op_repro.py", "state/state.safetensors"),
         why="the module alone, with its inputs (the causal mask's -inf among them), and the division op alone"),
    Case("nondeterministic", "replay", {"verdict": one_of("not_reproduced", "flaky", "different_failure")},
         ("--times", "3"), exit_code=-1, why="a fault that strikes at random is never called deterministic"),
    Case("shuffled_labels", "replay", {**REPRODUCES, "failure.kind": "predicate", "failure.step": 39},
         exit_code=1),
    Case("shuffled_labels", "bisect steps", {"first_bad_step": 39, "failure_step": 39},
         why="nothing blew up: the loss sat at chance throughout, the predicate fired at 39"),
    Case("lr_x100", "replay", {**REPRODUCES, "failure.kind": "loss_spike", "failure.step": 64}, exit_code=1),
    Case("lr_x100", "bisect steps", {"failure_step": 64, "first_bad_step": within(range(60, 65))},
         why="the LR jumps x100 at step 60; grads explode, the loss spikes at 64"),
    Case("lr_x100", "shrink", NO_DATA_CULPRIT, ROWS,
         why="the LR set 100x too high fails on any data: from step 64's start state the batches of steps 61-63 lift "
             "the loss by most of the recorded rise over the median, short of the threshold only by a few percent"),
    Case("missing_zero_grad", "replay", {**REPRODUCES, "failure.kind": "loss_spike"}, exit_code=1),
    Case("missing_zero_grad", "bisect steps", {"reason": has("gradient norm exploded")}),
    Case("sum_reduction", "replay", {**REPRODUCES, "failure.kind": "loss_spike", "failure.step": 40}, exit_code=1),
    Case("sum_reduction", "bisect steps", {"first_bad_step": 40, "failure_step": 40},
         why="the batch grows 16x at step 40 and a summed loss's gradient with it"),
    Case("autocast_no_scaler", "replay", {**REPRODUCES, "failure.kind": "predicate"}, exit_code=1),
    Case("autocast_no_scaler", "bisect precision", {"variants.recorded": "fail", "variants.fp32": "pass",
                                                    "variants.bf16": "pass", "variants.fp16": "fail",
                                                    "smallest_fix": "fp32"}, PRECISION),
    # --- plain loop: a poisoned sample, a broken LR schedule -----------------------------------------------
    Case("mlp_nan_sample", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss", "failure.step": 5},
         exit_code=1),
    Case("mlp_nan_sample", "shrink", {"state_check.verdict": "data", "rows_after": 1, "kept_rows": [3],
                                      "dataset_indices": [5 * 16 + 3]}, then_replays=True),
    Case("mlp_nan_sample", "bisect layers", {"first_nonfinite.module": "0", "first_nonfinite.op": "addmm",
                                             "first_nonfinite.inputs_already_nonfinite": True,
                                             "first_nonfinite.made_inside": False, "origin.rows": [3]},
         why="the NaN came in with the batch: the first Linear saw it, made nothing"),
    Case("mlp_nan_sample", "bisect steps", {"first_bad_step": 5, "failure_step": 5}),
    Case("mlp_nan_sample", "bisect precision", {"variants.fp32": "fail", "variants.bf16": "fail",
                                                "smallest_fix": None}, PRECISION,
         why="a NaN in the data fails in every precision"),
    Case("mlp_nan_sample", "extract", {"error.type": "NothingToExtract"}, exit_code=1,
         why="no module made the NaN: the batch held it"),
    Case("mlp_lr_jump", "replay", {**REPRODUCES, "failure.step": 7}, exit_code=1),
    Case("mlp_lr_jump", "shrink", {**NO_DATA_CULPRIT, "state_check.step": 7}, then_replays=True),
    Case("mlp_lr_jump", "bisect steps", {"failure_step": 7, "first_bad_step": within(range(6, 8))},
         why="step 6 runs with the LR x1e24"),
    # --- stacked micro-batches [accum, B, T] ----------------------------------------------------------------
    Case("stacked_micro_batches", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss", "failure.step": 2},
         exit_code=1),
    Case("stacked_micro_batches", "shrink", {"state_check.verdict": "data", "rows_before": 16, "rows_after": 1,
                                             "kept_rows": [[2, 1]], "dataset_indices": [30001312]},
         then_replays=True),
    # --- LR divergence in a nanoGPT-style loop: the op that overflowed is not the cause ---------------------
    Case("gpt_lr_divergence", "shrink", NO_DATA_CULPRIT, ROWS, slow=True),
    Case("gpt_lr_divergence", "bisect layers", {"already_out_of_range.dtype": "float32",
                                                "already_out_of_range.input_abs_max": above(1e12),
                                                "already_out_of_range.grew.past_step": 0}, slow=True),
    Case("gpt_lr_divergence", "bisect steps", {"first_bad_step": 1, "reason": starts("loss departed")}, slow=True),
    Case("gpt_lr_divergence", "extract", {"error.type": "NothingToExtract",
                                          "error.already_out_of_range.grew.past_step": 0}, exit_code=1, slow=True),
    # --- dtypes: parameters cast after build, no autocast ---------------------------------------------------
    Case("float16_params", "bisect precision", {"variants.recorded": "fail", "variants.fp32": "pass",
                                                "variants.fp16": "fail", "smallest_fix": "fp32",
                                                "dtypes.fp32.params": ["float32"], "dtypes.fp32.loss": ["float32"]},
         PRECISION, why="logits near 20 overflow exp in float16 only"),
    Case("float16_params", "bisect layers", {"first_nonfinite.op": "exp", "first_nonfinite.made_inside": True,
                                             "already_out_of_range": None}),
    Case("bfloat16_params", "bisect precision", {"variants.recorded": "fail", "variants.fp32": "fail",
                                                 "variants.bf16": "fail", "smallest_fix": None,
                                                 "dtypes.fp32.params": ["float32"]}, PRECISION,
         why="logits near 500 overflow exp in float32 and bfloat16 alike: precision is not the fix"),
    Case("float64_params", "bisect precision", {"variants.recorded": "fail", "variants.fp32": "fail",
                                                "variants.bf16": "not_applied", "variants.fp16": "not_applied",
                                                "smallest_fix": None}, PRECISION,
         why="logits near 2000 overflow float64 too; autocast leaves float64 alone"),
    Case("float64_params", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss", "failure.step": 6},
         exit_code=1),
    # --- HF Trainer, Lightning, accelerate, torchrun --------------------------------------------------------
    Case("hf_trainer", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss"}, exit_code=1, slow=True),
    Case("hf_trainer", "shrink", {"state_check.verdict": "data", "rows_after": 1, "dataset_indices": [58]}, ROWS,
         then_replays=True, slow=True),
    Case("hf_trainer_accumulation", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss"}, exit_code=1,
         slow=True),
    Case("hf_trainer_accumulation", "shrink", {"rows_before": 32, "rows_after": 1, "dataset_indices": [58],
                                               "kept_rows": [[1, 4]]}, ROWS, then_replays=True, slow=True),
    Case("lightning_tuple_batch", "replay", {**REPRODUCES, "failure.kind": "nonfinite_loss", "failure.step": 4},
         exit_code=1, slow=True, warnings=LIGHTNING),
    Case("lightning_tuple_batch", "shrink", {"steps_after": 1, "rows_before": 4, "rows_after": 1, "kept_rows": [2]},
         then_replays=True, slow=True, warnings=LIGHTNING),
    Case("accelerate_loop", "replay", {**REPRODUCES, "failure.kind": "nonfinite_grad", "failure.step": 5},
         exit_code=1, slow=True),
    Case("accelerate_loop", "shrink", {"state_check.verdict": "data", "steps_after": 1, "rows_after": 1,
                                       "kept_rows": [1], "dataset_indices": None}, then_replays=True, slow=True,
         why="sample 21 is row 1 of step 5; (x, y) batches carry no index leaf, so no dataset index is claimed"),
    Case("torchrun_gloo", "replay", {"verdict": "deterministic", "world_size": 2, "failing_rank": 1,
                                     "failing_what": starts("non-finite loss at step 6")}, exit_code=1, slow=True),
    # --- git history ----------------------------------------------------------------------------------------
    Case("git_history", "bisect commits", {"first_bad": "{first_bad}", "first_bad_commit.subject": "commit 6"},
         ("--good", "{good}", "--bad", "{bad}", "--repo", "{repo}", "--entry", "{entry}"), slow=True),
]


# --- running a case --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Recorded]:
    """Each scenario's bundle, recorded the first time a case asks for it and shared with the others."""
    done: dict[str, Recorded] = {}

    def get(name: str) -> Recorded:
        if name not in done:
            threads = torch.get_num_threads()
            try:
                done[name] = SCENARIOS[name](tmp_path_factory.mktemp(name))
            finally:
                torch.set_num_threads(threads)
        return done[name]

    return get


def lookup(d: Any, key: str) -> Any:
    for part in key.split("."):
        assert isinstance(d, dict) and part in d, f"no {key!r} in the answer (stopped at {part!r})"
        d = d[part]
    return d


def cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, [*args, "--json"])
    try:
        return result.exit_code, json.loads(result.stdout)
    except json.JSONDecodeError:
        raise AssertionError(f"`reprokit {' '.join(args)} --json` printed no JSON (exit {result.exit_code}):\n"
                             f"{result.output}") from None


def run_case(case: Case, rec: Recorded, tmp_path: Path) -> dict[str, Any]:
    args = [*case.command.split(), str(rec.bundle)]
    if case.command in ("shrink", "extract"):
        args += ["-o", str(tmp_path / "written")]
    args += [a.format(**rec.subs) for a in case.args]
    code, answer = cli(*args)
    if case.exit_code >= 0:
        assert code == case.exit_code, (code, answer)
    wrong = {}
    for key, want in case.expect.items():
        got = lookup(answer, key)
        want = want.format(**rec.subs) if isinstance(want, str) else want
        if not (want.test(got) if isinstance(want, Check) else got == want):
            wrong[key] = f"got {got!r}, right answer {want!r}"
    assert not wrong, f"{case.id}: {wrong}" + (f" ({case.why})" if case.why else "")
    for rel in case.writes:
        assert (tmp_path / "written" / rel).is_file(), f"{case.id}: {rel} not written"
    if case.then_replays:
        assert cli("verify", str(tmp_path / "written"))[0] == 0, "the written bundle does not match its manifest"
        code, again = cli("replay", str(tmp_path / "written"))
        assert code == 1 and again["verdict"] == "deterministic", again
        if isinstance(answer.get("failure"), dict):  # shrink's: the failure the shrunk bundle still has
            assert again["failure"]["kind"] == answer["failure"]["kind"], (again["failure"], answer["failure"])
    return answer


def marks(case: Case) -> list[Any]:
    out = [pytest.mark.filterwarnings(w) for w in case.warnings]
    if case.slow:
        out.append(pytest.mark.slow)
    if case.xfail:
        out.append(pytest.mark.xfail(strict=True, reason=case.xfail))
    return out


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=marks(c)) for c in CASES])
def test_golden_answer(case: Case, recorded: Callable[[str], Recorded], tmp_path: Path) -> None:
    run_case(case, recorded(case.scenario), tmp_path)


def test_every_example_has_a_golden_answer() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py")} - {"tinylm.py"}
    covered = {c.scenario + ".py" for c in CASES}
    assert scripts <= covered, sorted(scripts - covered)
