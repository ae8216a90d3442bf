"""reprokit.integrations.lightning: a real Lightning Trainer records through the callback; replay and shrink."""

from __future__ import annotations

import json

import lightning  # noqa: F401  the test extra installs it: a missing one must fail, not skip
import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, entries

import reprokit
from reprokit.bisect import bisect_layers
from reprokit.bundle import open_bundle
from reprokit.cli import main
from reprokit.errors import CaptureError

pytestmark = [
    pytest.mark.slow,  # importing Lightning alone takes seconds; the fits and the torchrun case take more
    # Lightning's own warnings (a DataLoader without workers, its pytree shim on torch 2.13): not reprokit's.
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning"),
]

OOV, IGNORED = 21, 17  # sample 21 (batch 5, row 1) holds an id past the vocab; sample 17 (batch 4, row 1) no labels


def _fit(projects, tmp_path, dataset_kw, module_kw=(), bs=4, **trainer_kw):
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    cb = ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=3)
    with pytest.raises(Exception) as info:
        L.trainer([cb], **trainer_kw).fit(L.TinyLit(**dict(module_kw)), L.loader(L.Tokens(**dataset_kw), bs))
    return info.value, bundle_of(info.value)


def _replay(bundle):
    out = CliRunner().invoke(main, ["replay", str(bundle), "--json"])
    assert out.exit_code == 1, out.output
    d = json.loads(out.output)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] >= 2
    return d


