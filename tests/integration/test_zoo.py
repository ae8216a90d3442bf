"""The failure zoo, end to end: each example in examples/ records a bundle, and reprokit diagnoses it.

Every example is run as a script (``--quick``): it records the bundle and replays it 3 times
(``reprokit.replay(bundle, times=3)``, the journey's replay step; its verdict line is checked).
Then each goes on to the step that makes its diagnosis (shrink and the right bisect axis for the
data faults; bisect steps for the silent ones, whose steps before the trigger are the diagnosis, so
they are not shrunk), and every one but the non-deterministic example is packed and replayed from
the tarball in a process of its own, which must fail the same way.

The scripts and the packed replays run as processes forked from one server that imported torch (the
``fork_server`` fixture, tests/rk_forked.py): each is a process of its own that starts from a state where
nothing of the example was imported, without a torch import each (seconds apiece).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from zoo_cases import STEPS, check_output

import reprokit
from reprokit.bisect import bisect_layers, bisect_precision, bisect_steps
from reprokit.bundle import open_bundle
from reprokit.extract import extract
from reprokit.pack import pack
from reprokit.shrink import shrink

pytestmark = pytest.mark.slow  # every case runs an example script to its failure, then shrinks and bisects it

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def record(fork_server, tmp_path):
    """``record(SCRIPT)``: run ``examples/SCRIPT --quick`` (train until it fails, replay 3 times) in a process of
    its own; return the bundle it wrote."""
    return lambda script: _record(fork_server, script, tmp_path)


@pytest.fixture
def packed_replay(fork_server, tmp_path):
    """``packed_replay(BUNDLE)``: pack it and replay the tarball in a process of its own (see below)."""
    return lambda small: _packed_replay(fork_server, small, tmp_path)


def _record(fork_server, script: str, tmp_path: Path) -> Path:
    out = tmp_path / "repros"
    proc = fork_server.capture(["--quick", "--out", out], script=ROOT / "examples" / script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_output(script, proc.stdout)
    bundles = sorted(out.glob("bundle-*"))
    assert len(bundles) == 1, bundles
    return bundles[0]


def _packed_replay(fork_server, small: Path, tmp_path: Path) -> dict:
    """Pack the shrunk bundle and replay the tarball in a process of its own: it must still fail the same way."""
    tar = tmp_path / "repro.tar"
    pack(small, tar)
    proc = fork_server.reprokit("replay", tar, "--json", "--trust", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    d = json.loads(proc.stdout)
    assert d["verdict"] == "deterministic", d
    return d


def shrunk_too(bundle: Path, tmp_path: Path) -> None:
    """The journey's shrink step for an example whose diagnosis reads the whole window: the shrunk bundle is no
    larger and still fails the same way (the diagnosis above was made on the full window)."""
    r = shrink(bundle, tmp_path / "small", budget=25, passes=["steps", "rows"])
    recorded = open_bundle(bundle).failure
    assert all(r.after[k] <= r.before[k] for k in ("steps", "rows") if r.before[k] is not None), (r.before, r.after)
    assert open_bundle(r.output).failure.same_as(recorded), r.to_json()["failure"]


def batch_of(bundle: Path) -> dict[str, torch.Tensor]:
    """The (only) step's batch of a shrunk bundle."""
    with reprokit.Session(open_bundle(bundle)) as s:
        (inp,) = s.inputs()
        return inp.batch


# --- full journeys --------------------------------------------------------------------------------

def test_oov_token_shrinks_to_one_row_keeping_the_offending_token(record, packed_replay, tmp_path):
    bundle = record("oov_token.py")
    r = shrink(bundle, tmp_path / "small", budget=60, passes=["steps", "rows", "sequence"])
    assert (r.after["steps"], r.after["rows"]) == (1, 1) and r.kept_rows == [2]
    ids = batch_of(r.output)["input_ids"]
    assert ids.shape[0] == 1 and (ids >= 64).sum() == 1 and int(ids.max()) == 65  # the new special token
    layers = bisect_layers(open_bundle(r.output))
    assert layers["raised_in"]["module"] == "tok" and layers["raised_in"]["class"] == "Embedding"
    d = packed_replay(r.output)
    assert d["failure"]["exception_type"] == "IndexError"


