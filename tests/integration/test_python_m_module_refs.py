"""Training code run with ``python -m``: a package's module (``python -m mypkg.train``), a package's ``__main__.py``
(``python -m mypkg``) and a top-level module (``python -m train``) are recorded as module refs, with the package's
folders in the code snapshot, so the bundle replays from anywhere, under ``--code`` and from ``repro.py``.

Before, ``__main__`` was always recorded as a script (``train.py:build``) with the package's files flattened into
``code/``: replay failed with ``No module named 'mypkg'`` (exit 125) however it was run.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from reprokit.cli import main
from reprokit.code import _module_name, check_refs
from reprokit.errors import BundleError

ROOT = Path(__file__).resolve().parents[2]

MODEL = textwrap.dedent('''
    import torch

    class Net(torch.nn.Linear):
        def __init__(self):
            super().__init__(4, 1)
''')

DATA = textwrap.dedent('''
    import torch

    def make_data(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=g)
        if step == 17:
            x[0, 0] = float("inf")
        return {"x": x, "y": x.sum(-1)}
''')

# IMPORTS is filled in per layout: a relative import and an absolute one of the package, or plain top-level ones.
TRAIN = textwrap.dedent('''
    import sys
    import torch
    import reprokit
    IMPORTS

    def build(config):
        torch.manual_seed(0)
        model = Net()
        return reprokit.TrainState(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=config["lr"]))

    def train_step(state, batch):
        loss = torch.nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        return loss

    if __name__ == "__main__":
        cfg = {"lr": 0.01}
        rec = reprokit.Recorder(build(cfg), train_step, build=build, config=cfg, out_dir=sys.argv[1],
                                snapshot_every=10)
        try:
            for step in range(30):
                rec.step(make_data(step))
        except reprokit.TrainingFailure as e:
            print(e.bundle)
            sys.exit(7)
''')

PKG_IMPORTS = "from .model import Net\nfrom mypkg.data import make_data"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _package(project: Path, main: str = "train.py") -> None:
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "model.py").write_text(MODEL)
    (project / "mypkg" / "data.py").write_text(DATA)
    (project / "mypkg" / main).write_text(TRAIN.replace("IMPORTS", PKG_IMPORTS))


def _record(forked, project: Path, module: str, out: Path) -> Path:
    """``python -m MODULE OUT`` from ``project``, forked from the test process's fork server (``runpy.run_module``
    as ``-m`` does: ``__main__.__spec__`` names the module, the working directory first on ``sys.path``)."""
    proc = forked.capture([out], module=module, cwd=project, env=_env(), replace_env=True, timeout=300)
    assert proc.returncode == 7, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1])


def _reprokit(*args: str, cwd: Path) -> Result:
    """The CLI in this process (no torch import per call), run from ``cwd``."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(main, list(args))
    finally:
        os.chdir(here)


def _code_files(bundle: Path) -> list[str]:
    code = bundle / "code"
    return sorted(p.relative_to(code).as_posix() for p in code.rglob("*.py"))


def _assert_replays(bundle: Path, cwd: Path, *extra: str) -> None:
    proc = _reprokit("replay", str(bundle), "--json", *extra, cwd=cwd)
    assert proc.exit_code == 1, proc.output
    report = json.loads(proc.stdout)
    assert report["failure"]["step"] == 17 and report["fidelity"]["bit_exact"]


@pytest.mark.slow
def test_package_module_run_with_dash_m_replays_from_anywhere(tmp_path, fork_server):
    project = tmp_path / "proj"
    _package(project)
    bundle = _record(fork_server, project, "mypkg.train", tmp_path / "repros")

    refs = json.loads((bundle / "run.json").read_text())["refs"]
    assert refs["build"] == {"module": "mypkg.train", "qualname": "build"}
    assert refs["step"] == {"module": "mypkg.train", "qualname": "train_step"}
    # The package keeps its folder, relative to the folder `-m` found it in (the project root).
    assert _code_files(bundle) == ["mypkg/__init__.py", "mypkg/data.py", "mypkg/model.py", "mypkg/train.py"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _assert_replays(bundle, elsewhere)
    _assert_replays(bundle, project)  # the live package on the path does not get in the way

    # Under --code, with the entries `inspect` lists.
    shown = _reprokit("inspect", str(bundle), cwd=elsewhere)
    assert shown.exit_code == 0, shown.output
    m = re.search(r"refs\s+build (\S+), step (\S+)", shown.stdout)
    assert m, shown.stdout
    assert m.groups() == ("mypkg.train:build", "mypkg.train:train_step")
    entry = f"build={m.group(1)},step={m.group(2)}"
    _assert_replays(bundle, elsewhere, "--code", str(project), "--entry", entry)
    # The file names a `python train.py` script would have: refused, with the module names to use instead.
    habit = _reprokit("replay", str(bundle), "--code", str(project), "--entry",
                      "build=train.py:build,step=train.py:train_step", cwd=elsewhere)
    assert habit.exit_code == 2, habit.output
    assert "named by its module: mypkg.train:" in habit.output and f"--entry {entry}" in habit.output
    # The package folder itself is not the project root: said, exit 125, nothing imported.
    wrong = _reprokit("replay", str(bundle), "--code", str(project / "mypkg"), "--entry", entry, cwd=elsewhere)
    assert wrong.exit_code == 125, wrong.output
    assert "does not hold the bundle's code" in wrong.output


@pytest.mark.slow
def test_package_main_run_with_dash_m_replays(tmp_path, fork_server):
    project = tmp_path / "proj"
    _package(project, main="__main__.py")
    bundle = _record(fork_server, project, "mypkg", tmp_path / "repros")
    refs = json.loads((bundle / "run.json").read_text())["refs"]
    assert refs["build"] == {"module": "mypkg.__main__", "qualname": "build"}
    assert _code_files(bundle) == ["mypkg/__init__.py", "mypkg/__main__.py", "mypkg/data.py", "mypkg/model.py"]
    _assert_replays(bundle, tmp_path)


@pytest.mark.slow
def test_top_level_module_run_with_dash_m_replays(tmp_path, fork_server):
    project = tmp_path / "proj"
    project.mkdir()
    (project / "model.py").write_text(MODEL)
    (project / "data.py").write_text(DATA)
    (project / "train.py").write_text(TRAIN.replace("IMPORTS", "from model import Net\nfrom data import make_data"))
    bundle = _record(fork_server, project, "train", tmp_path / "repros")
    refs = json.loads((bundle / "run.json").read_text())["refs"]
    assert refs["build"] == {"module": "train", "qualname": "build"}
    assert _code_files(bundle) == ["data.py", "model.py", "train.py"]
    _assert_replays(bundle, tmp_path)
    _assert_replays(bundle, tmp_path, "--code", str(project), "--entry", "build=train:build,step=train:train_step")


def test_a_main_module_ref_is_vetted_like_any_other():
    assert _module_name("mypkg.__main__") and _module_name("a.b.__main__") and _module_name("train")
    # Only a last __main__ under a package: no bare __main__, no other dunder part.
    assert not _module_name("__main__") and not _module_name("mypkg.__init__")
    assert not _module_name("__main__.train") and not _module_name("mypkg.__main__.x")
    for module in ("os.__main__", "json.__main__"):  # the standard library's __main__ stays refused
        ref = {"module": module, "qualname": "main"}
        with pytest.raises(BundleError, match="standard library"):
            check_refs({"build": ref, "step": ref}, snapshot=None, code=None)
