"""Replicated state, written once: under DDP every rank holds the same model and optimizer state, so only the owner
(global rank 0) snapshots it, and the other ranks' bundles reference the owner's state files by digest.

This module is the runtime side: whether a run's state is replicated, and, when a non-owner dumps, the wait for the
owner's bundle. A non-owner (``Recorder(replicated_state=...)``) keeps, at each snapshot step, only what is its own:
its RNG states and detector state (a few KB). When it dumps, it waits (bounded) for the owner's bundle of the same
incident (:func:`find_owner`), whose window must start at the same snapshot step, and writes a bundle that references
the owner's state files: the format of that reference, and every reader of it, is :mod:`reprokit.bundle.reference`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from reprokit.bundle import open_bundle
from reprokit.bundle.layout import MANIFEST, OWNER_RANK, TMP_PREFIX, rank_bundle_pattern, state_files


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
    pattern = rank_bundle_pattern(world_size, OWNER_RANK)
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
