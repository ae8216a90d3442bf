"""State by reference: under DDP every rank holds the same model and optimizer state, so only the owner (global rank
0) writes it, and the other ranks' bundles reference the owner's state files by digest.

A referencing bundle holds, besides its own window:

``state/state.json``        the owner's ``state`` tree (model, optimizer, ...) with this rank's own ``rng`` and
                            ``monitor``;
``state/rng.safetensors``   this rank's RNG tensors;
``state/replicated.json``   the reference: the owner bundle (a sibling folder of the incident, by name), its rank and
                            snapshot step, and the owner's state files with their sha256 and size (or, when no owner
                            bundle could be found, why: the bundle then cannot replay, and says so).

The recorder writes it (:func:`reprokit.bundle.writer.write_bundle` with a reference, once
:func:`reprokit.distributed.replicated.find_owner` found the owner's bundle). Every reader resolves the reference
through :func:`state`, which checks each referenced file's digest while reading it before any tensor is used;
:func:`check` lists what ``verify`` reports; :func:`materialise` writes a self-contained copy (``pack``). Names in a
reference come from other people's bundles: the owner bundle is one plain folder name beside this bundle, and its
files are state files (``state/state*.safetensors``), nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprokit.bundle import schema
from reprokit.bundle.hashing import sha256_file
from reprokit.bundle.layout import (
    LOCAL_RNG,
    MANIFEST,
    OWNER_BUNDLE_NAME,
    OWNER_RANK,
    REPLICATED,
    STATE_JSON,
    STATE_TENSORS,
    state_files,
)
from reprokit.bundle.writer import BundleWriter
from reprokit.errors import BundleError

if TYPE_CHECKING:  # inspect and verify read references without importing torch
    import torch

    from reprokit.bundle.reader import Bundle


def _owner_dir(bundle_path: Path, ref: dict[str, Any]) -> Path:
    """The owner bundle's folder: a plain sibling of ``bundle_path`` (no path separators, no ``..``, no link)."""
    problem = ref.get("problem")
    name = (ref.get("owner") or {}).get("bundle")
    if problem or not isinstance(name, str):
        raise BundleError(f"{bundle_path}: this rank's bundle references the state of rank {OWNER_RANK}'s bundle, "
                          f"which was not available when it was written ({problem}); it cannot replay alone. "
                          "Replay the incident's other bundles, or re-record.",
                          [{"file": REPLICATED, "problem": f"no referenced state, so this bundle cannot replay: {problem}"}])
    if not OWNER_BUNDLE_NAME.fullmatch(name) or name in (".", ".."):
        raise BundleError(f"{bundle_path}: {REPLICATED} names {name[:80]!r} as the owner bundle; only a plain folder "
                          "name beside this bundle is allowed. Refusing it.",
                          [{"file": REPLICATED, "problem": "unsafe owner bundle name"}])
    owner = bundle_path.parent / name
    if owner.is_symlink():
        raise BundleError(f"{bundle_path}: the owner bundle {owner} is a symbolic link; refusing to follow it.",
                          [{"file": REPLICATED, "problem": "owner bundle is a link"}])
    return owner


def _label(ref: dict[str, Any], rel: str) -> str:
    return f"{(ref.get('owner') or {}).get('bundle')}/{rel} (referenced)"


def check(bundle_path: Path, ref: dict[str, Any], *, hash_tensors: bool) -> list[dict[str, Any]]:
    """Every referenced state file with its status: ``{"file", "status": ok|missing|mismatch, ...}`` (or one entry
    for a reference that cannot be resolved at all)."""
    try:
        owner = _owner_dir(bundle_path, ref)
    except BundleError as e:
        return [{"file": REPLICATED, "status": "missing", "problem": e.problems[0]["problem"]}]
    out = []
    for rel, meta in sorted(ref["files"].items()):
        path, label = owner / rel, _label(ref, rel)
        if path.is_symlink() or not path.is_file():
            out.append({"file": label, "status": "missing", "problem": (
                f"missing: this bundle's model and optimizer state is in rank {OWNER_RANK}'s bundle of the same "
                "incident; copy that bundle beside this one, or replay the incident folder, or `reprokit pack` this "
                "bundle where it was written (the archive then holds the state)")})
        elif path.stat().st_size != meta["size"]:
            out.append({"file": label, "status": "mismatch", "problem": "size mismatch", "expected": meta["size"],
                        "found": path.stat().st_size})
        elif hash_tensors and (found := sha256_file(path)) != meta["sha256"]:
            out.append({"file": label, "status": "mismatch", "problem": "checksum mismatch",
                        "expected": meta["sha256"], "found": found})
        else:
            out.append({"file": label, "status": "ok"})
    return out


