from __future__ import annotations

import ast
import functools
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PROJECTS = Path(__file__).parent / "projects"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m "not slow"`` (the quick local run), a test module marked slow as a whole (a module-level
    ``pytestmark`` holding ``pytest.mark.slow``) is not even imported: every test in it would be deselected anyway, and
    importing the Lightning, transformers and accelerate modules alone costs each xdist worker about 10 s of CPU. Their
    tests are then missing from the "deselected" count. Any other ``-m`` (and none, as in CI) collects them as usual."""
    if " ".join(str(config.getoption("markexpr", "") or "").split()) != "not slow":
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return _marked_slow_as_a_whole(collection_path) or None


@functools.cache
def _marked_slow_as_a_whole(path: Path) -> bool:
    """Whether ``path`` assigns a module-level ``pytestmark`` that holds ``pytest.mark.slow`` (read, not imported)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return any(isinstance(n, ast.Attribute) and ast.unparse(n) == "pytest.mark.slow" for n in ast.walk(node.value))
    return False


@pytest.fixture
def projects(monkeypatch):
    """Import helper for the user projects in tests/projects (as a user's own modules)."""
    monkeypatch.syspath_prepend(str(PROJECTS))

    def load(name: str):
        return importlib.import_module(name)

    return load


@pytest.fixture(scope="session")
def shared_nan_bundle(tmp_path_factory) -> Iterator[Path]:
    """One valid bundle whose failure is a NaN loss, recorded once per test process (each xdist worker): rk_mlp,
    ``rk_testing.NAN_STEPS`` steps, a NaN in one input at step ``NAN_STEP``, a snapshot every ``NAN_SNAPSHOT_EVERY``.
    Shared, so read-only: a test that changes a bundle (or writes into its folder) takes ``nan_bundle``, a copy. Its
    files are checked at the end of the session, and a change fails the run naming this fixture."""
    from rk_testing import record_mlp_nan, tree_digest

    bundle = record_mlp_nan(tmp_path_factory.mktemp("shared_nan") / "repros")
    before = tree_digest(bundle.parent)
    yield bundle
    assert tree_digest(bundle.parent) == before, (
        f"a test changed the shared NaN bundle {bundle} (or its folder): tests that change a bundle take the "
        "nan_bundle fixture (a copy) instead of shared_nan_bundle")


@pytest.fixture
def nan_bundle(shared_nan_bundle: Path, tmp_path: Path) -> Path:
    """A fresh copy of ``shared_nan_bundle`` under ``tmp_path / "repros"``, free to change."""
    from rk_testing import copy_bundle

    return copy_bundle(shared_nan_bundle, tmp_path / "repros")


@pytest.fixture(scope="session")
def fork_server() -> object:
    """This test process's fork server (each xdist worker has one), shared: :func:`rk_forked.shared`, a
    :class:`rk_forked.ForkedRuns` started with this process's environment (this checkout first on ``PYTHONPATH``). A
    test that runs an example script or a ``python -m reprokit`` command in a process of its own, where the fresh
    interpreter's start-up is not what it tests, forks it from there (``fork_server.capture(...)``,
    ``fork_server.reprokit(...)``) instead of paying a torch import per process."""
    from rk_forked import shared

    return shared()


@pytest.fixture(scope="session")
def bisect_runner() -> Iterator[object]:
    """One ``IsolatedRunner(empty_cwd=True)`` per test process, passed as ``bisect_commits(runner=...)``: the
    bisections of the tests that take it fork their probes from one server (torch imported once). Tests of what a
    bisection does on its own (it starts and stops its server, no process outlives it) leave it out."""
    from reprokit.isolation import IsolatedRunner

    with IsolatedRunner(empty_cwd=True) as runner:
        yield runner


@pytest.fixture(autouse=True)
def _restore_global_state():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    for name in [n for n in sys.modules if n.startswith("_reprokit_script_")]:
        del sys.modules[name]
