"""Read, write and verify bundles: the one on-disk format every command speaks.

A bundle is a directory (see ARCHITECTURE.md). ``manifest.json`` is written
last and lists every file with its sha256 and size; a reader verifies all of
them before it loads anything, and nothing is ever unpickled.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from reprokit import pytree
from reprokit._version import __version__
from reprokit.errors import BundleError, BundleVersionError
from reprokit.signature import Failure

FORMAT = "reprokit-bundle"
VERSION = 1
MANIFEST = "manifest.json"
FAILURE = "failure.json"
RUN = "run.json"
ENV = "env.json"
STATE_JSON = "state/state.json"
STATE_TENSORS = "state/state.safetensors"
STEPS = "steps"
CODE = "code"

# Upgrades take a bundle's parsed JSON files ({"run.json": {...}, ...}) from
# version v to v + 1. Version 1 is the first, so none exist yet; when the
# format changes, bump VERSION and add `UPGRADES[1] = _upgrade_1_to_2`.
UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


# --- JSON that stays strict (NaN/inf as strings) ------------------------------

def jsonable(obj: Any) -> Any:
    """Replace non-finite floats by ``"nan"``/``"inf"``/``"-inf"`` so output is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def dumps(obj: Any) -> bytes:
    return json.dumps(jsonable(obj), indent=1, sort_keys=True, allow_nan=False).encode()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def step_name(step: int) -> str:
    return f"{step:08d}"


# --- writing --------------------------------------------------------------------

class BundleWriter:
    """Builds a bundle in a hidden temp dir and renames it into place on :meth:`commit`.

    Every file is fsynced; the manifest is written last, so a crash at any point
    leaves either nothing or a directory that ``verify`` rejects.

    Example:
        >>> w = BundleWriter(Path("repros"), "bundle-x")          # doctest: +SKIP
        >>> w.write_json("run.json", {...}); w.commit()           # doctest: +SKIP
    """

    def __init__(self, out_dir: Path, name: str):
        self.out_dir = Path(out_dir)
        self.final = self.out_dir / name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out_dir / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self.files: dict[str, dict[str, Any]] = {}

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, dumps(obj))

    def write_tensors(self, rel: str, tensors: dict[str, torch.Tensor] | Path) -> None:
        """Write tensors as safetensors; a Path is an already-written safetensors file, copied in chunks."""
        if isinstance(tensors, Path):
            self.copy_file(rel, tensors)
            return
        own: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for k, t in tensors.items():
            # safetensors refuses tensors that share storage: give views (referenced batches) their own.
            ptr = t.untyped_storage().data_ptr() if t.numel() else -1
            whole = t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()
            own[k] = t if whole and ptr not in storages else t.contiguous().clone()
            storages.add(ptr)
        self.write_bytes(rel, st_save(own))

    def copy_file(self, rel: str, src: Path) -> None:
        """Copy a file in, chunk by chunk (state files may be larger than memory)."""
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        h, size = hashlib.sha256(), 0
        with open(src, "rb") as fin, open(path, "wb") as fout:
            for chunk in iter(lambda: fin.read(1 << 24), b""):
                h.update(chunk)
                fout.write(chunk)
                size += len(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        self.files[rel] = {"sha256": h.hexdigest(), "size": size}

    def commit(self) -> Path:
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "reprokit_version": __version__,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "files": dict(sorted(self.files.items())),
        }
        manifest["self_sha256"] = _self_digest(manifest)
        self.write_bytes(MANIFEST, dumps(manifest))
        self.files.pop(MANIFEST)
        _fsync_dir(self.tmp)
        final = self.final
        n = 1
        while final.exists():
            final = self.final.with_name(f"{self.final.name}-{n}")
            n += 1
        os.replace(self.tmp, final)
        _fsync_dir(self.out_dir)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


