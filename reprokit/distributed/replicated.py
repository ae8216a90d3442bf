"""Replicated state, written once: under DDP every rank holds the same model and optimizer state, so only the owner
(global rank 0) snapshots it, and the other ranks' bundles reference the owner's state files by digest.

A non-owner (``Recorder(replicated_state=...)``) keeps, at each snapshot step, only what is its own: its RNG states
and detector state (a few KB). When it dumps, it waits (bounded) for the owner's bundle of the same incident, whose
window must start at the same snapshot step, and writes:

``state/state.json``        the owner's ``state`` tree (model, optimizer, ...) with this rank's own ``rng`` and
                            ``monitor``;
``state/rng.safetensors``   this rank's RNG tensors;
``state/replicated.json``   the reference: the owner bundle (a sibling folder of the incident, by name), its rank and
                            snapshot step, and the owner's state files with their sha256 and size (or, when no owner
                            bundle could be found, why: the bundle then cannot replay, and says so).

Every reader resolves the reference through :func:`state`, which checks each referenced file's digest while reading it
before any tensor is used; :func:`check` lists what ``verify`` reports; :func:`materialise` writes a self-contained copy
(``pack``). Names in a reference come from other people's bundles: the owner bundle is one plain folder name beside
this bundle, and its files are state files (``state/state*.safetensors``), nothing else.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # inspect and verify read references without importing torch
    import torch

REFERENCE = "state/replicated.json"
LOCAL_RNG = "state/rng.safetensors"
OWNER_RANK = 0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def is_replicated_layout(model: Any, extra: dict[str, Any]) -> bool:
    """``replicated_state="auto"``: the model is a DistributedDataParallel, no parameter is a DTensor (FSDP2/TP
    shards differ per rank), and ``state.extra`` holds nothing but generators (their states are each rank's own and
    recorded as such; anything else there may differ per rank). Every DDP rank starts from rank 0's broadcast
    parameters and applies the same all-reduced gradients, so model and optimizer state are the same on every rank
    at step start."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from reprokit.pytree import is_dtensor
    from reprokit.rng import kind_of

    def generators_only(obj: Any) -> bool:
        if isinstance(obj, dict):
            return all(generators_only(v) for v in obj.values())
        if isinstance(obj, (list, tuple)):
            return all(generators_only(v) for v in obj)
        return kind_of(obj) is not None

    if not isinstance(model, DistributedDataParallel) or not generators_only(extra):
        return False
    if getattr(model, "broadcast_buffers", True) is False and any(True for _ in model.buffers()):
        return False  # buffers (BatchNorm statistics) then drift apart per rank
    return not any(type(p) is not torch.nn.Parameter and is_dtensor(p) for p in model.parameters())


def owner_name_pattern(world_size: int, rank: int = OWNER_RANK) -> re.Pattern[str]:
    width = len(str(world_size - 1))
    return re.compile(rf"bundle-.*-rank{rank:0{width}d}of{world_size}(-\d+)?")


def mark_owner_early(incident_file: Path, step: int) -> None:
    """The owner took an early snapshot (its budget): its snapshots no longer fall on the schedule the other ranks
    keep, so they take their own from their next snapshot step on (a file beside the run's incident file: no
    collective). A window of theirs already running cannot reference the owner's snapshot any more: if it is dumped,
    :func:`find_owner` sees the owner's window start at another step and the bundle says so."""
    try:
        incident_file.parent.mkdir(parents=True, exist_ok=True)
        incident_file.with_suffix(".owner-early").write_text(str(step))
    except OSError:
        pass


def owner_went_early(incident_file: Path) -> bool:
    return incident_file.with_suffix(".owner-early").exists()


