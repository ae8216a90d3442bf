"""torch.compile: a compiled model records and replays as an eager one; `bisect layers` looks inside it.

The model is compiled with backend="eager" (dynamo traces it into graphs, the graphs run as eager ops): the default
inductor backend takes over a minute to compile this tiny model on a 2-core CPU, too slow for CI, and the path
reprokit cares about (a module whose hooks sit inside a compiled graph) is dynamo's either way.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import record

from reprokit.bisect.layers import EAGER_NOTE, compiled_modules
from reprokit.cli import main


@pytest.fixture
def compiled_bundle(projects, tmp_path):
    comp = projects("rk_compiled")
    cfg = {"backend": "eager"}
    rec, exc = record(comp, cfg, comp.batches(8, bad_step=4), tmp_path / "repros", snapshot_every=3)
    rec.close()
    assert compiled_modules(rec.state.model) == ["<model>"]
    assert exc.failure.kind == "nonfinite_loss" and exc.failure.step == 4
    return exc.bundle


@pytest.mark.slow
def test_a_compiled_model_replays_bit_exact(compiled_bundle):
    out = CliRunner().invoke(main, ["replay", str(compiled_bundle), "--json"])
    assert out.exit_code == 1, out.output
    d = json.loads(out.output)
    assert d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] == 2


@pytest.mark.slow
def test_bisect_layers_names_the_module_inside_the_compiled_one_and_says_it_ran_eagerly(compiled_bundle):
    out = CliRunner().invoke(main, ["bisect", "layers", str(compiled_bundle), "--json"])
    assert out.exit_code == 0, out.output
    d = json.loads(out.output)
    assert d["eager"] == ["<model>"] and d["note"] == EAGER_NOTE
    first = d["first_nonfinite"]
    assert (first["module"], first["class"], first["phase"], first["op"]) == ("_orig_mod.mid", "Block", "forward",
                                                                              "sqrt")
    assert d["origin"]["module"] == "_orig_mod.mid" and d["origin"]["rows"] == [2]
    human = CliRunner().invoke(main, ["bisect", "layers", str(compiled_bundle)])
    assert human.exit_code == 0 and f"note: {EAGER_NOTE}" in human.output
    assert "first non-finite: _orig_mod.mid (Block), forward, op aten.sqrt" in human.output
