"""An extract bundle never chooses what code runs: its config's class refs and its one op are vetted.

The extracts here are real (``reprokit extract`` on a test project), then tampered as a sender could, keeping
reprokit's own, unchanged ``rk_extract.py`` and ``op_repro.py``, and re-sealed so that verification passes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from rk_testing import bundle_of, record, reseal

from reprokit.bundle import open_bundle
from reprokit.extract import extract
from reprokit.extract_op import op_overload, refusal

_REPLAY = """
import json, sys
from click.testing import CliRunner
from reprokit.cli import main
r = CliRunner().invoke(main, ["replay", sys.argv[1], "--json"])
print(json.dumps({"exit": r.exit_code, "output": r.output, "imported": sorted(set(sys.argv[2:]) & set(sys.modules))}))
"""


def _extract(projects, tmp_path, model: str, **kw):
    m = projects("rk_extract_zoo")
    cfg = {} if model == "softmax" else {"model": model}
    _, exc = record(m, cfg, m.batches(cfg, 6, poison_step=4), tmp_path / "repros", snapshot_every=3)
    out = tmp_path / "extract"
    extract(open_bundle(bundle_of(exc)), out, **kw)
    return out


def _tamper(bundle, edit) -> None:
    run = json.loads((bundle / "run.json").read_text())
    edit(run["config"]["module"])
    (bundle / "run.json").write_text(json.dumps(run))
    reseal(bundle)


def _replay(tmp_path, bundle, *watch: str) -> dict:
    """Replay ``bundle`` in a fresh interpreter (so ``sys.modules`` says what the replay imported)."""
    proc = subprocess.run([sys.executable, "-c", _REPLAY, str(bundle), *watch], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("ref, why", [
    ({"module": "this", "qualname": "s"}, "a module of the standard library"),
    ({"module": "torch.serialization", "qualname": "StorageType"}, "a module of an installed package"),
    ({"module": "torch.nn.modules.linear", "qualname": "math"}, "names no torch.nn.Module class"),
])
def test_a_config_naming_a_class_outside_the_snapshot_and_torch_layers_is_refused(projects, tmp_path, ref, why):
    out = _extract(projects, tmp_path, "softmax")
    assert _replay(tmp_path, out, "this")["exit"] == 1, "the genuine extract reproduces"
    _tamper(out, lambda spec: spec.__setitem__("class", ref))
    got = _replay(tmp_path, out, "this")
    assert got["exit"] == 3 and why in got["output"] and "config.module.class" in got["output"], got
    assert got["imported"] == [], "the module the config names was never imported"
    assert "Zen of Python" not in got["output"]


def test_a_child_class_is_vetted_too(projects, tmp_path):
    out = _extract(projects, tmp_path, "softmax")
    child = {"class": {"module": "this", "qualname": "s"}, "attrs": {}, "params": {}, "buffers": {}, "children": {}}
    _tamper(out, lambda spec: spec["children"].__setitem__("evil", child))
    got = _replay(tmp_path, out, "this")
    assert got["exit"] == 3 and "config.module.children.evil.class" in got["output"], got
    assert got["imported"] == []


def test_an_op_extract_naming_a_file_touching_op_is_refused_and_runs_nothing(projects, tmp_path):
    out = _extract(projects, tmp_path, "masked", max_module_bytes=0)
    assert _replay(tmp_path, out)["exit"] == 1, "the genuine op-level extract reproduces"
    target = tmp_path / "outside.bin"
    call = json.dumps({"args": [str(target), True, 1 << 20], "kwargs": {}})
    _tamper(out, lambda spec: spec["attrs"].update(op="aten.from_file.default", call=call))
    got = _replay(tmp_path, out)
    assert got["exit"] == 3 and "aten.from_file.default" in got["output"], got
    assert "filename" in got["output"] and "not a pure tensor op" in got["output"], got
    assert not target.exists(), "aten.from_file was never run"


def test_op_repro_refuses_an_op_json_naming_a_file_touching_op(projects, tmp_path):
    out = _extract(projects, tmp_path, "masked", max_module_bytes=0)
    script = out / "extract" / "op_repro.py"
    genuine = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert genuine.returncode == 1, genuine.stdout + genuine.stderr
    target = tmp_path / "outside.bin"
    spec = json.loads((out / "extract" / "op.json").read_text())
    spec.update(op="aten.from_file.default", args=[str(target), True, 1 << 20], kwargs={})
    spec.pop("raises", None)
    (out / "extract" / "op.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "aten.from_file.default is not a pure tensor op" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not target.exists()


@pytest.mark.parametrize("name, ok", [
    ("aten.add.Tensor", True), ("aten._softmax.default", True), ("aten.gelu.default", True),  # a mode string
    ("aten.einsum.default", True), ("aten.empty.memory_format", True),  # dtype, layout, device arguments
    ("aten.from_file.default", False), ("aten.add_.Tensor", False),  # a file name; writes to its input
    ("aten.bernoulli.p", False), ("aten._assert_async.msg", False),  # a generator; a message, no tensor back
])
def test_only_pure_tensor_ops_are_run(name, ok):
    ns, op, overload = name.split(".")
    assert (refusal(getattr(getattr(torch.ops.aten, op), overload)) is None) == ok
    if ok:
        assert op_overload(name) is getattr(getattr(torch.ops.aten, op), overload)
    else:
        with pytest.raises(ValueError, match="not a pure tensor op"):
            op_overload(name)
    for bad in ("torch.load", "aten.__class__.default", "prims.add.default", "aten.no_such_op.default", 3):
        with pytest.raises(ValueError):
            op_overload(bad)
