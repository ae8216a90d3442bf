from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

PROJECTS = Path(__file__).parent / "projects"


@pytest.fixture
def projects(monkeypatch):
    """Import helper for the user projects in tests/projects (as a user's own modules)."""
    monkeypatch.syspath_prepend(str(PROJECTS))

    def load(name: str):
        return importlib.import_module(name)

    return load


@pytest.fixture(autouse=True)
def _restore_global_state():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    for name in [n for n in sys.modules if n.startswith("_reprokit_script_")]:
        del sys.modules[name]
