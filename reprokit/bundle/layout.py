"""Every path of the bundle format, in one place: the files a bundle holds, how its folders are named, and how the
folders around it (temp dirs of writers, incident folders of multi-rank runs) are told apart.

A bundle is a directory (see ARCHITECTURE.md)::

    manifest.json      FORMAT and VERSION, every file with its sha256 and size; written last
    failure.json       run.json       env.json
    state/state.json   state/state.safetensors, state/state-1.safetensors, ...  (or state/replicated.json with
                       state/rng.safetensors: the state is another rank's, by reference)
    steps/00000012.json, steps/00000012.safetensors, ...
    code/...           the user's source files
    extract/op.json, extract/op.safetensors, extract/op_repro.py   (an extract's bundle)

No torch and no other module of the package is imported here: every module of the format (and ``inspect``) reads
its names from this one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from reprokit.generated import OP_REPRO

FORMAT = "reprokit-bundle"
VERSION = 2
MANIFEST = "manifest.json"
FAILURE = "failure.json"
RUN = "run.json"
ENV = "env.json"
STATE_JSON = "state/state.json"
STATE_TENSORS = "state/state.safetensors"
"""The state's tensors; a large state continues in ``state/state-1.safetensors``, ``state-2``, ... (version 2)."""
REPLICATED = "state/replicated.json"
"""A reference to another rank's state files (replicated DDP state, written once): :mod:`reprokit.bundle.reference`."""
LOCAL_RNG = "state/rng.safetensors"
"""A referencing bundle's own tensors: this rank's RNG states (the rest of its state is the owner's)."""
STEPS = "steps"
CODE = "code"
OP_JSON = "extract/op.json"
"""An extract's recorded operator call (with ``extract/op.safetensors``, and :data:`OP_REPRO` to run it)."""

# Every key a manifest may hold. The first release wrote LEGACY_KEYS (no self digest); every manifest
# since carries ``self_sha256``, and one without it (or with a key we do not know) is invalid.
MANIFEST_KEYS = frozenset({"created", "files", "format", "reprokit_version", "self_sha256", "version"})
LEGACY_KEYS = MANIFEST_KEYS - {"self_sha256"}

STEP_FILE = re.compile(r"steps/(\d{8})\.(json|safetensors)")
STATE_FILE = re.compile(r"state/state(?:-([1-9][0-9]*))?\.safetensors")
"""The state's tensor files: ``state/state.safetensors``, then ``state/state-1.safetensors``, ... (format version 2)."""

LAYOUT = (re.compile(r"(failure|run|env)\.json"), re.compile(r"state/(state|replicated)\.json"),
          STATE_FILE, re.compile(re.escape(LOCAL_RNG)), STEP_FILE, re.compile(r"code/.+\.py"),
          re.compile(r"extract/op\.(json|safetensors)"), re.compile(re.escape(OP_REPRO)))
"""Every file a bundle may list (the manifest itself is never listed): what any reprokit writes."""


def step_name(step: int) -> str:
    """The stem of one step's files: ``steps/{step_name(12)}.json`` is ``steps/00000012.json``."""
    return f"{step:08d}"


def state_file_name(i: int) -> str:
    """The bundle path of part ``i`` of the state's tensors."""
    return STATE_TENSORS if i == 0 else f"state/state-{i}.safetensors"


def state_parts(files: dict[str, Any]) -> tuple[list[str], int | None]:
    """The state's tensor files a manifest lists, in order, and the first missing part number (None when they are
    ``0..n-1`` without gaps). Sized by how many parts are listed, never by a part's number (a manifest could name
    ``state-999999999999``)."""
    parts = {int(m.group(1) or 0): rel for rel in files if (m := STATE_FILE.fullmatch(rel))}
    missing = next((i for i in range(len(parts)) if i not in parts), None)
    return ([] if missing is not None else [parts[i] for i in range(len(parts))]), missing


def state_files(files: dict[str, Any]) -> list[str]:
    """The state's tensor files a manifest lists, in order; empty when they are not ``0..n-1`` without gaps
    (a bundle missing a part of its state is refused, never loaded with part of its tensors)."""
    return state_parts(files)[0]


# --- folders around bundles ---------------------------------------------------------------

TMP_PREFIX = ".tmp-"
"""A bundle being written: ``.tmp-NAME-pid<pid>.<start>-on-<host>-<8 hex>`` beside where it will be renamed to."""
TMP_DIR = re.compile(r"^\.tmp-.+-pid(?P<pid>\d+)\.(?P<start>\d+)-on-(?P<host>[A-Za-z0-9]*)-[0-9a-f]{8}$")
"""A writer's temp dir: the writing process, its start time (clock ticks since boot, from /proc; 0 where unknown)
so a recycled pid is not taken for the writer, and the host, so a folder on a shared filesystem written from another
machine is not judged by our pids."""
OLD_TMP_DIR = re.compile(r"^\.tmp-.+-[0-9a-f]{8}$")
"""A temp dir named before writers recorded their owner."""
CLAIM_SUFFIX = ".reprokit-writing"
"""``.NAME.reprokit-writing`` beside an output folder ``NAME``: the process writing it (``shrink -o``, ``extract -o``)."""

INCIDENT_PREFIX = "incident-"
"""An incident folder of a multi-rank run (``incident-<time>-step<N>-<run key>``): every rank's bundle of one failure."""
OWNER_RANK = 0
"""The rank whose bundle holds the state the other ranks' bundles reference (replicated DDP state)."""
RANK_BUNDLE = re.compile(r"bundle-.*-rank\d+of\d+(-\d+)?")
"""The name the recorder gives one rank's bundle of a multi-rank run (``-1``, ``-2``: a name already taken)."""
RANK_SUFFIX = re.compile(r"-rank\d+of\d+$")
"""The end of a rank's bundle name, as an incident folder is told by its bundles."""
OWNER_BUNDLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
"""What a reference may name as the owner's bundle: one plain folder name beside the referencing bundle."""


def bundle_name(stamp: str, step: int, kind: str, rank: str = "") -> str:
    """The folder name the recorder gives a bundle: ``bundle-20260101-120000-step00000031-nonfinite_loss``, and
    ``...-rank1of4`` for one rank of a multi-rank run (``rank``: :func:`rank_tag`). A name already taken gets ``-1``,
    ``-2``, ... (:class:`reprokit.bundle.writer.BundleWriter`)."""
    return f"bundle-{stamp}-step{step:08d}-{kind}" + (f"-{rank}" if rank else "")


def rank_tag(rank: int, world_size: int) -> str:
    """``rank01of16``: the part of a bundle folder's name that says which rank wrote it (padded: names sort by rank)."""
    width = len(str(world_size - 1))
    return f"rank{rank:0{width}d}of{world_size}"


def rank_bundle_pattern(world_size: int, rank: int = OWNER_RANK) -> re.Pattern[str]:
    """The names of rank ``rank``'s bundles in a run of ``world_size`` ranks (``bundle-...-rank0of4``)."""
    return re.compile(rf"bundle-.*-{rank_tag(rank, world_size)}(-\d+)?")


def is_incident(folder: Path) -> bool:
    """A folder of rank bundles (no manifest of its own)."""
    return folder.is_dir() and not (folder / MANIFEST).exists() and any(
        (p / MANIFEST).exists() for p in folder.iterdir() if p.is_dir())
