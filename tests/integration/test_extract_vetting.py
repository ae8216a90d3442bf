"""An extract bundle never chooses what code runs: its config's class refs and its one op are vetted.

The extracts here are real (``reprokit extract`` on a test project), then tampered as a sender could, keeping
reprokit's own, unchanged ``rk_extract.py`` and ``op_repro.py``, and re-sealed so that verification passes.
"""

from __future__ import annotations

import importlib
import json
import shutil
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
watch = set(sys.argv[1].split(","))
assert not watch & set(sys.modules), sorted(watch & set(sys.modules))  # none imported before the replays
for bundle in sys.argv[2:]:
    r = CliRunner().invoke(main, ["replay", bundle, "--json"])
    print(json.dumps({"exit": r.exit_code, "output": r.output, "imported": sorted(watch & set(sys.modules))}))
"""
_REFS = {
    # Not a class the bundle lists under refs.objects: refused before it is even looked at.
    "stdlib": ({"module": "this", "qualname": "s"}, "is not among the classes the bundle lists under refs.objects"),
    "installed": ({"module": "torch.serialization", "qualname": "StorageType"},
                  "is not among the classes the bundle lists under refs.objects"),
    "not_a_layer": ({"module": "torch.nn.modules.linear", "qualname": "math"}, "names no torch.nn.Module class"),
}


@pytest.fixture(scope="module")
def extracts(tmp_path_factory):
    """Two real extracts of rk_extract_zoo's failures: a module (UnstableSoftmax) and, narrowed, one op."""
    from conftest import PROJECTS

    tmp = tmp_path_factory.mktemp("extracts")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(PROJECTS))
        m = importlib.import_module("rk_extract_zoo")
        out = {}
        for level, cfg, kw in (("module", {}, {}), ("op", {"model": "masked"}, {"max_module_bytes": 0})):
            _, exc = record(m, cfg, m.batches(cfg, 6, poison_step=4), tmp / f"repros-{level}", snapshot_every=3)
            out[level] = extract(open_bundle(bundle_of(exc)), tmp / level, **kw).output
    return out


def _copy(extracts, level, dest, edit=None):
    shutil.copytree(extracts[level], dest)
    if edit is not None:
        run = json.loads((dest / "run.json").read_text())
        edit(run["config"]["module"])
        (dest / "run.json").write_text(json.dumps(run))
        reseal(dest)
    return dest


@pytest.fixture
def replay_each(fork_server, tmp_path):
    """``replay_each(BUNDLES, watch=("this",))``: replay each bundle in turn in one process of its own, forked from
    the shared fork server (torch and reprokit imported, none of the watched modules: checked), where
    ``sys.modules`` says what the replays imported."""

    def run(bundles, watch=("this",)) -> list[dict]:
        script = tmp_path / "replay_each.py"
        script.write_text(_REPLAY)
        proc = fork_server.capture([",".join(watch), *bundles], script=script, cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(bundles):]]

    return run


@pytest.mark.slow
def test_a_config_naming_a_class_outside_the_snapshot_and_torch_layers_is_refused(extracts, tmp_path, replay_each):
    child = {"class": _REFS["stdlib"][0], "attrs": {}, "params": {}, "buffers": {}, "children": {}}
    tampered = {case: _copy(extracts, "module", tmp_path / case, lambda spec, ref=ref: spec.__setitem__("class", ref))
                for case, (ref, _) in _REFS.items()}
    tampered["child"] = _copy(extracts, "module", tmp_path / "child",
                              lambda spec: spec["children"].__setitem__("evil", child))
    # Last: a module the genuine extract imports anyway must not hide one a tampered one imported.
    got = dict(zip([*tampered, "genuine"], replay_each([*tampered.values(), extracts["module"]])))
    assert got.pop("genuine")["exit"] == 1, "the genuine extract reproduces"
    for case, (_, why) in [*_REFS.items(), ("child", (None, "is not among the classes the bundle lists under refs.objects"))]:
        field = "config.module.children.evil.class" if case == "child" else "config.module.class"
        assert got[case]["exit"] == 3 and why in got[case]["output"] and field in got[case]["output"], (case, got)
        assert got[case]["imported"] == [], "the module the config names was never imported"
        assert "Zen of Python" not in got[case]["output"]


@pytest.mark.slow
def test_a_standard_library_class_listed_under_refs_objects_too_is_refused_before_any_import(extracts, tmp_path, replay_each):
    # The tamperer lists its class under refs.objects as well: the refs' own vetting refuses it, before any import.
    dest = tmp_path / "listed"
    shutil.copytree(extracts["module"], dest)
    run = json.loads((dest / "run.json").read_text())
    run["config"]["module"]["class"] = _REFS["stdlib"][0]
    run["refs"]["objects"] = [*run["refs"].get("objects", []), _REFS["stdlib"][0]]
    (dest / "run.json").write_text(json.dumps(run))
    reseal(dest)
    (got,) = replay_each([dest])
    assert got["exit"] == 3 and "standard library" in got["output"], got
    assert got["imported"] == [], "the module the bundle names was never imported"


@pytest.mark.slow
def test_an_op_extract_naming_a_file_touching_op_is_refused_and_runs_nothing(extracts, tmp_path, replay_each):
    target = tmp_path / "outside.bin"
    call = json.dumps({"args": [str(target), True, 1 << 20], "kwargs": {}})
    evil = _copy(extracts, "op", tmp_path / "evil",
                 lambda spec: spec["attrs"].update(op="aten.from_file.default", call=call))
    got, genuine = replay_each([evil, extracts["op"]])
    assert genuine["exit"] == 1, "the genuine op-level extract reproduces"
    assert got["exit"] == 3 and "config.module.attrs.op" in got["output"], got
    assert "aten.from_file.default is not a pure tensor op" in got["output"] and "filename" in got["output"], got
    assert not target.exists(), "aten.from_file was never run"


@pytest.mark.slow
def test_op_repro_refuses_an_op_json_naming_a_file_touching_op(extracts, tmp_path):
    out = _copy(extracts, "op", tmp_path / "evil")
    script = out / "extract" / "op_repro.py"
    target = tmp_path / "outside.bin"
    spec = json.loads((out / "extract" / "op.json").read_text())
    spec.update(op="aten.from_file.default", args=[str(target), True, 1 << 20], kwargs={})
    spec.pop("raises", None)
    (out / "extract" / "op.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "aten.from_file.default is not a pure tensor op" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not target.exists()
    # (test_extract runs a genuine op_repro.py of this case: exit 1, REPRODUCED)


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


def test_extract_knows_which_classes_its_repro_may_build(projects):
    """A class of an installed package (not torch's layers) is one rk_extract refuses: extract finds it first."""
    from torch.ao.nn.quantized import FloatFunctional

    from reprokit.extract import _foreign, _module_spec

    zoo = projects("rk_extract_zoo")
    ok = torch.nn.Sequential(torch.nn.Linear(2, 2), zoo.UnstableSoftmax(), torch.nn.ModuleDict({"n": torch.nn.ReLU()}))
    assert _foreign(_module_spec(ok, [])) is None
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(FloatFunctional()))
    assert _foreign(_module_spec(mixed, [])) == "torch.ao.nn.quantized.modules.functional_modules.FloatFunctional"
