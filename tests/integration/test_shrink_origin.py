"""Shrinking keeps the bug, not just the failure kind: the origin of a non-finite failure (real tiny loops)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import record

from reprokit.bisect import bisect_layers
from reprokit.bundle import open_bundle
from reprokit.cli import main
from reprokit.replayer import Session
from reprokit.shrink.batch import batch_size, select_seq, seq_len
from reprokit.shrink.case import Case
from reprokit.shrink.shrinker import Shrinker


def _site(mod, marker: str) -> str:
    import inspect
    from pathlib import Path

    lines = inspect.getsource(mod).splitlines()
    return f"{Path(mod.__file__).name}:{next(i for i, t in enumerate(lines, 1) if marker in t)}"


@pytest.fixture
def empty_doc(projects, tmp_path):
    """Step 3 of a masked-mean LM, row 5 an empty document (no target): loss = nan."""
    lm = projects("rk_lm_mask")
    cfg = {"vocab": 30}
    _, exc = record(lm, cfg, lm.batches(cfg, 4, empty=(3, 5)), tmp_path / "r")
    assert exc.failure.kind == "nonfinite_loss" and exc.failure.step == 3
    return lm, exc.bundle


def test_the_origin_of_an_empty_document_is_the_division_in_the_step_function(empty_doc):
    lm, bundle = empty_doc
    d = bisect_layers(open_bundle(bundle))
    o = d["origin"]
    assert (o["phase"], o["op"], o["value"], o["created"], o["module"]) == \
        ("forward", "aten.div.Tensor", "nan", True, None)
    assert o["site"] == _site(lm, "THE BUG") and o["rows"] == [5]
    out = CliRunner().invoke(main, ["bisect", "layers", str(bundle)])
    assert out.exit_code == 0 and "origin: nan made by aten.div.Tensor in the step function, outside every module" \
        in out.output


def test_a_one_position_cut_that_empties_every_document_is_rejected(empty_doc):
    _, bundle = empty_doc
    with Session(open_bundle(bundle)) as s:
        inputs = tuple(s.inputs())
        batch = inputs[-1].batch
        n, S = batch_size(batch), seq_len(batch, batch_size(batch))
        original = Case(inputs, s.snapshot, 0, tuple(range(n)), (0, S))
        sh = Shrinker(s)
        assert sh.test(original)
        sh.origin, sh.reference = sh.find_origin(original), (batch, n)
        assert sh.origin.rows == (5,)
        one = original.with_last(select_seq(batch, n, S, 0, 1), seq=(0, 1))
        assert s.run(one.inputs, one.snapshot).same, "by its signature alone it fails the same way"
        assert not sh.test(one) and sh.origin_changed == 1, "but every document is 0/0 there"
        # Every document is at least S // 2 long: a 3-position window leaves each one a target.
        three = original.with_last(select_seq(batch, n, S, 0, 3), seq=(0, 3))
        assert sh.test(three) and sh.origin_changed == 1
        # Once only the empty document is left, a control row (a healthy one, cut the same way) stands in.
        alone = Case(inputs, s.snapshot, 0, (5,), (0, S)).with_last({k: v[5:6] for k, v in batch.items()})
        assert sh.test(alone)
        alone_one = alone.with_last(select_seq(alone.last.batch, 1, S, 0, 1), seq=(0, 1))
        assert s.run(alone_one.inputs, alone_one.snapshot).same
        assert not sh.test(alone_one) and sh.origin_changed == 2
        healthy = original.with_last({k: v[:5] for k, v in batch.items()}, rows=(0, 1, 2, 3, 4))
        assert not sh.test(healthy)
        # One origin run for the original, one per candidate that failed with the same signature; none for healthy.
        assert sh.replays == 6 and sh.origin_checks == 5


@pytest.mark.slow
def test_the_sequence_pass_leaves_the_feature_dim_of_a_dense_batch_alone(projects, tmp_path):
    from reprokit.shrink import shrink

    mlp = projects("rk_mlp")
    cfg = {"dim": 64, "batch_size": 8}
    _, exc = record(mlp, cfg, mlp.batches(cfg, 3, poison_step=2), tmp_path / "r")
    r = shrink(exc.bundle, tmp_path / "small")
    assert r.before["seq"] is None and r.after["seq"] is None and r.seq_window is None
    assert r.passes["sequence"].replays == 0, "no candidate cut the [8, 64] float input along dim 1"
    assert r.kept_rows == [3] and open_bundle(r.output).step(2)[0]["x"].shape == (1, 64)
    cli = CliRunner().invoke(main, ["shrink", str(exc.bundle), "-o", str(tmp_path / "cli"), "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.output)["origin"]["module"] == "0"