def test_long_sample_shrinks_to_table_size_plus_one(record, packed_replay, tmp_path):
    bundle = record("long_sample.py")
    r = shrink(bundle, tmp_path / "small", budget=60, passes=["steps", "rows", "sequence"])
    ids = batch_of(r.output)["input_ids"]
    assert ids.shape == (1, 33)  # one row; the position table has 32 entries
    # Any row will do: the batch is padded to its longest document, so every row is 40 positions long.
    assert r.dataset_indices[0] in range(31 * 8, 32 * 8)
    layers = bisect_layers(open_bundle(r.output))
    assert layers["raised_in"]["module"] == "pos"
    packed_replay(r.output)


def test_fp16_overflow_passes_in_fp32_and_bf16(record, packed_replay, tmp_path):
    bundle = record("fp16_overflow.py")
    r = shrink(bundle, tmp_path / "small", budget=40, passes=["steps", "rows"])
    assert r.after["steps"] == 1 and r.after["rows"] < r.before["rows"]
    d = bisect_precision(open_bundle(r.output), variants=["recorded", "fp32", "bf16", "fp16"])
    assert d["variants"] == {"recorded": "fail", "fp32": "pass", "bf16": "pass", "fp16": "fail"}
    assert d["smallest_fix"] == "fp32"
    packed_replay(r.output)


def test_lr_no_warmup_steps_finds_the_explosion_before_the_nan(record, packed_replay, tmp_path):
    bundle = record("lr_no_warmup.py")
    d = bisect_steps(open_bundle(bundle))
    assert d["failure_step"] == 16 and d["first_bad_step"] <= 12, d["reason"]  # the geometric blow-up, before the NaN
    assert "spike" in d["reason"] or "exploded" in d["reason"], d["reason"]
    assert all(row["lr"] == [0.055] for row in d["per_step"])  # the full rate from the start: no warmup
    norms = [row["grad_norm"] for row in d["per_step"] if row["step"] in range(10, 15)]
    assert all(b > 2 * a for a, b in zip(norms, norms[1:])), norms  # more than doubling every step
    shrunk_too(bundle, tmp_path)
    packed_replay(bundle)


# --- the decisive step for the others -------------------------------------------------------------

def test_bad_batch_shrinks_to_one_sample_with_its_dataset_index(record, packed_replay, tmp_path):
    bundle = record("bad_batch.py")
    r = shrink(bundle, tmp_path / "small", budget=40, passes=["steps", "rows"])
    assert (r.after["steps"], r.after["rows"]) == (1, 1)
    assert r.dataset_indices[0] in range(45 * 16, 46 * 16)  # a sample of the poisoned batch
    assert (batch_of(r.output)["labels"] == -100).all()
    packed_replay(r.output)


def test_empty_document_shrink_keeps_the_empty_document(record, packed_replay, tmp_path):
    bundle = record("empty_document.py")
    r = shrink(bundle, tmp_path / "small", budget=40, passes=["steps", "rows"])
    assert r.kept_rows == [3] and r.dataset_indices == [29 * 8 + 3]
    assert int(batch_of(r.output)["mask"].sum()) == 0
    assert r.origin is not None and r.origin.op.startswith("aten.div")
    packed_replay(r.output)


def test_collate_dtype_shrinks_to_one_row_of_int32_labels(record, packed_replay, tmp_path):
    bundle = record("collate_dtype.py")
    r = shrink(bundle, tmp_path / "small", budget=30, passes=["steps", "rows"])
    assert (r.after["steps"], r.after["rows"]) == (1, 1)
    assert batch_of(r.output)["y"].dtype == torch.int32
    packed_replay(r.output)


def test_naive_softmax_layers_names_the_module_and_the_op(record, packed_replay, tmp_path):
    bundle = record("naive_softmax.py")
    d = bisect_layers(open_bundle(bundle))
    first = d["first_nonfinite"]
    assert first["class"] == "NaiveSoftmax" and first["module"].endswith(".softmax"), first
    assert first["op"] == "exp" and first["phase"] == "forward", first  # a score past 88.7 overflows exp
    # the causal mask's -inf in the softmax's input is not where the failure came from: the NaN is made inside
    assert first["inputs_already_nonfinite"] and first["made_inside"], first
    assert d["origin"]["op"].startswith("aten.div") and d["origin"]["value"] == "nan", d["origin"]  # inf / inf
    assert "naive_softmax.py" in d["origin"]["summary"], d["origin"]
    # extract agrees with the origin: the causal mask's -inf in the softmax's forward input (there in every step,
    # which exp turns into 0) is no reason to refuse the module whose forward made the NaN
    r = extract(open_bundle(bundle), tmp_path / "cut")
    assert (r.module, r.cls, r.phase, r.level) == (first["module"], "NaiveSoftmax", "forward", "module"), r
    assert (d["origin"]["module"], d["origin"]["phase"], r.op) == (r.module, r.phase, d["origin"]["op"]), d["origin"]
    with reprokit.Session(open_bundle(r.output)) as s:
        (inp,) = s.inputs()
        assert bool(torch.isneginf(inp.batch["args"][0]).any()) and inp.batch["phase"] == "forward"
    rep = reprokit.replay(r.output)
    assert rep.verdict == "deterministic" and "NaN" in rep.to_json()["failure"]["message"], \
        rep.to_json()
    shrunk_too(bundle, tmp_path)
    packed_replay(bundle)