@dataclass
class StepRecord:
    """One step as stored in ``steps/``: encoded batch, its tensors (and RNG tensors), RNG tree."""

    step: int
    batch: Any
    tensors: dict[str, torch.Tensor]
    rng: dict[str, Any]
    loss: float | None = None
    grad_norm: float | None = None


def write_bundle(w: BundleWriter, *, failure: dict[str, Any], run: dict[str, Any], env: dict[str, Any],
                 state: tuple[dict[str, Any], dict[str, torch.Tensor] | Path], steps: Iterable[StepRecord],
                 code: Iterable[tuple[str, Path]] = ()) -> Path:
    """Write every part of a bundle through ``w`` and commit it (manifest last)."""
    w.write_json(FAILURE, failure)
    w.write_json(RUN, run)
    w.write_json(ENV, env)
    w.write_json(STATE_JSON, state[0])
    w.write_tensors(STATE_TENSORS, state[1])
    for rec in steps:
        name = f"{STEPS}/{step_name(rec.step)}"
        w.write_json(name + ".json", {"step": rec.step, "batch": rec.batch, "rng": rec.rng,
                                      "loss": rec.loss, "grad_norm": rec.grad_norm})
        w.write_tensors(name + ".safetensors", rec.tensors)
    for rel, src in code:
        w.copy_file(f"{CODE}/{rel}", src)
    return w.commit()


