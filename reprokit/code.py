"""Where ``build`` and the step function live, and how to import them again.

A *ref* names a module-level function: ``{"module": "train", "qualname": "build"}``
or, for a script run as ``python train.py``, ``{"script": "train.py", "qualname": "build"}``
(path relative to the project root); ``__main__`` run as ``python -m mypkg.train`` is the
module ``mypkg.train``, as if imported. The code snapshot copies the project's own
imported source files (never site-packages) so replay works without the repo.

``run.json`` comes from whoever sent the bundle, so :func:`check_refs` vets its refs
before anything is imported: a ref may only name a file inside the code that replay
runs (the bundle's snapshot, or the ``--code`` folder) or reprokit's own demo.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import keyword
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from reprokit.errors import BundleError, CaptureError, CodeLoadError, ConfigError, ReprokitError

_PACKAGE_DIR = Path(__file__).resolve().parent
# reprokit's own modules a ref may name: the demo's build/step, and the integrations' build/step (which import the
# project's own classes through :func:`resolve_project`). Nothing else of reprokit (its CLI would turn ``config``
# into a command line) and nothing of the standard library or site-packages.
OWN_MODULES = frozenset({"reprokit.demo", "reprokit.integrations.lightning", "reprokit.integrations.transformers"})
MAX_CODE_BYTES = 20 * 1024 * 1024
"""Largest file a code snapshot may hold (``verify`` refuses a larger one before anything reads it)."""
LAZY_IMPORTS = frozenset({
    "triton", "sympy", "networkx", "jinja2", "filelock", "fsspec", "optree", "opt_einsum", "yaml", "setuptools",
    "typing_extensions", "functorch", "torchvision", "torchaudio", "torchtext", "torchdata", "torchao", "torch_xla",
    "tensorboard", "onnx", "onnxscript", "onnxruntime", "scipy", "pandas", "matplotlib", "IPython", "dill", "psutil",
    "packaging", "tabulate", "einops", "apex", "xformers", "flash_attn", "deepspeed", "expecttest", "hypothesis",
    "numba", "cupy", "mpmath", "z3", "pydot", "graphviz", "habana_frameworks", "intel_extension_for_pytorch",
    "safetensors", "numpy", "click", "tqdm", "huggingface_hub", "transformers", "accelerate", "lightning",
    "pytorch_lightning", "lightning_fabric", "torchmetrics", "tokenizers", "datasets", "mkl", "nvidia",
})
"""Top-level names of modules that torch, numpy or reprokit import *if they are installed* (``try: import triton``
... ``except ImportError``), often only later (torch's compiler imports triton at the first compile): a snapshot file
of that name would be imported in their place during replay even where the real one is not installed, so the
shadow check refuses them whether installed or not."""


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
        run_as = _main_module_name(mod)
        if run_as is None:  # `python train.py`: replay loads the file by its path
            path = Path(source).resolve()
            return {"script": path.name, "qualname": qualname}, path.parent
        # `python -m mypkg.train` (or torchrun -m): replay imports mypkg.train, as for a launcher that imports it,
        # from the folder `-m` found the package in; a script ref would lose the package (`from mypkg import ..`).
        module = run_as
    if source is None:
        raise CaptureError(f"{role}: module {module!r} has no source file; replay could not import it")
    path = Path(source).resolve()
    if _is_library(path):
        return {"module": module, "qualname": qualname}, None
    depth = module.count(".") + (2 if path.name == "__init__.py" else 1)
    return {"module": module, "qualname": qualname}, path.parents[depth - 1]


def _main_module_name(main: Any) -> str | None:
    """The name ``__main__`` was run under with ``python -m NAME`` (``__spec__.name``: ``mypkg.train``, or
    ``mypkg.__main__`` for ``python -m mypkg``), when replay can import it by that name; None for a script run by
    its path (``python train.py``, ``runpy.run_path``: no spec) or a name that does not match its file."""
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    source = getattr(main, "__file__", None)
    if not isinstance(name, str) or not isinstance(source, str) or not _module_name(name):
        return None
    # The file must sit where the import system would find that name again (mypkg/train.py for mypkg.train).
    path = Path(source).resolve()
    parts = name.split(".")
    return name if path.suffix == ".py" and list(path.with_suffix("").parts[-len(parts):]) == parts else None


def _module_name(name: Any) -> bool:
    """A module name a ref may hold: dotted identifiers, no dunder part but a last ``__main__`` (``python -m pkg``
    runs ``pkg/__main__.py``)."""
    if not isinstance(name, str):
        return False
    head, _, last = name.rpartition(".")
    return _dotted(head) if last == "__main__" else _dotted(name)


def _is_library(path: Path) -> bool:
    parts = set(path.parts)
    return "site-packages" in parts or "dist-packages" in parts or _PACKAGE_DIR in path.parents


def _real_path(file: str, folders: dict[str, str]) -> str:
    """``os.path.realpath(file)``, each folder resolved once per ``folders`` cache: a process that imported
    transformers holds thousands of modules in a few hundred folders, and resolving every component of every
    module's path took 0.45 s of CPU per call there. The file's own name is resolved only when it is a symbolic
    link, as ``realpath`` would (a path that ends in a separator, ``.`` or ``..`` goes to ``realpath`` whole)."""
    folder, name = os.path.split(file)
    if name in ("", ".", ".."):
        return os.path.realpath(file)
    real = folders.get(folder)
    if real is None:
        real = folders[folder] = os.path.realpath(folder)
    path = os.path.join(real, name)
    return os.path.realpath(path) if os.path.islink(path) else path


def _under(path: str, folder: str) -> bool:
    """Whether the resolved ``path`` lies inside the resolved ``folder`` (``Path(folder) in Path(path).parents``)."""
    return path != folder and path.startswith(folder if folder.endswith(os.sep) else folder + os.sep)


def snapshot_files(root: Path, extra: list[Path] = ()) -> list[Path]:  # type: ignore[assignment]
    """Source files under ``root`` that the running program imported (plus ``extra``)."""
    root = root.resolve()
    found = {p.resolve() for p in extra}
    folders: dict[str, str] = {}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        # Relative or vanished __file__s (torch._classes has one) are not the user's source.
        if not isinstance(f, str) or not f.endswith(".py") or not os.path.isabs(f):
            continue
        real = _real_path(f, folders)
        if _under(real, str(root)):
            p = Path(real)
            if not _is_library(p) and p.is_file():
                found.add(p)
    return sorted(found)


# --- checking refs before anything is imported ---------------------------------------

def check_refs(refs: Any, *, snapshot: Path | None, code: Path | None, source: str | Path = "run.json") -> None:
    """Refuse refs that would import anything but the project's own code. Imports nothing.

    Each ref in ``refs`` (build, step, predicates) must name a module-level object by dotted
    identifiers, in a module or script file that lies inside ``snapshot`` (the bundle's
    ``code/``) and, when the user passed ``--code``, inside ``code`` too; or in reprokit's own
    demo (:data:`OWN_MODULES`). The snapshot (and each folder of it that a script ref puts on the
    import path) must not hold top-level names that shadow the standard library, reprokit or an
    installed package, imported yet or not.

    Raises:
        BundleError: (exit 3) a malformed ref, one that names a module of the standard library
            or site-packages, a file outside the bundle's snapshot, a bundle without a snapshot
            whose refs need one, or a snapshot that shadows installed modules.
        CodeLoadError: (exit 125) the ``code`` folder does not hold the module or script a
            valid ref names (a checkout without the project, like ``git bisect run``'s skip).
    """
    if snapshot is not None:
        snapshot = snapshot.resolve()
        _check_snapshot_names(snapshot, source, own=_own_tops(refs))
    if not isinstance(refs, dict) or "build" not in refs or "step" not in refs or \
            not isinstance(refs.get("predicates", []), list):
        raise _invalid(source, "refs", refs, "must be {\"build\": REF, \"step\": REF, \"predicates\": [REF|null, ...]}")
    if not isinstance(refs.get("objects", []), list):
        raise _invalid(source, "refs.objects", refs["objects"], "must be a list of refs")
    named = [("refs.build", refs["build"]), ("refs.step", refs["step"])] + [
        (f"refs.predicates[{i}]", r) for i, r in enumerate(refs.get("predicates", [])) if r is not None] + [
        (f"refs.objects[{i}]", r) for i, r in enumerate(refs.get("objects", []))]
    project = []
    for field, ref in named:
        kind, target = _check_shape(source, field, ref)
        if kind == "module" and target.split(".")[0] == "reprokit":
            if target not in OWN_MODULES or _module_file(_PACKAGE_DIR.parent, target) is None:
                raise _invalid(source, field, ref, f"names reprokit's module {target}; of reprokit, refs may only "
                                                   f"name {', '.join(sorted(OWN_MODULES))}")
            continue
        project.append(target)
        top = target.split(".")[0]
        if kind == "module" and (lib := _installed(top, search=False)):
            raise _invalid(source, field, ref, f"names {target}, a module of {lib}, not of the project")
        if snapshot is not None and _find(snapshot, kind, target) is None:
            raise _invalid(source, field, ref, f"names {target}, which is not in the bundle's code snapshot "
                                               f"{snapshot}")
        if snapshot is not None and kind == "script" and "/" in target:
            # Replay puts a script's own folder on the import path too: its names must not shadow either.
            _check_snapshot_names(snapshot, source, (snapshot / target).parent)
        if (code is not None and _find(code.resolve(), kind, target) is None) or (snapshot is None and code is None):
            if kind == "module" and (lib := _installed(top, search=True)):
                raise _invalid(source, field, ref, f"names {target}, a module of {lib}, not of the project")
            if code is None:
                raise _invalid(source, field, ref, f"names the project's {target}, but the bundle has no code "
                                                   "snapshot (code/)", fix="Pass --code DIR, a checkout that holds it.")
            want = target if kind == "script" else " or ".join(_candidates(target))
            raise CodeLoadError(f"--code {code} does not hold the bundle's code: no {want} in it, links to files "
                                f"outside it do not count ({field} names "
                                f"{ref_label(ref)}). Point --code at the project folder of a checkout (the one "
                                "that holds the recorded module), or drop --code to replay the bundle's snapshot.")
    if code is not None and not project:
        raise CodeLoadError(f"--code {code}: this bundle's build and step are reprokit's own "
                            f"({ref_label(refs['build'])}, {ref_label(refs['step'])}), so nothing would be imported from "
                            f"{code}; drop --code to replay it.")


# --- confirming the entry points that run from a --code checkout -------------------

_ROLES = {"build": "build", "step": "step", "predicates": "predicate", "objects": "object"}


def entry_points(refs: dict[str, Any]) -> list[tuple[str, str]]:
    """``(role, "module:qualname")`` of every ref in ``refs`` that imports the project's code (not reprokit's own):
    build, step, each predicate and each object (a class an integration's build makes)."""
    out = []
    for key, role in _ROLES.items():
        items = refs.get(key)
        for ref in items if isinstance(items, list) else [items]:
            if ref is not None and ref.get("module") not in OWN_MODULES:
                out.append((role, ref_label(ref)))
    return out


def parse_entries(values: Sequence[str]) -> set[tuple[str | None, str]]:
    """``--entry`` values (``build=train:build,step=train:train_step``; repeatable; a role may be left out) as
    ``{(role or None, "module:qualname")}``.

    Raises:
        ConfigError: (exit 2) an item that is not ``[ROLE=]MODULE:QUALNAME`` or names an unknown role.
    """
    out: set[tuple[str | None, str]] = set()
    for value in values:
        for item in (x.strip() for x in value.split(",")):
            if not item:
                continue
            role, _, label = item.rpartition("=")
            if (role and role not in _ROLES.values()) or label.count(":") != 1:
                raise ConfigError(f"--entry {item!r}: expected [ROLE=]MODULE:QUALNAME with ROLE one of "
                                  f"{', '.join(_ROLES.values())}, e.g. --entry build=train:build,step=train:train_step")
            out.add((role or None, label))
    return out


def confirm_entries(refs: Any, entries: Sequence[str], code: Path | str | None, *, snapshot: Path | None,
                    source: str | Path = "run.json") -> None:
    """Refuse to run functions of the user's ``--code`` checkout that the user did not name with ``--entry``.

    With ``--code DIR`` the code is the user's own, but which of its functions run is said by the bundle's run.json,
    and a bundle may come from anyone: unchecked, it could call any function of the checkout (``scripts.deploy:
    main``) with a config of its choosing. No file in the bundle can vouch for a ref (its snapshot and listing are
    the sender's too), so the user does: every build, step, predicate and object ref that would be imported from
    DIR must be among ``entries``. Call it on the same opened bundle that is then replayed. Imports nothing.
    ``code`` None: DIR is each commit's checkout (``bisect commits``), checked against the snapshot only here.

    Raises:
        BundleError, CodeLoadError: what :func:`check_refs` raises, first (an invalid bundle stays exit 3).
        ReprokitError: (exit 2) a ref the user did not confirm; the message lists the refs and the ``--entry`` to
            pass after checking them.
    """
    if code is not None or snapshot is not None:
        check_refs(refs, snapshot=snapshot, code=Path(code) if code is not None else None, source=source)
    elif not isinstance(refs, dict):
        return  # malformed: each commit's replay refuses it (exit 3) before anything is imported
    confirmed = parse_entries(entries)
    wanted = entry_points(refs)
    missing = [(role, label) for role, label in wanted
               if (role, label) not in confirmed and (None, label) not in confirmed]
    if not missing:
        return
    listing = ", ".join(f"{role} = {label}" for role, label in wanted)
    arg = ",".join(f"{role}={label}" for role, label in wanted)
    where = f"--code {code}" if code is not None else "each commit's checkout"
    given = ", ".join(f"{r} = {lbl}" if r else lbl for r, lbl in sorted(confirmed, key=lambda e: (e[0] or "", e[1])))
    # `train:build` given for a script's `train.py:build`: the one mix-up worth naming.
    as_script = {f"{m.replace('.', '/')}.py:{q}" for _, lbl in confirmed for m, _, q in [lbl.partition(":")]}
    script = next((lbl for _, lbl in missing if lbl in as_script), None)
    # ... and the other way round: `train.py:build` given for `mypkg.train:build` (run as `python -m mypkg.train`).
    as_module = [(m[:-3].replace("/", "."), q) for _, lbl in confirmed for m, _, q in [lbl.partition(":")]
                 if m.endswith(".py")]
    module = next((lbl for _, lbl in missing for m, q in as_module
                   if lbl == f"{m}:{q}" or lbl.endswith(f".{m}:{q}")), None)
    said = (f"; a script run as `python FILE.py` is named by its file: {script}" if script else
            f"; a module run as `python -m PACKAGE.MODULE` (or imported) is named by its module: {module}"
            if module else "")
    hint = f" (you passed {given}{said})" if confirmed else ""
    raise ReprokitError(
        f"{where}: {source} asks to run {listing} from your code; not confirmed with --entry: "
        f"{', '.join(f'{r} = {lbl}' for r, lbl in missing)}{hint}. A bundle may come from anyone, so it does not choose "
        f"which functions of your code run. Check that these are your training entry points, then pass: --entry {arg}")


def entry_args(refs: dict[str, Any]) -> list[str]:
    """``["--entry", "build=...,step=..."]`` for a subprocess replaying ``refs`` already confirmed here (nothing
    when no ref imports project code)."""
    wanted = entry_points(refs)
    return ["--entry", ",".join(f"{role}={label}" for role, label in wanted)] if wanted else []


_IDENT_ERR = "must be dotted Python identifiers (no dunder names)"


def _check_shape(source: str | Path, field: str, ref: Any) -> tuple[str, str]:
    """``("module" | "script", target)`` of a well-formed ref."""
    if not isinstance(ref, dict) or set(ref) not in ({"module", "qualname"}, {"script", "qualname"}):
        raise _invalid(source, field, ref, 'must be {"module": NAME, "qualname": NAME} or '
                                           '{"script": PATH, "qualname": NAME}')
    if not _dotted(ref["qualname"]):
        raise _invalid(source, field, ref, f"qualname {_IDENT_ERR}")
    if "module" in ref:
        if not _module_name(ref["module"]):
            raise _invalid(source, field, ref, f"module {_IDENT_ERR}")
        return "module", ref["module"]
    script = ref["script"]
    parts = script.split("/") if isinstance(script, str) else []
    if not parts or not script.endswith(".py") or "\\" in script or ":" in script or \
            any(p in ("", ".", "..") for p in parts):
        raise _invalid(source, field, ref, "script must be a relative path to a .py file inside the code "
                                           "folder (no absolute path, no '..')")
    return "script", script


def _dotted(name: Any) -> bool:
    return isinstance(name, str) and all(
        p.isidentifier() and not keyword.iskeyword(p) and not (p.startswith("__") and p.endswith("__"))
        for p in name.split("."))


def _invalid(source: str | Path, field: str, ref: Any, why: str,
             fix: str = "Re-record it, or get it again from whoever made it.") -> BundleError:
    return BundleError(
        f"{source}: {field} = {ref_label(ref)} {why}. Replay imports only the bundle's code snapshot, the --code "
        f"folder, or reprokit's demo, so this bundle is invalid and nothing was imported. {fix}",
        [{"file": "run.json", "problem": f"{field} {why}"}])


def ref_label(ref: Any) -> str:
    """``module:qualname`` or ``script.py:qualname`` (the raw value, cut short, if malformed)."""
    if isinstance(ref, dict) and isinstance(ref.get("qualname"), str):
        where = ref.get("module", ref.get("script"))
        if isinstance(where, str):
            return f"{where}:{ref['qualname']}"
    return repr(ref)[:200]


def _candidates(module: str) -> list[str]:
    base = module.replace(".", "/")
    return [base + "/__init__.py", base + ".py"]


def _find(root: Path, kind: str, target: str) -> Path | None:
    """The file inside ``root`` a module or script ref loads (also its packages' ``__init__``s inside)."""
    if kind == "script":
        return _inside(root / target, root)
    return _module_file(root, target)


def _module_file(root: Path, module: str) -> Path | None:
    parts = module.split(".")
    base = root
    for part in parts[:-1]:
        base = base / part
        init = base / "__init__.py"
        if not base.is_dir() or (init.exists() and _inside(init, root) is None):
            return None
    # A package wins over a module of the same name, as in the import system.
    for rel in _candidates(parts[-1]):
        if (base / rel).is_file():
            return _inside(base / rel, root)
    return None


def _inside(path: Path, root: Path) -> Path | None:
    """``path`` if it is a file that lies inside ``root`` once links are followed."""
    real = path.resolve()
    return real if real.is_file() and root.resolve() in real.parents else None


def _installed(top: str, search: bool, skip: Path | None = None) -> str | None:
    """What outside the project a top-level module name belongs to (None: nothing known).

    Always: the standard library, reprokit, a package this process already imported from
    site-packages (setting it aside would mix two copies). With ``search``, also a package that
    ``sys.path``'s site-packages folders would supply, or that an installed distribution says it
    provides (an editable install, say), found without running anything; ``skip``: a folder of
    ``sys.path`` not to search (the code snapshot itself). A module of the project's own folder on
    ``sys.path`` (the live copy of ``train``) is not counted: the snapshot stands in for it.
    """
    if top == "reprokit":
        return "reprokit itself"
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return "the standard library"
    if top in LAZY_IMPORTS:
        return ("an optional dependency that torch, numpy or reprokit import when it is there (installed here or "
                "not: found in the snapshot, it would run during replay)")
    mod = sys.modules.get(top)
    locs: list[Any] = []
    if mod is not None:
        locs = [getattr(mod, "__file__", None), *(getattr(mod, "__path__", None) or [])]
    elif search:
        path = [p for p in sys.path if skip is None or Path(p or ".").resolve() != skip]
        try:  # searches sys.path's folders only: runs nothing
            spec = importlib.machinery.PathFinder.find_spec(top, path)
        except (ImportError, ValueError):
            spec = None
        locs = [spec.origin, *(spec.submodule_search_locations or [])] if spec else []
    for loc in locs:
        if isinstance(loc, str) and os.path.isabs(loc) and _is_library(Path(loc)):
            return f"an installed package ({loc})"
    if search and (dists := [d for d in _distributions().get(top, []) if not _editable(d)]):
        return f"the installed distribution {', '.join(sorted(set(dists)))}"
    return None


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    """Top-level import names -> the installed distributions that provide them (read once: ~0.3 s). Catches an
    install outside site-packages (``pip install --target DIR`` on ``PYTHONPATH``)."""
    try:
        return importlib.metadata.packages_distributions()
    except Exception:  # a broken distribution's metadata must not stop replay; site-packages was searched above
        return {}


def _editable(dist: str) -> bool:
    """Whether ``dist`` is an editable install (``pip install -e .``): the project's own source folder, which the
    snapshot stands in for (as for the project folder on ``sys.path``), not a package it could shadow."""
    try:
        text = importlib.metadata.distribution(dist).read_text("direct_url.json")
        return bool(json.loads(text or "{}").get("dir_info", {}).get("editable"))
    except Exception:  # unreadable metadata: an ordinary install
        return False


def _top_names(code_dir: Path) -> dict[str, Path]:
    return {(p.stem if p.suffix == ".py" else p.name): p for p in sorted(code_dir.iterdir())
            if (p.suffix == ".py" and p.is_file()) or (p.is_dir() and not p.name.startswith("."))}


def _own_tops(refs: Any) -> set[str]:
    """The top-level names the build and step refs themselves live in (``mypkg`` of ``mypkg.train:build``, ``train``
    of ``train.py:build``): the project's own code, which replay runs by consent. The project installed with ``pip
    install .`` beside its checkout is no shadow of it; its standard-library and reprokit names are refused with
    the refs themselves."""
    tops: set[str] = set()
    for key in ("build", "step"):
        ref = refs.get(key) if isinstance(refs, dict) else None
        if isinstance(ref, dict) and isinstance(ref.get("module"), str):
            tops.add(ref["module"].split(".")[0])
        elif isinstance(ref, dict) and isinstance(ref.get("script"), str):
            tops.add(Path(ref["script"].split("/")[0]).stem)
    return {t for t in tops if t.isidentifier() and t != "reprokit" and t not in sys.stdlib_module_names}


def _check_snapshot_names(snapshot: Path, source: str | Path, folder: Path | None = None,
                          own: set[str] | frozenset[str] = frozenset()) -> None:
    """Refuse a top-level name in ``folder`` (default: the snapshot; else a folder of it that replay puts on the
    import path) that the standard library, reprokit or an installed package already has, imported yet or not:
    imported from the snapshot in its place, it would run whenever anything imports that name during replay.
    ``own``: names of the project's own code (:func:`_own_tops`), exempt from the installed-package check."""
    folder = folder or snapshot
    for top, p in _top_names(folder).items():
        if top in own and folder == snapshot:
            continue
        lib = _installed(top, search=True, skip=snapshot)
        if lib:
            rel = relative(p, snapshot)
            raise BundleError(
                f"{snapshot}: the code snapshot holds {rel}, which would shadow {top} of {lib} while replay "
                "imports from the snapshot. Replay refuses it (nothing was imported). If the project really has "
                f"a module named {top}, rename it and record again.",
                [{"file": f"code/{rel}", "problem": f"shadows {top} of {lib}"}])


def _protected(name: str, mod: Any) -> bool:
    """A module replay must never set aside: the standard library's, reprokit's, an installed package's."""
    top = name.split(".")[0]
    if top == "reprokit" or top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    f = getattr(mod, "__file__", None)
    return isinstance(f, str) and os.path.isabs(f) and _is_library(Path(f))


# --- importing ----------------------------------------------------------------------

CODE_COPIES_ENV = "REPROKIT_CODE_COPIES"
"""Where :func:`materialize` makes its folders when set (a child process's, see :func:`child_env`)."""


def materialize(files: Mapping[str, bytes]) -> tuple[Path, Callable[[], None]]:
    """Write a code snapshot's verified bytes into a fresh private folder: ``(folder, remove)``.

    ``files`` maps ``code/REL`` to the bytes that hashed right (:meth:`reprokit.bundle.Bundle.code_files`). The
    folder is made by :func:`tempfile.mkdtemp` (mode 0700, a name no one else chose), so what replay imports is what
    was verified: a file swapped in the bundle folder after verification is never read again. ``remove()`` deletes
    the folder (also when called twice).

    Raises:
        BundleError: a path that would leave the folder (verification refuses those first).
    """
    top = Path(tempfile.mkdtemp(prefix="reprokit-code-", dir=os.environ.get(CODE_COPIES_ENV) or None))
    root = top / "code"
    try:
        root.mkdir(mode=0o700)
        for rel, data in files.items():
            parts = rel.split("/")[1:]
            if not parts or any(p in ("", ".", "..") for p in parts):
                raise BundleError(f"{rel}: not a plain path inside code/; nothing was imported",
                                  [{"file": rel, "problem": "unsafe path"}])
            target = root.joinpath(*parts)
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
    except BaseException:
        shutil.rmtree(top, ignore_errors=True)
        raise
    return root, lambda: shutil.rmtree(top, ignore_errors=True)


def child_env(scratch: str | Path) -> dict[str, str]:
    """The environment for a child process that may replay (and so :func:`materialize` a private code copy): its
    copies go under ``scratch``, a folder the parent removes, so a child that is killed (a timeout) or leaves with
    ``os._exit`` (a rank blocked in a collective) leaves no copy behind in the system's temp folder."""
    copies = Path(scratch) / "code-copies"
    copies.mkdir(mode=0o700, exist_ok=True)
    return {**os.environ, CODE_COPIES_ENV: str(copies)}


_ACTIVE: list[tuple[Path | None, tuple[Any, ...]]] = []
"""The code folders of the :func:`imported` contexts now open (the innermost last), each with the object refs
:func:`resolve_project` may import from it."""


@contextlib.contextmanager
def imported(code_dir: Path | None, objects: Sequence[Any] = ()) -> Iterator[None]:
    """Make ``code_dir`` the first place imports look, for the duration of a replay.

    Modules of the same top-level names already imported (say, the live copy of
    ``train``) are set aside and put back afterwards, so a bundle's snapshot and
    the caller's own code never mix. The standard library's, reprokit's and installed
    packages' modules are never set aside (a ``--code`` checkout may hold a ``test/``
    folder); :func:`resolve` checks where each function really came from.
    ``objects``: the bundle's ``refs.objects`` (vetted by :func:`check_refs`, confirmed with ``--entry`` under
    ``--code``), the only classes an integration's build may import meanwhile (:func:`resolve_project`).
    """
    saved_path = list(sys.path)
    saved_bytecode = sys.dont_write_bytecode
    # Importing from a bundle must not write __pycache__ into it: that would make it fail verification.
    sys.dont_write_bytecode = True
    evicted: dict[str, Any] = {}
    _ACTIVE.append((code_dir.resolve() if code_dir is not None else None, tuple(objects)))
    if code_dir is not None:
        code_dir = code_dir.resolve()
        tops = set(_top_names(code_dir))
        for name, mod in list(sys.modules.items()):
            if name.split(".")[0] in tops and not _protected(name, mod):
                evicted[name] = sys.modules.pop(name)
        sys.path.insert(0, str(code_dir))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        _ACTIVE.pop()
        sys.path[:] = saved_path
        sys.dont_write_bytecode = saved_bytecode
        if code_dir is not None:
            folders: dict[str, str] = {}
            for name, mod in list(sys.modules.items()):
                f = getattr(mod, "__file__", None) or ""
                f = os.fspath(f) if isinstance(f, os.PathLike) else f
                if name.startswith("_reprokit_script_") or (
                        isinstance(f, str) and f and _under(_real_path(f, folders), str(code_dir))):
                    del sys.modules[name]
            sys.modules.update(evicted)


_IMPORTING = threading.local()
"""Per thread, the files or modules :func:`resolve` is importing now (``.stack``): a Recorder made meanwhile, in the
importing thread, trains at import time (a Recorder another thread makes then is that thread's own business)."""


def importing_for_replay() -> str | None:
    """The project file or module that replay is importing right now, else None. A :class:`~reprokit.Recorder`
    created meanwhile means the script trains when imported (no ``if __name__ == "__main__":``), which would run
    the whole training again inside every replay."""
    stack = getattr(_IMPORTING, "stack", None)
    return stack[-1] if stack else None


def resolve(ref: dict[str, Any], code_dir: Path | None, field: str = "ref") -> Callable:
    """Import the function a ref names. Call inside :func:`imported`, after :func:`check_refs`.

    Raises:
        CodeLoadError: saying what could not be imported and from where.
        BundleError: the object the ref names is defined outside ``code_dir`` (say ``train:os.system``).
    """
    where = f" from {code_dir}" if code_dir else ""
    own = ref.get("module") in OWN_MODULES
    root = _PACKAGE_DIR if own else code_dir
    if root is None:
        raise CodeLoadError(f"{ref_label(ref)} is the project's own code; pass --code DIR")
    root = root.resolve()
    stack = _IMPORTING.__dict__.setdefault("stack", [])
    stack.append(str(ref.get("script") or ref.get("module")))
    try:
        if "script" in ref:
            path = root / ref["script"]
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
    except CodeLoadError:
        raise
    except BaseException as e:  # a syntax error or a failing import in the user's code
        if isinstance(e, KeyboardInterrupt):
            raise
        target = ref.get("script") or ref.get("module")
        raise CodeLoadError(
            f"cannot import {target}:{ref['qualname']}{where}: {type(e).__name__}: {str(e).rstrip('.')}. "
            "Check the module imports on its own, or point --code at a checkout that has it."
        ) from None
    finally:
        stack.pop()
    if _file_of(module, root) is None:
        raise CodeLoadError(f"{ref_label(ref)} was imported from {getattr(module, '__file__', None)}, not from {root}: "
                            "an installed module of that name was already loaded. Rename the project's module.")
    home = getattr(obj, "__module__", None)
    home_mod = sys.modules.get(home) if isinstance(home, str) else None
    if home_mod is None or _file_of(home_mod, root) is None or (own and home not in OWN_MODULES):
        raise BundleError(
            f"run.json: {field} = {ref_label(ref)} names an object defined in {home!r} "
            f"({getattr(home_mod, '__file__', None) or 'no source file'}), outside {root}. Replay runs only the "
            "project's own functions; this bundle is invalid and the object was not called.",
            [{"file": "run.json", "problem": f"{field} names an object defined outside the code"}])
    return obj


def resolve_project(ref: Any, field: str) -> Any:
    """Import a project object (a class) that an integration's ``build`` finds in run.json's config.

    The config is the bundle's, so the ref alone chooses nothing: it must be one of the bundle's ``refs.objects``
    (those :func:`check_refs` vetted before anything was imported, and that ``--entry`` confirmed under
    ``--code``), as given to the innermost :func:`imported`. It is then vetted again against that code folder: a
    module or script inside it, never the standard library, reprokit or an installed package.

    Raises:
        BundleError: (exit 3) a malformed ref, one that ``refs.objects`` does not list, or one naming code outside
            the replayed code folder; nothing was imported.
        CodeLoadError: no replay in progress, or the import failed.
    """
    code_dir, objects = _ACTIVE[-1] if _ACTIVE else (None, ())
    if code_dir is None:
        raise CodeLoadError(f"config {field} = {ref_label(ref)} names the project's code, but no code folder is "
                            "being replayed (the bundle has no code/ snapshot); pass --code DIR")
    kind, target = _check_shape("run.json", f"config.{field}", ref)
    if ref not in objects:
        listed = ", ".join(ref_label(r) for r in objects) or "none"
        raise _invalid("run.json", f"config.{field}", ref,
                       f"is not among the classes the bundle lists under refs.objects ({listed}), which are the "
                       "only ones checked (and, with --code, confirmed by your --entry) before replay imports "
                       "anything")
    if kind == "module" and (lib := _installed(target.split(".")[0], search=True)):
        raise _invalid("run.json", f"config.{field}", ref, f"names {target}, a module of {lib}, not of the project")
    if _find(code_dir, kind, target) is None:
        raise _invalid("run.json", f"config.{field}", ref, f"names {target}, which is not in {code_dir}")
    return resolve(ref, code_dir, f"config.{field}")


def _file_of(module: Any, root: Path) -> Path | None:
    f = getattr(module, "__file__", None)
    return _inside(Path(f), root) if isinstance(f, str) and os.path.isabs(f) else None


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