def find_owner(folder: Path, *, world_size: int, incident: str, step: int, timeout_s: float,
               done: Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Wait (bounded) for the owner's bundle of ``incident`` in ``folder``; returns ``(reference, owner state tree)``.

    The reference holds ``problem`` (and no files) when the owner bundle did not appear within ``timeout_s`` (longer
    while the owner is visibly still writing it), when the owner gave up (its ``done`` mark without a bundle), or when
    its window starts at another step than ``step`` (an early snapshot of the owner's).
    """
    from reprokit.bundle import MANIFEST, TMP_PREFIX, open_bundle, state_files

    pattern = owner_name_pattern(world_size)
    start = time.monotonic()
    deadline = start + timeout_s
    ref: dict[str, Any] = {"owner": {"rank": OWNER_RANK, "bundle": None, "step": step}, "files": {}}
    while True:
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        for name in names:
            if not pattern.fullmatch(name) or not (folder / name / MANIFEST).is_file():
                continue
            try:
                b = open_bundle(folder / name)
            except Exception as e:
                return {**ref, "problem": f"rank {OWNER_RANK}'s bundle {name} is invalid: {e}"}, {}
            d = b.run.get("distributed") or {}
            if d.get("rank") != OWNER_RANK or d.get("incident") != incident:
                continue
            if b.run["window"]["start"] != step:
                return {**ref, "problem": f"rank {OWNER_RANK}'s bundle {name} starts at step "
                                          f"{b.run['window']['start']} (an early or retaken snapshot of that "
                                          f"rank's), this rank's window at step {step}: there is no snapshot of step "
                                          f"{step} to reference"}, {}
            files = {rel: dict(b.manifest["files"][rel]) for rel in state_files(b.manifest["files"])}
            ref["owner"]["bundle"] = name
            return {**ref, "files": files}, b.state_tree().get("state", {})
        now = time.monotonic()
        writing = any(n.startswith(TMP_PREFIX) and pattern.fullmatch(n[len(TMP_PREFIX):].split("-pid")[0])
                      for n in names)
        gave_up = done is not None and done.exists() and not writing
        if gave_up or (now >= deadline and not (writing and now < start + 10 * timeout_s)):
            why = "marked the incident done without writing one" if gave_up else \
                f"had not written one after {now - start:.0f} s"
            return {**ref, "problem": f"rank {OWNER_RANK}, which holds the state this rank references, {why}"}, {}
        time.sleep(0.05)


def _owner_dir(bundle_path: Path, ref: dict[str, Any]) -> Path:
    """The owner bundle's folder: a plain sibling of ``bundle_path`` (no path separators, no ``..``, no link)."""
    from reprokit.errors import BundleError

    problem = ref.get("problem")
    name = (ref.get("owner") or {}).get("bundle")
    if problem or not isinstance(name, str):
        raise BundleError(f"{bundle_path}: this rank's bundle references the state of rank {OWNER_RANK}'s bundle, "
                          f"which was not available when it was written ({problem}); it cannot replay alone. "
                          "Replay the incident's other bundles, or re-record.",
                          [{"file": REFERENCE, "problem": f"no referenced state, so this bundle cannot replay: {problem}"}])
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise BundleError(f"{bundle_path}: {REFERENCE} names {name[:80]!r} as the owner bundle; only a plain folder "
                          "name beside this bundle is allowed. Refusing it.",
                          [{"file": REFERENCE, "problem": "unsafe owner bundle name"}])
    owner = bundle_path.parent / name
    if owner.is_symlink():
        raise BundleError(f"{bundle_path}: the owner bundle {owner} is a symbolic link; refusing to follow it.",
                          [{"file": REFERENCE, "problem": "owner bundle is a link"}])
    return owner


def _label(ref: dict[str, Any], rel: str) -> str:
    return f"{(ref.get('owner') or {}).get('bundle')}/{rel} (referenced)"


def check(bundle_path: Path, ref: dict[str, Any], *, hash_tensors: bool) -> list[dict[str, Any]]:
    """Every referenced state file with its status: ``{"file", "status": ok|missing|mismatch, ...}`` (or one entry
    for a reference that cannot be resolved at all)."""
    from reprokit.bundle import sha256_file
    from reprokit.errors import BundleError

    try:
        owner = _owner_dir(bundle_path, ref)
    except BundleError as e:
        return [{"file": REFERENCE, "status": "missing", "problem": e.problems[0]["problem"]}]
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


def state(bundle: Any) -> dict[str, torch.Tensor]:
    """The state's tensors of a referencing bundle: the owner's model/optimizer/... tensors (each file's digest checked
    while it is read, before any tensor is made) and this rank's own RNG tensors."""
    from reprokit import schema, tensorfile
    from reprokit.errors import BundleError

    ref = bundle._json(REFERENCE)
    owner = _owner_dir(bundle.path, ref)
    if ref["owner"]["step"] != bundle.run["window"]["start"]:
        raise BundleError(f"{bundle.path}: its window starts at step {bundle.run['window']['start']}, but it references "
                          f"rank {OWNER_RANK}'s snapshot of step {ref['owner']['step']}; refusing a state the window "
                          "does not start from. Re-record, or run `reprokit verify`.",
                          [{"file": REFERENCE, "problem": "references a snapshot of another step"}])
    from reprokit.bundle import state_files

    parts = state_files(ref["files"])
    if not parts or len(parts) != len(ref["files"]):
        raise BundleError(f"{bundle.path}: {REFERENCE} does not list a complete set of state files "
                          "(state.safetensors, state-1.safetensors, ...); "
                          "refusing a state with parts missing. Re-record, or run `reprokit verify`.",
                          [{"file": REFERENCE, "problem": "incomplete set of referenced state files"}])
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
                          [{"file": REFERENCE, "problem": "the referenced state lacks tensors the tree names"}]) from None
    return tensors


def materialise(bundle: Any, out_dir: Path, name: str) -> Path:
    """A self-contained copy of a referencing bundle in ``out_dir/name``: the referenced state written as the bundle's
    own state files (with this rank's RNG), every other file copied and checked against the manifest."""
    from reprokit.bundle import MANIFEST, STATE_JSON, BundleWriter
    from reprokit.errors import BundleError

    _, tensors = bundle.state()
    with BundleWriter(out_dir, name) as w:
        for rel, meta in sorted(bundle.manifest["files"].items()):
            if rel in (REFERENCE, LOCAL_RNG, MANIFEST):
                continue
            w.copy_file(rel, bundle.path / rel)
            if w.files[rel] != {"sha256": meta["sha256"], "size": meta["size"]}:
                raise BundleError(f"{bundle.path / rel} changed since the bundle was verified; nothing was written.",
                                  [{"file": rel, "problem": "checksum mismatch"}])
        assert STATE_JSON in w.files
        w.write_state(tensors)
        return w.commit()


def describe(bundle: Any) -> dict[str, Any] | None:
    """For ``inspect``: where a referencing bundle's state lives (None for a bundle that holds its own), and the
    first referenced file when it is there (``path``, for the state's sizes; not hashed here)."""
    from reprokit.bundle import REPLICATED, STATE_TENSORS
    from reprokit.errors import BundleError

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
    from reprokit import schema
    from reprokit.bundle import REPLICATED

    try:
        ref = schema.load_json(path / REPLICATED, REPLICATED)
        schema.check_replicated(ref)
    except Exception:
        return None
    return [{"file": x["file"].removesuffix(" (referenced)"), "status": x["status"]}
            for x in check(path, ref, hash_tensors=True)]