def _self_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's own content (minus this field), so edits to the manifest show too."""
    body = {k: v for k, v in manifest.items() if k != "self_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- verifying ------------------------------------------------------------------

def verify(path: Path) -> list[dict[str, Any]]:
    """Every problem with a bundle directory: ``[{"file", "problem", "expected", "found"}]``.

    An empty list means every file matches the manifest and nothing extra is there.

    Raises:
        BundleError: when ``path`` is not a directory.
        BundleVersionError: when the bundle's format version is newer than this reprokit.
    """
    path = Path(path)
    if not path.is_dir():
        raise BundleError(f"{path} is not a bundle directory (expected a folder holding {MANIFEST})")
    manifest, problems = _read_manifest(path)
    if manifest is None:
        return problems
    listed: dict[str, Any] = manifest["files"]
    for rel, meta in sorted(listed.items()):
        target = path / rel
        if rel.startswith("/") or ".." in Path(rel).parts:
            problems.append({"file": rel, "problem": "unsafe path in manifest"})
        elif not target.is_file():
            problems.append({"file": rel, "problem": "missing", "expected": meta.get("sha256")})
        else:
            found = sha256_file(target)
            if found != meta.get("sha256"):
                problems.append({"file": rel, "problem": "checksum mismatch", "expected": meta.get("sha256"),
                                 "found": found})
            elif target.stat().st_size != meta.get("size"):
                problems.append({"file": rel, "problem": "size mismatch", "expected": meta.get("size"),
                                 "found": target.stat().st_size})
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink() or (not p.is_dir() and rel != MANIFEST and rel not in listed):
            problems.append({"file": rel, "problem": "unexpected file"})
    return problems


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    mpath = path / MANIFEST
    if not mpath.is_file():
        return None, [{"file": MANIFEST, "problem": "missing (an interrupted write, or not a bundle)"}]
    try:
        manifest = json.loads(mpath.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        return None, [{"file": MANIFEST, "problem": f"not valid JSON: {e}"}]
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        return None, [{"file": MANIFEST, "problem": f"not a {FORMAT} manifest"}]
    version = manifest.get("version")
    if not isinstance(version, int) or version < 1:
        return None, [{"file": MANIFEST, "problem": f"unknown format version {version!r}"}]
    if version > VERSION:
        raise BundleVersionError(
            f"{path} uses bundle format version {version}, but this reprokit ({__version__}) reads versions "
            f"up to {VERSION}. Upgrade reprokit (pip install -U reprokit) to open it."
        )
    if "self_sha256" in manifest and manifest["self_sha256"] != _self_digest(manifest):
        # An altered manifest cannot vouch for any other file: report it alone.
        return None, [{"file": MANIFEST, "problem": "checksum mismatch (the manifest itself was altered)",
                           "expected": manifest["self_sha256"], "found": _self_digest(manifest)}]
    return manifest, []


# --- reading --------------------------------------------------------------------

@dataclass
class Bundle:
    """A verified bundle. Use :func:`open_bundle` to get one."""

    path: Path
    manifest: dict[str, Any]
    docs: dict[str, Any] = field(default_factory=dict)

    @property
    def run(self) -> dict[str, Any]:
        return self.docs[RUN]

    @property
    def env(self) -> dict[str, Any]:
        return self.docs[ENV]

    @cached_property
    def failure(self) -> Failure:
        return Failure.from_json(self.docs[FAILURE])

    @property
    def steps(self) -> list[int]:
        return list(self.run["window"]["steps"])

    @property
    def code_dir(self) -> Path | None:
        d = self.path / CODE
        return d if d.is_dir() else None

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(tree, tensors)`` of the snapshot the window starts from."""
        return self._json(STATE_JSON), self._tensors(STATE_TENSORS)

    def step(self, step: int) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
        """``(batch, rng_tree, rng_tensors)`` recorded for one step of the window."""
        doc, tensors = self.step_doc(step)
        rng_tensors = {k: v for k, v in tensors.items() if k.startswith("rng/")}
        return pytree.decode(doc["batch"], tensors), doc["rng"], rng_tensors

    def step_doc(self, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        name = f"{STEPS}/{step_name(step)}"
        return self._json(name + ".json"), self._tensors(name + ".safetensors")

    def _json(self, rel: str) -> Any:
        return json.loads((self.path / rel).read_bytes())

    def _tensors(self, rel: str) -> dict[str, torch.Tensor]:
        return st_load((self.path / rel).read_bytes())

    def sizes(self) -> dict[str, int]:
        """Bytes on disk per part: state, batches (steps/), code, metadata, and the vendored runtime
        when the bundle sits in an unpacked ``reprokit pack`` archive."""
        out = {"state": 0, "batches": 0, "code": 0, "metadata": 0, "runtime": 0}
        names = {"state": "state", STEPS: "batches", CODE: "code"}
        for rel, meta in self.manifest["files"].items():
            out[names.get(rel.split("/", 1)[0], "metadata")] += int(meta["size"])
        top = self.path.parent
        if (top / "repro.py").is_file() and (top / "reprokit").is_dir():
            runtime = [top / "repro.py", top / "README.md", *(top / "reprokit").rglob("*")]
            out["runtime"] = sum(p.stat().st_size for p in runtime if p.is_file())
        return out


def open_bundle(path: str | Path) -> Bundle:
    """Verify a bundle directory, then open it.

    Raises:
        BundleError: listing every problem when verification fails.
        BundleVersionError: for a bundle written by a newer format version.

    Example:
        >>> b = open_bundle("repros/bundle-...")                  # doctest: +SKIP
        >>> b.failure.kind, b.steps                               # doctest: +SKIP
    """
    path = Path(path)
    problems = verify(path)
    if problems:
        lines = "\n".join(f"  {p['file']}: {p['problem']}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise BundleError(
            f"{path} failed verification ({len(problems)} problem(s)); refusing to load it:\n{lines}{more}\n"
            "Ask the sender for an intact copy, or run `reprokit verify` for details.",
            problems,
        )
    manifest = json.loads((path / MANIFEST).read_bytes())
    docs = {rel: json.loads((path / rel).read_bytes()) for rel in (RUN, FAILURE, ENV)
            if rel in manifest["files"]}
    missing = {RUN, FAILURE, ENV} - docs.keys()
    if missing:
        raise BundleError(f"{path} has a valid manifest but lacks {', '.join(sorted(missing))}")
    for v in range(manifest["version"], VERSION):
        docs = UPGRADES[v](docs)
    return Bundle(path=path, manifest=manifest, docs=docs)