def test_nondeterministic_failure_is_never_called_deterministic(record, tmp_path):
    bundle = record("nondeterministic.py")
    report = reprokit.replay(bundle, times=3)  # once more, beside the example's own 3
    # The fault may strike earlier in the window (different_failure): anything but "deterministic".
    assert report.verdict in ("not_reproduced", "flaky", "different_failure"), report.to_json()


def test_shuffled_labels_steps_shows_a_flat_loss_and_healthy_gradients(record, packed_replay, tmp_path):
    bundle = record("shuffled_labels.py")
    d = bisect_steps(open_bundle(bundle))
    assert d["first_bad_step"] == d["failure_step"] == 39  # nothing blew up before the predicate
    assert all(abs(row["loss"] - math.log(4)) < 0.15 * math.log(4) for row in d["per_step"])  # chance, throughout
    assert all(0 < row["grad_norm"] < 10 for row in d["per_step"])
    shrunk_too(bundle, tmp_path)
    packed_replay(bundle)


def test_lr_x100_steps_shows_the_lr_jump_before_the_spike(record, packed_replay, tmp_path):
    bundle = record("lr_x100.py")
    d = bisect_steps(open_bundle(bundle))
    lrs = {row["step"]: row["lr"][0] for row in d["per_step"]}
    assert lrs[59] == pytest.approx(1e-3) and lrs[60] == pytest.approx(0.1)
    assert d["first_bad_step"] in range(61, 65), d["reason"]  # the grads explode, then the loss spikes at 64
    assert d["failure_step"] == 64
    shrunk_too(bundle, tmp_path)
    packed_replay(bundle)


def test_missing_zero_grad_steps_shows_grad_norms_growing(record, packed_replay, tmp_path):
    bundle = record("missing_zero_grad.py")
    d = bisect_steps(open_bundle(bundle))
    norms = [row["grad_norm"] for row in d["per_step"]]
    half = len(norms) // 2  # the accumulated gradient grows: a trend, not every step (which a CPU's last bits decide)
    assert sum(norms[half:-1]) / len(norms[half:-1]) > sum(norms[:half]) / half and norms[-2] > norms[0], norms
    assert d["first_bad_step"] in STEPS["missing_zero_grad.py"] and "gradient norm exploded" in d["reason"], d
    assert d["failure_step"] - 10 <= d["first_bad_step"] <= d["failure_step"], d  # just before the spike fired
    shrunk_too(bundle, tmp_path)
    packed_replay(bundle)


def test_sum_reduction_steps_shows_the_grad_norm_jump_at_the_batch_size_change(record, packed_replay, tmp_path):
    bundle = record("sum_reduction.py")
    d = bisect_steps(open_bundle(bundle))
    rows = {row["step"]: row for row in d["per_step"]}
    before = sorted(rows[s]["grad_norm"] for s in rows if s < 40)
    assert rows[40]["grad_norm"] > 4 * before[len(before) // 2]  # 16x the rows, summed
    assert len({tuple(row["lr"]) for row in d["per_step"]}) == 1  # the LR did not change: the batch did
    assert d["first_bad_step"] == 40
    shrunk_too(bundle, tmp_path)
    packed_replay(bundle)


def test_autocast_no_scaler_passes_in_fp32_and_bf16(record, packed_replay, tmp_path):
    bundle = record("autocast_no_scaler.py")
    d = bisect_precision(open_bundle(bundle), variants=["recorded", "fp32", "bf16", "fp16"])
    assert d["variants"] == {"recorded": "fail", "fp32": "pass", "bf16": "pass", "fp16": "fail"}
    shrunk_too(bundle, tmp_path)
    packed_replay(bundle)