def _shrink_keeps(bundle, tmp_path, index):
    out = CliRunner().invoke(main, ["shrink", str(bundle), "-o", str(tmp_path / "small"), "--json"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert d["rows_after"] == 1 and d["dataset_indices"] == [index]
    again = CliRunner().invoke(main, ["replay", str(tmp_path / "small")])
    assert again.exit_code == 1, again.output


def test_automatic_optimization_index_error_replays_bit_exact_and_shrinks_to_the_sample(projects, tmp_path):
    # Accumulation and clipping on: the replayed step runs them as Lightning's automatic loop does.
    exc, bundle = _fit(projects, tmp_path, {"oov": OOV}, accumulate_grad_batches=2, gradient_clip_val=0.5)
    assert isinstance(exc, IndexError)
    b = open_bundle(bundle)
    assert b.failure.step == 5 and b.run["config"]["trainer"]["accumulate_grad_batches"] == 2
    assert b.run["refs"]["build"] == {"module": "reprokit.integrations.lightning", "qualname": "build"}
    assert (bundle / "code" / "rk_lightning.py").is_file()
    d = _replay(bundle)
    assert d["failure"]["frame"].startswith("rk_lightning.py:forward")
    _shrink_keeps(bundle, tmp_path, OOV)


def test_automatic_optimization_nan_loss_from_a_sample_without_labels(projects, tmp_path):
    exc, bundle = _fit(projects, tmp_path, {"ignored": IGNORED})
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.kind == "nonfinite_loss" and exc.failure.step == 4
    _replay(bundle)
    # Lightning runs training_step inside optimizer.step(closure): the origin is still the forward's division.
    origin = bisect_layers(open_bundle(bundle))["origin"]
    src = (bundle / "code" / "rk_lightning.py").read_text().splitlines()
    line = next(i for i, t in enumerate(src, 1) if "0 / 0 = nan" in t)
    assert (origin["phase"], origin["op"], origin["module"], origin["rows"]) == ("forward", "aten.div.Tensor", None, [1])
    assert origin["site"] == f"rk_lightning.py:{line}"
    _shrink_keeps(bundle, tmp_path, IGNORED)


def test_a_tuple_batch_shrinks_to_its_nan_row_through_the_cli(projects, tmp_path):
    """``(x, y)`` batches from a TensorDataset (automatic optimization): shrink cuts the rows inside the tuple and
    keeps the NaN sample. Once one row was left, the tuple read as two samples of one row each, and the next rows
    pass indexed past the one row it had kept (exit 70, IndexError)."""
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    cb = ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=3)
    with pytest.raises(reprokit.TrainingFailure) as info:  # sample 18: batch 4, row 2
        L.trainer([cb]).fit(L.PairLit(), L.loader(L.pairs(nan=18), 4))
    bundle = bundle_of(info.value)
    assert info.value.failure.step == 4
    _replay(bundle)
    out = CliRunner().invoke(main, ["shrink", str(bundle), "-o", str(tmp_path / "small"), "--json"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert (d["steps_after"], d["rows_before"], d["rows_after"], d["kept_rows"]) == (1, 4, 1, [2]), d
    x, y = open_bundle(tmp_path / "small").step(4)[0]["batch"]
    assert x.shape == (1, 4) and y.shape == (1,) and x.isnan().any()
    again = CliRunner().invoke(main, ["replay", str(tmp_path / "small")])
    assert again.exit_code == 1, again.output


def test_the_gradient_check_reads_the_gradients_the_closure_made(projects, tmp_path):
    """Lightning steps the optimizer with a closure that runs training_step and backward inside step(): the
    gradient check must read that step's gradients (after the closure), not the last step's."""
    exc, bundle = _fit(projects, tmp_path, {"ignored": IGNORED}, {"guard": True})
    assert isinstance(exc, reprokit.TrainingFailure)
    assert (exc.failure.kind, exc.failure.step) == ("nonfinite_grad", 4)  # the loss of step 4 is finite
    d = _replay(bundle)
    assert d["failure"]["kind"] == "nonfinite_grad"


def test_manual_optimization_under_bf16_autocast_replays_bit_exact(projects, tmp_path):
    # bf16-mixed: the precision plugin's autocast is part of the replayed step (fp32 losses would differ).
    exc, bundle = _fit(projects, tmp_path, {"ignored": IGNORED}, {"manual": True}, precision="bf16-mixed")
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 4
    config = open_bundle(bundle).run["config"]
    assert config["automatic_optimization"] is False and config["trainer"]["precision"] == "bf16-mixed"
    _replay(bundle)


def test_replay_follows_the_code_an_edit_that_fixes_the_module_passes(projects, tmp_path):
    """The replayed step really runs the snapshot's training_step: a fixed copy of the module passes."""
    _, bundle = _fit(projects, tmp_path, {"ignored": IGNORED})
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    src = (bundle / "code" / "rk_lightning.py").read_text()
    marker = "per_sample = (ce.sum(1) + 1e-4 * z) / count"
    assert marker in src
    (fixed / "rk_lightning.py").write_text(src.replace(marker, marker + ".clamp(min=1)"))
    out = CliRunner().invoke(main, ["replay", str(bundle), "--code", str(fixed), *entries(bundle)])
    assert out.exit_code == 0, out.output


def test_a_module_that_cannot_be_rebuilt_from_its_hyperparameters_is_refused_at_attach(projects, tmp_path):
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    with pytest.raises(CaptureError, match="save_hyperparameters"):
        L.trainer([ReprokitCallback(out_dir=tmp_path / "r")]).fit(L.Unsaved(8), L.loader(L.Tokens()))


def test_under_torchrun_every_rank_records_into_one_incident(tmp_path):
    """Lightning's DDP strategy (gloo, 2 CPU processes under torchrun): rank 1's data has a sample without labels;
    rank 0 gets the NaN through the gradient all-reduce. The callback records per rank through the multi-rank
    machinery (one incident folder, every rank's window)."""
    from rk_testing import PROJECTS, torchrun

    out = tmp_path / "repros"
    proc = torchrun(PROJECTS / "rk_lightning_ddp.py", out, cwd=tmp_path)
    assert proc.returncode != 0, "training failed"
    folders = [p for p in out.iterdir() if p.name.startswith("incident-")]
    assert len(folders) == 1, proc.stderr[-3000:]
    # by rank, not by name: a bundle's name starts with the second it was written, which either rank may reach first
    by_rank = {open_bundle(p).run["distributed"]["rank"]: p for p in folders[0].iterdir() if p.name.startswith("bundle-")}
    kinds = {r: (open_bundle(b).failure.kind, open_bundle(b).failure.step) for r, b in by_rank.items()}
    assert kinds == {0: ("nonfinite_grad", 5), 1: ("nonfinite_loss", 5)}, kinds
    # Rank 1 fed the NaN itself: alone, in one process (no all-reduce, so not bit-exact), it still fails there.
    alone = CliRunner().invoke(main, ["replay", str(by_rank[1])])
    assert alone.exit_code == 1 and "recorded on rank 1 of 2, replayed alone" in alone.stdout, alone.output
    # On its two ranks again (replay's build puts the module behind Lightning's DDP strategy): bit-exact on both.
    both = CliRunner().invoke(main, ["replay", str(folders[0]), "--nproc", "2", "--json"])
    assert both.exit_code == 1, both.output
    ranks = json.loads(both.stdout)["ranks"]
    assert [(r["rank"], r["verdict"], r["fidelity"]["bit_exact"]) for r in ranks] == \
        [(0, "deterministic", True), (1, "deterministic", True)], ranks