def state(bundle: Bundle) -> dict[str, torch.Tensor]:
    """The state's tensors of a referencing bundle: the owner's model/optimizer/... tensors (each file's digest checked
    while it is read, before any tensor is made) and this rank's own RNG tensors."""
    from reprokit.bundle import tensorfile  # torch: only a replay loads tensors

    ref = bundle._json(REPLICATED)
    owner = _owner_dir(bundle.path, ref)
    if ref["owner"]["step"] != bundle.run["window"]["start"]:
        raise BundleError(f"{bundle.path}: its window starts at step {bundle.run['window']['start']}, but it references "
                          f"rank {OWNER_RANK}'s snapshot of step {ref['owner']['step']}; refusing a state the window "
                          "does not start from. Re-record, or run `reprokit verify`.",
                          [{"file": REPLICATED, "problem": "references a snapshot of another step"}])
    parts = state_files(ref["files"])
    if not parts or len(parts) != len(ref["files"]):
        raise BundleError(f"{bundle.path}: {REPLICATED} does not list a complete set of state files "
                          "(state.safetensors, state-1.safetensors, ...); "
                          "refusing a state with parts missing. Re-record, or run `reprokit verify`.",
                          [{"file": REPLICATED, "problem": "incomplete set of referenced state files"}])
    tensors: dict[str, torch.Tensor] = {}
    for rel in parts:
        meta = ref["files"][rel]
        path = owner / rel
        if path.is_symlink() or not path.is_file() or path.parent.is_symlink():
            raise BundleError(f"{bundle.path}: the referenced state file {path} is missing, a link or not a regular "
                              f"file; refusing it. Re-copy rank {OWNER_RANK}'s bundle, or run `reprokit verify`.",
                              [{"file": _label(ref, rel), "problem": "missing or not a regular file"}])
        try:
            part = tensorfile.read_verified(path, meta["sha256"], meta["size"])
        except (tensorfile.TensorFileError, OSError) as e:
            raise BundleError(f"{bundle.path}: the referenced state file {owner / rel}: {e}; refusing to load it. "
                              f"Re-copy rank {OWNER_RANK}'s bundle from the incident folder, or run `reprokit verify`.",
                              [{"file": _label(ref, rel), "problem": str(e)}]) from None
        part = {k: v for k, v in part.items() if not k.startswith("rng/")}  # the owner's RNG is not this rank's
        if tensors.keys() & part.keys():
            raise BundleError(f"{bundle.path}: {owner / rel} holds a tensor of an earlier state file again; refusing "
                              "an ambiguous state.", [{"file": _label(ref, rel), "problem": "duplicate tensor"}])
        tensors |= part
    tensors |= bundle._tensors(LOCAL_RNG)
    try:  # every tensor the state's tree names is there (the check verify makes for a bundle's own state files)
        schema.check_state(bundle.state_tree(), set(tensors))
    except BundleError as e:
        raise BundleError(f"{bundle.path}: the referenced state does not hold what the state's tree needs ({e}); "
                          "refusing it. Re-record, or run `reprokit verify`.",
                          [{"file": REPLICATED, "problem": "the referenced state lacks tensors the tree names"}]) from None
    return tensors


def materialise(bundle: Bundle, out_dir: Path, name: str) -> Path:
    """A self-contained copy of a referencing bundle in ``out_dir/name``: the referenced state written as the bundle's
    own state files (with this rank's RNG), every other file copied and checked against the manifest."""
    _, tensors = bundle.state()
    with BundleWriter(out_dir, name) as w:
        for rel, meta in sorted(bundle.manifest["files"].items()):
            if rel in (REPLICATED, LOCAL_RNG, MANIFEST):
                continue
            w.copy_file(rel, bundle.path / rel)
            if w.files[rel] != {"sha256": meta["sha256"], "size": meta["size"]}:
                raise BundleError(f"{bundle.path / rel} changed since the bundle was verified; nothing was written.",
                                  [{"file": rel, "problem": "checksum mismatch"}])
        assert STATE_JSON in w.files
        w.write_state(tensors)
        return w.commit()


def describe(bundle: Bundle) -> dict[str, Any] | None:
    """For ``inspect``: where a referencing bundle's state lives (None for a bundle that holds its own), and the
    first referenced file when it is there (``path``, for the state's sizes; not hashed here)."""
    if REPLICATED not in bundle.manifest.get("files", {}):
        return None
    ref = bundle._json(REPLICATED)
    owner = ref.get("owner") or {}
    out: dict[str, Any] = {"rank": owner.get("rank"), "bundle": owner.get("bundle"), "step": owner.get("step"),
                           "bytes": sum(int(m["size"]) for m in ref["files"].values()), "problem": ref.get("problem"),
                           "path": None}
    try:
        first = _owner_dir(bundle.path, ref) / STATE_TENSORS
    except BundleError as e:
        out["problem"] = out["problem"] or e.problems[0]["problem"]
        return out
    if STATE_TENSORS in ref["files"] and first.is_file() and not first.is_symlink():
        out["path"] = str(first)
    else:
        out["problem"] = f"{first} is missing"
    return out


def referenced(path: Path) -> list[dict[str, Any]] | None:
    """For ``verify``: each state file a bundle folder references (``{"file", "status": ok|missing|mismatch}``), or
    None when it references none (or is no bundle folder, or its reference cannot be read: verify reports that)."""
    try:
        ref = schema.load_json(path / REPLICATED, REPLICATED)
        schema.check_replicated(ref)
    except Exception:
        return None
    return [{"file": x["file"].removesuffix(" (referenced)"), "status": x["status"]}
            for x in check(path, ref, hash_tensors=True)]
