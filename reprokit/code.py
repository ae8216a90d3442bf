"""Where ``build`` and the step function live, and how to import them again.

A *ref* names a module-level function: ``{"module": "train", "qualname": "build"}``
or, for a script run as ``__main__``, ``{"script": "train.py", "qualname": "build"}``
(path relative to the project root). The code snapshot copies the project's own
imported source files (never site-packages) so replay works without the repo.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from reprokit.errors import CaptureError, CodeLoadError

_PACKAGE_DIR = Path(__file__).resolve().parent
MAX_CODE_BYTES = 20 * 1024 * 1024


def ref_of(fn: Callable, role: str) -> tuple[dict[str, Any], Path | None]:
    """The ref for ``fn`` and its project root (``None`` for reprokit's own code).

    Raises:
        CaptureError: when ``fn`` is not a module-level function replay could import.
    """
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not qualname or not module or "<" in qualname:
        raise CaptureError(
            f"{role}={fn!r} must be a function defined at module level (not a lambda or a nested function), "
            "so that replay can import it by name"
        )
    mod = sys.modules.get(module)
    source = getattr(mod, "__file__", None)
    if module == "__main__":
        if not source:
            raise CaptureError(f"{role} is defined in an interactive session; move it into a .py file so replay can import it")
        path = Path(source).resolve()
        return {"script": path.name, "qualname": qualname}, path.parent
    if source is None:
        raise CaptureError(f"{role}: module {module!r} has no source file; replay could not import it")
    path = Path(source).resolve()
    if _is_library(path):
        return {"module": module, "qualname": qualname}, None
    depth = module.count(".") + (2 if path.name == "__init__.py" else 1)
    return {"module": module, "qualname": qualname}, path.parents[depth - 1]


def _is_library(path: Path) -> bool:
    parts = set(path.parts)
    return "site-packages" in parts or "dist-packages" in parts or _PACKAGE_DIR in path.parents


def snapshot_files(root: Path, extra: list[Path] = ()) -> list[Path]:  # type: ignore[assignment]
    """Source files under ``root`` that the running program imported (plus ``extra``)."""
    root = root.resolve()
    found = {p.resolve() for p in extra}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        # Relative or vanished __file__s (torch._classes has one) are not the user's source.
        if not f or not f.endswith(".py") or not os.path.isabs(f):
            continue
        p = Path(f).resolve()
        if root in p.parents and not _is_library(p) and p.is_file():
            found.add(p)
    return sorted(found)


@contextlib.contextmanager
def imported(code_dir: Path | None) -> Iterator[None]:
    """Make ``code_dir`` the first place imports look, for the duration of a replay.

    Modules of the same top-level names already imported (say, the live copy of
    ``train``) are set aside and put back afterwards, so a bundle's snapshot and
    the caller's own code never mix.
    """
    saved_path = list(sys.path)
    saved_bytecode = sys.dont_write_bytecode
    # Importing from a bundle must not write __pycache__ into it: that would make it fail verification.
    sys.dont_write_bytecode = True
    evicted: dict[str, Any] = {}
    if code_dir is not None:
        code_dir = code_dir.resolve()
        tops = {p.stem if p.suffix == ".py" else p.name for p in code_dir.iterdir()
                if p.suffix == ".py" or (p.is_dir() and not p.name.startswith("."))}
        for name in list(sys.modules):
            if name.split(".")[0] in tops:
                evicted[name] = sys.modules.pop(name)
        sys.path.insert(0, str(code_dir))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path[:] = saved_path
        sys.dont_write_bytecode = saved_bytecode
        if code_dir is not None:
            for name, mod in list(sys.modules.items()):
                f = getattr(mod, "__file__", None) or ""
                if name.startswith("_reprokit_script_") or (f and code_dir in Path(f).resolve().parents):
                    del sys.modules[name]
            sys.modules.update(evicted)


def resolve(ref: dict[str, Any], code_dir: Path | None) -> Callable:
    """Import the function a ref names. Call inside :func:`imported`.

    Raises:
        CodeLoadError: saying what could not be imported and from where.
    """
    where = f" from {code_dir}" if code_dir else ""
    try:
        if "script" in ref:
            if code_dir is None:
                raise CodeLoadError(f"{ref['qualname']} lives in the script {ref['script']}; pass --code DIR")
            path = code_dir / ref["script"]
            name = "_reprokit_script_" + path.stem
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None or not path.exists():
                raise CodeLoadError(f"cannot load the script {path}")
            sys.path.insert(0, str(path.parent))
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(ref["module"])
        obj: Any = module
        for part in ref["qualname"].split("."):
            obj = getattr(obj, part)
        return obj
    except CodeLoadError:
        raise
    except BaseException as e:  # a syntax error or a failing import in the user's code
        if isinstance(e, KeyboardInterrupt):
            raise
        target = ref.get("script") or ref.get("module")
        raise CodeLoadError(
            f"cannot import {target}:{ref['qualname']}{where}: {type(e).__name__}: {e}. "
            "Check the module imports on its own, or point --code at a checkout that has it."
        ) from None


def git_info(root: Path | None) -> dict[str, Any] | None:
    """Commit, dirty flag and diff of the repository holding ``root`` (None if none)."""
    if root is None:
        return None
    try:
        import git
    except ImportError:
        return None
    try:
        repo = git.Repo(root, search_parent_directories=True)
        head = repo.head.commit.hexsha if repo.head.is_valid() else None
        diff = repo.git.diff("HEAD") if head else ""
        return {
            "root": str(repo.working_tree_dir),
            # Where the project root sits inside the repository: commit bisection imports from there.
            "code_subdir": relative(Path(root).resolve(), Path(str(repo.working_tree_dir)).resolve()),
            "commit": head,
            "branch": None if repo.head.is_detached else repo.active_branch.name,
            "dirty": repo.is_dirty(untracked_files=True),
            "diff": diff[:1_000_000],
            "untracked": repo.untracked_files[:200],
        }
    except Exception:  # not a repo, or git missing: the bundle simply has no git info
        return None


def relative(path: Path, root: Path) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")
