"""Read, write and verify bundles: the one on-disk format every command speaks.

A bundle is a directory (see ARCHITECTURE.md). ``manifest.json`` is written
last and lists every file with its sha256 and size; a reader verifies all of
them before it loads anything, and nothing is ever unpickled.
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprokit import generated, hashing, pytree, schema
from reprokit._version import __version__
from reprokit.errors import BundleError, BundleVersionError
from reprokit.signature import Failure

if TYPE_CHECKING:
    import torch

    from reprokit import tensorfile

# torch and reprokit.tensorfile (whose dtype table needs torch) are imported only by the functions that
# write or read tensors: opening and verifying a bundle (inspect) must not pay torch's import, which takes seconds.

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
"""A reference to another rank's state files (replicated DDP state, written once): reprokit.distributed.replicated."""
STEPS = "steps"
CODE = "code"
# Every key a manifest may hold. The first release wrote LEGACY_KEYS (no self digest); every manifest
# since carries ``self_sha256``, and one without it (or with a key we do not know) is invalid.
MANIFEST_KEYS = frozenset({"created", "files", "format", "reprokit_version", "self_sha256", "version"})
LEGACY_KEYS = MANIFEST_KEYS - {"self_sha256"}
TMP_PREFIX = ".tmp-"
MAX_TOTAL_JSON_BYTES = 512 << 20
"""Most bytes of JSON (outside code/) one bundle may list: with schema's per-file cap, depth and string
limits, this bounds the time and memory any command spends parsing a bundle's metadata."""

# Upgrades take a bundle's parsed JSON files ({"run.json": {...}, ...}) from
# version v to v + 1. Version 2 split large states over several files (STATE_TENSORS,
# state/state-1.safetensors, ...); its JSON files are those of version 1, and a version 1
# bundle is one whose state is one file. An older reprokit refuses version 2 by its number
# instead of loading the first part of a state.
UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: lambda docs: docs}


state_file_name = schema.state_file_name


def state_files(files: dict[str, Any]) -> list[str]:
    """The state's tensor files a manifest lists, in order; empty when they are not ``0..n-1`` without gaps
    (a bundle missing a part of its state is refused, never loaded with part of its tensors)."""
    return schema.state_parts(files)[0]


# --- JSON that stays strict (NaN/inf as strings) ------------------------------

def jsonable(obj: Any) -> Any:
    """Replace non-finite floats by ``"nan"``/``"inf"``/``"-inf"`` so output is strict JSON, and an unpaired
    surrogate in a string (a file name decoded with ``surrogateescape`` in an exception message) by its
    ``\\udcff`` spelling: readers refuse strings that are not Unicode text (:mod:`reprokit.schema`)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, str):
        return _text(obj)
    if isinstance(obj, dict):
        return {_text(str(k)): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def _text(s: str) -> str:
    if s.isascii():
        return s
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def dumps(obj: Any) -> bytes:
    return json.dumps(jsonable(obj), indent=1, sort_keys=True, allow_nan=False).encode()


def sha256_file(path: Path) -> str:
    """The file's sha256 (reading and hashing overlapped; :mod:`reprokit.hashing` imports no torch)."""
    return hashing.sha256_file(path)[0]


def step_name(step: int) -> str:
    return f"{step:08d}"


# --- writing --------------------------------------------------------------------

def part_sizes(files: dict[str, Any]) -> dict[str, int]:
    """Bytes per part of the files a manifest lists (``state``, ``batches``: steps/, ``code``, ``metadata``)."""
    out = {"state": 0, "batches": 0, "code": 0, "metadata": 0}
    names = {"state": "state", STEPS: "batches", CODE: "code"}
    for rel, meta in files.items():
        out[names.get(rel.split("/", 1)[0], "metadata")] += int(meta["size"])
    return out


def write_probe(path: Path) -> tuple[Path, str | None]:
    """Whether files can be written at ``path`` now: ``(folder, why_not)``. The folder probed is ``path`` when it
    exists, else the nearest folder above it that does (nothing is created but a temporary file, dropped at once);
    ``why_not`` is None when it can be written. For the CLI's output checks and the Recorder's ``out_dir``."""
    folder = path.absolute()
    try:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        if not folder.is_dir():
            return folder, f"{folder} is a file"
        with tempfile.TemporaryFile(dir=folder, prefix=".reprokit-probe-"):
            pass
    except OSError as e:  # read-only, no permission, a name too long, a full disk
        return folder, str(e.strerror or e)
    return folder, None


class BundleWriter:
    """Builds a bundle in a hidden temp dir and renames it into place on :meth:`commit`.

    Every file is fsynced; the manifest is written last, so a crash at any point
    leaves either nothing or a directory that ``verify`` rejects. Used as a context
    manager, any exception (Ctrl-C included) that leaves the block before
    :meth:`commit` removes the temp dir. A writer killed outright (SIGKILL, power
    loss) leaves it behind: its name carries the writer's pid and host, so
    :func:`find_leftovers` / ``reprokit gc`` can tell abandoned ones from live ones.

    Example:
        >>> with BundleWriter(Path("repros"), "bundle-x") as w:   # doctest: +SKIP
        ...     w.write_json("run.json", {...}); w.commit()
    """

    def __init__(self, out_dir: Path, name: str, *, exact: bool = False):
        """``exact``: commit to ``out_dir/name`` or fail (an output the user named: ``shrink -o``), never to
        ``name-1`` beside it."""
        self.out_dir = Path(out_dir)
        self.final = self.out_dir / name
        self.exact = exact
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = self.out_dir / f"{TMP_PREFIX}{name}-{_owner_tag()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self.files: dict[str, dict[str, Any]] = {}
        self.committed: Path | None = None

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.committed is None:
            self.abort()

    def _target(self, rel: str) -> Path:
        """``tmp/rel`` with its parent folders made *inside* tmp only: a vanished tmp is never recreated."""
        d = self.tmp
        for part in Path(rel).parts[:-1]:
            d = d / part
            try:
                d.mkdir()
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise self._vanished() from None
        return self.tmp / rel

    def _vanished(self) -> BundleError:
        return BundleError(f"the temporary folder {self.tmp} vanished while the bundle was being written (was "
                           f"{self.out_dir} removed or cleaned meanwhile?); nothing was committed. Keep cleanup jobs "
                           "and quota scripts away from the recorder's out_dir.")

    def write_bytes(self, rel: str, data: bytes) -> None:
        path = self._target(rel)
        try:
            f = open(path, "wb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            raise self._vanished() from None
        with f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, dumps(obj))

    def write_tensors(self, rel: str, tensors: dict[str, torch.Tensor] | Path) -> None:
        """Write tensors as safetensors, streamed from their own memory and hashed while written
        (:func:`reprokit.tensorfile.write_safetensors`); a Path is an already-written safetensors
        file, copied in chunks."""
        from reprokit import tensorfile

        if isinstance(tensors, Path):
            self.copy_file(rel, tensors)
            return
        try:
            sha, size = tensorfile.write_safetensors(self._target(rel), tensors)
        except FileNotFoundError:
            raise self._vanished() from None
        self.files[rel] = {"sha256": sha, "size": size}

    def write_state(self, tensors: dict[str, torch.Tensor] | list[tensorfile.WrittenFile]) -> None:
        """The state's tensors, in files of at most :data:`~reprokit.tensorfile.SHARD_BYTES` written several at once
        (each hashed as it is written); a spilled snapshot's files, already on disk, are linked in (else copied)."""
        from reprokit import tensorfile

        if isinstance(tensors, list):
            for i, part in enumerate(tensors):
                self.link_file(state_file_name(i), part)
            return
        parts = tensorfile.shard(tensors)
        targets = [self._target(state_file_name(i)) for i in range(len(parts))]
        try:
            if len(parts) == 1:  # one file: written here, as every other file is
                written = [tensorfile.write_safetensors(targets[0], parts[0])]
            else:
                with ThreadPoolExecutor(tensorfile.parallelism(len(parts)), thread_name_prefix="reprokit-write") as pool:
                    # submit(): at interpreter exit the pool takes no work, and each file is written here in turn
                    futures = [hashing.submit(pool, tensorfile.write_safetensors, t, p) for t, p in zip(targets, parts)]
                    written = [f.result() for f in futures]
        except FileNotFoundError:
            raise self._vanished() from None
        for i, (sha, size) in enumerate(written):
            self.files[state_file_name(i)] = {"sha256": sha, "size": size}

    def link_file(self, rel: str, src: tensorfile.WrittenFile) -> None:
        """A file whose digest is known (it was hashed as it was written): hard-linked in where the filesystem
        allows (no second copy of a spilled state on disk, and no second read), else copied and checked."""
        path = self._target(rel)
        try:
            os.link(src.path, path)
        except FileNotFoundError:
            if not path.parent.is_dir():
                raise self._vanished() from None
            raise
        except OSError:  # another filesystem, or links not supported
            self.copy_file(rel, src.path)
            if self.files[rel] != {"sha256": src.sha256, "size": src.size}:
                raise BundleError(f"{src.path} changed since it was written (sha256 {self.files[rel]['sha256']}, "
                                  f"written as {src.sha256}); the snapshot on disk is damaged",
                                  [{"file": rel, "problem": "checksum mismatch"}]) from None
            return
        self.files[rel] = {"sha256": src.sha256, "size": src.size}

    def copy_file(self, rel: str, src: Path) -> None:
        """Copy a file in, chunk by chunk (state files may be larger than memory)."""

        path = self._target(rel)
        h, size = hashlib.sha256(), 0
        with open(src, "rb") as fin:
            try:
                fout = open(path, "wb")  # noqa: SIM115 - closed below
            except FileNotFoundError:
                raise self._vanished() from None
            with fout:
                for chunk in iter(lambda: fin.read(hashing.CHUNK), b""):
                    h.update(chunk)
                    fout.write(chunk)
                    size += len(chunk)
                fout.flush()
                os.fsync(fout.fileno())
        self.files[rel] = {"sha256": h.hexdigest(), "size": size}

    def commit(self) -> Path:
        """Write the manifest, check every file it lists is in place, and rename the bundle into place.

        Raises:
            BundleError: when a file is missing or has the wrong size (the temp dir or ``out_dir``
                was removed meanwhile); the temp dir is removed and nothing is committed.
        """
        try:
            self._check_in_place(self.files)
            manifest = {
                "format": FORMAT,
                "version": VERSION,
                "reprokit_version": __version__,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "files": dict(sorted(self.files.items())),
            }
            manifest["self_sha256"] = _self_digest(manifest)
            self.write_bytes(MANIFEST, dumps(manifest))
            listed = dict(self.files)
            self.files.pop(MANIFEST)
            _fsync_dir(self.tmp)
            self._check_in_place(listed)  # a cleanup racing the manifest write shows here
            final = self._rename_into_place()
        except BaseException:
            self.abort()
            raise
        self.committed = final
        _fsync_dir(self.out_dir)
        return final

    def _rename_into_place(self) -> Path:
        """Rename the temp dir to the bundle's name, or (taken) to ``name-1``, ``name-2``, ...; with ``exact``, to the
        name alone (an empty folder there is replaced: the output folder the user made).

        Checking a name is free and then renaming is a race: two recorders sharing an out_dir that fail at the same
        step in the same second both see ``name`` free. The rename itself decides: onto a folder that is not empty it
        fails (ENOTEMPTY/EEXIST), and the next name is tried, so neither bundle is lost."""
        n = 0
        while True:
            final = self.final if n == 0 else self.final.with_name(f"{self.final.name}-{n}")
            n += 1
            if not self.exact and (final.exists() or final.is_symlink()):
                continue
            try:
                os.rename(self.tmp, final)
                return final
            except FileNotFoundError:
                raise self._vanished() from None
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
                if self.exact:
                    raise BundleError(f"{final} was created by something else while this bundle was written (another "
                                      "reprokit command with the same output?); nothing was written there. Name a "
                                      "new folder and run again.") from None

    def _check_in_place(self, files: dict[str, dict[str, Any]]) -> None:
        wrong = []
        for rel, meta in files.items():
            try:
                size = os.stat(self.tmp / rel).st_size
            except OSError:
                wrong.append(f"{rel} (missing)")
                continue
            if size != meta["size"]:
                wrong.append(f"{rel} ({size} bytes, wrote {meta['size']})")
        if wrong:
            err = self._vanished() if not self.tmp.is_dir() else BundleError(
                f"{len(wrong)} of {len(files)} files of the bundle being written to {self.tmp} are not in place: "
                f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}. Was {self.out_dir} cleaned meanwhile? "
                "Nothing was committed.")
            raise err

    def abort(self) -> None:
        """Remove the temp dir (idempotent; a committed bundle is left alone)."""
        if self.committed is None:
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
                 state: tuple[dict[str, Any], dict[str, torch.Tensor] | list[tensorfile.WrittenFile]],
                 steps: Iterable[StepRecord], code: Iterable[tuple[str, Path]] = ()) -> Path:
    """Write every part of a bundle through ``w`` and commit it (manifest last).

    Any exception on the way, ``KeyboardInterrupt`` included, removes the temp dir before it propagates.
    """
    with w:
        return _write_parts(w, failure=failure, run=run, env=env, state=state, steps=steps, code=code)


def _write_parts(w: BundleWriter, *, failure: dict[str, Any], run: dict[str, Any], env: dict[str, Any],
                 state: tuple[dict[str, Any], dict[str, torch.Tensor] | list[tensorfile.WrittenFile]],
                 steps: Iterable[StepRecord], code: Iterable[tuple[str, Path]]) -> Path:
    w.write_json(FAILURE, failure)
    w.write_json(RUN, run)
    w.write_json(ENV, env)
    w.write_json(STATE_JSON, state[0])
    w.write_state(state[1])
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


CLAIM_SUFFIX = ".reprokit-writing"


@contextmanager
def claimed_output(path: Path) -> Iterator[None]:
    """Take the output folder ``path`` for this process before any work (``shrink -o``, ``extract -o``): a hidden
    ``.NAME.reprokit-writing`` file beside it, created atomically (``O_EXCL``), says which process writes it.

    Two commands given the same ``-o`` at once: the second is refused here, before its run, instead of finding the
    name taken after it (or writing ``NAME-1``). A claim whose writer is gone from this host is taken over.

    Raises:
        ReprokitError: another live process claimed ``path`` (exit 2: name another folder).
    """
    from reprokit.errors import ReprokitError

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    claim = path.parent / f".{path.name}{CLAIM_SUFFIX}"
    tag = _owner_tag()
    for _ in range(3):
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = claim.read_text()[:200]
            except OSError:
                owner = ""
            m = re.fullmatch(r"pid(\d+)\.(\d+)-on-([A-Za-z0-9]*)", owner)
            if m and m[3] == _host() and not _alive(int(m[1]), int(m[2])):
                claim.unlink(missing_ok=True)  # its writer died: take it over
                continue
            if not m and _age_s(claim) > STALE_CLAIM_S:
                claim.unlink(missing_ok=True)  # no owner written (killed between create and write, or a full disk)
                continue
            who = f"process {m[1]} on {m[3] or '?'}" if m else "another process"
            raise ReprokitError(f"{path} is being written by {who} (another reprokit command was given the same "
                                f"output: {claim} says so); name another folder, or wait for it to finish. If no "
                                f"such command runs, remove {claim}.") from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(tag)
        except BaseException:
            claim.unlink(missing_ok=True)  # an empty claim would block this output for good
            raise
        break
    else:
        raise ReprokitError(f"{claim} keeps reappearing; name another output folder")
    try:
        yield
    finally:
        claim.unlink(missing_ok=True)


STALE_CLAIM_S = 10.0
"""A claim file with no owner in it, older than this, was left by a writer killed before it wrote its name."""


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


# --- leftovers of killed writers ------------------------------------------------

# A temp dir's name ends with "-pid<pid>.<start>-on-<host>-<8 hex>": the writing process, its start time
# (clock ticks since boot, from /proc; 0 where unknown) so a recycled pid is not taken for the writer,
# and the host, so a folder on a shared filesystem written from another machine is not judged by our pids.
_TMP_RE = re.compile(r"^\.tmp-.+-pid(?P<pid>\d+)\.(?P<start>\d+)-on-(?P<host>[A-Za-z0-9]*)-[0-9a-f]{8}$")
_OLD_TMP_RE = re.compile(r"^\.tmp-.+-[0-9a-f]{8}$")  # before the owner was recorded
FOREIGN_AFTER_S = 24 * 3600.0
"""A temp dir whose writer cannot be checked (another host, or no owner in its name) counts as
abandoned once nothing in it changed for this long."""


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32]


def _start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks after boot), 0 where /proc does not say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _owner_tag() -> str:
    pid = os.getpid()
    return f"pid{pid}.{_start_ticks(pid)}-on-{_host()}"


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    except OSError:
        return False
    return not start or _start_ticks(pid) in (0, start)


@dataclass
class Leftover:
    """A temp dir a bundle writer left behind (or is still writing)."""

    path: Path
    bytes: int
    age_s: float
    """Seconds since anything in it last changed."""
    owner: str
    """``pid N on HOST``, or ``unknown`` for temp dirs named before owners were recorded."""
    state: str
    """``writing`` (its writer is alive on this host: never removed), ``abandoned`` (writer gone, or
    unknown owner idle for ``foreign_after_s``), or ``recent`` (unknown owner, changed lately: kept)."""
    removed: bool = False
    error: str | None = None

    @property
    def removable(self) -> bool:
        return self.state == "abandoned"

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "bytes": self.bytes, "age_s": round(self.age_s, 1), "owner": self.owner,
                "state": self.state, "removed": self.removed, "error": self.error}


def find_leftovers(out_dir: str | Path, *, foreign_after_s: float = FOREIGN_AFTER_S) -> list[Leftover]:
    """Temp dirs of bundle writers in ``out_dir`` (``.tmp-*``, hidden by their dot), oldest first.

    A temp dir is ``abandoned`` when its writer's pid is gone from this host (or now belongs to a
    process started at another time), or, when the writer cannot be checked (another host, an old
    name without owner), when nothing in it changed for ``foreign_after_s`` seconds.

    Example:
        >>> [(x.path.name, x.state, x.bytes) for x in find_leftovers("repros")]   # doctest: +SKIP
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    host, now, found = _host(), time.time(), []
    for d in out_dir.iterdir():
        if not d.name.startswith(TMP_PREFIX) or d.is_symlink() or not d.is_dir():
            continue
        m = _TMP_RE.match(d.name)
        if m is None and not _OLD_TMP_RE.match(d.name):
            continue
        size, newest = _du(d)
        age = max(0.0, now - newest)
        if m is not None and m["host"] == host:
            pid, start = int(m["pid"]), int(m["start"])
            state = "writing" if _alive(pid, start) else "abandoned"
        else:
            state = "abandoned" if age >= foreign_after_s else "recent"
        owner = f"pid {m['pid']} on {m['host'] or '?'}" if m else "unknown"
        found.append(Leftover(path=d, bytes=size, age_s=age, owner=owner, state=state))
    return sorted(found, key=lambda x: (-x.age_s, x.path.name))


def remove_leftovers(out_dir: str | Path, *, dry_run: bool = False,
                     foreign_after_s: float = FOREIGN_AFTER_S) -> list[Leftover]:
    """Find leftovers (see :func:`find_leftovers`) and remove the abandoned ones; ``writing`` and
    ``recent`` ones are listed but kept. Returns every leftover found, with ``removed`` and ``error``."""
    found = find_leftovers(out_dir, foreign_after_s=foreign_after_s)
    for x in found:
        if x.removable and not dry_run:
            try:
                remove_tree(x.path)
                x.removed = True
            except OSError as e:
                x.error = f"{type(e).__name__}: {e}"
    return found


def _du(d: Path) -> tuple[int, float]:
    """Total bytes under ``d`` and its newest mtime (symlinks not followed; without recursion: ``os.walk`` recursed
    once per level before Python 3.12, and a leftover nesting 3000 folders crashed ``gc``)."""
    size, newest = 0, d.lstat().st_mtime
    todo = [d]
    while todo:
        try:
            with os.scandir(todo.pop()) as it:
                entries = list(it)
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if entry.is_dir(follow_symlinks=False):
                todo.append(Path(entry.path))
            else:
                size += st.st_size
    return size, newest


def remove_tree(root: Path) -> None:
    """``shutil.rmtree`` without recursion and at any depth: ``rmtree`` recursed once per level before Python 3.12 (a
    leftover nesting 3000 folders raised RecursionError), and a path that deep is longer than the OS takes.

    Each folder found inside is first renamed to the top of ``root`` (relative to open folders, never by its long
    path), then emptied and removed there: at most two folders are open at a time, whatever the depth. Links are
    removed, never followed. Raises the first ``OSError``.
    """
    if root.is_symlink() or not root.is_dir():
        root.unlink()
        return
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    top = os.open(root, flags)
    try:
        n = 0
        with os.scandir(top) as it:
            entries = list(it)
        names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                os.unlink(e.name, dir_fd=top)
        todo = names
        while todo:
            name = todo.pop()
            fd = os.open(name, flags, dir_fd=top)
            try:
                with os.scandir(fd) as it:
                    inner = list(it)
                for e in inner:
                    if e.is_dir(follow_symlinks=False):
                        while True:  # a name free at the top
                            n += 1
                            flat = f".rk-rm-{n}"
                            try:
                                os.stat(flat, dir_fd=top, follow_symlinks=False)
                            except FileNotFoundError:
                                break
                        os.rename(e.name, flat, src_dir_fd=fd, dst_dir_fd=top)
                        todo.append(flat)
                    else:
                        os.unlink(e.name, dir_fd=fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(root)


# --- verifying ------------------------------------------------------------------

def verify(path: Path, *, hash_tensors: bool = True) -> list[dict[str, Any]]:
    """Every problem with a bundle directory: ``[{"file", "problem", "expected", "found"}]``.

    An empty list means every file matches the manifest and nothing extra is there. With
    ``hash_tensors=False`` the ``.safetensors`` files are checked for size and header only, not
    hashed (``inspect``, and :func:`open_bundle`, which hashes each one when it reads it).

    Raises:
        BundleError: when ``path`` is not a directory.
        BundleVersionError: when the bundle's format version is newer than this reprokit.
    """
    return _verify(Path(path), hash_tensors)[1]


def _verify(path: Path, hash_tensors: bool) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """:func:`verify`, and the manifest it checked the bundle against (None when it was unusable): the one
    :func:`open_bundle` keeps, never a second read of a file that could have been swapped meanwhile."""
    if not path.is_dir():
        raise BundleError(f"{path} is not a bundle directory (expected a folder holding {MANIFEST})")
    manifest, problems = _read_manifest(path)
    if manifest is None:
        return None, problems
    listed: dict[str, Any] = manifest["files"]
    json_bytes = sum(meta["size"] for rel, meta in listed.items() if not rel.startswith(f"{CODE}/")
                     and rel.endswith(".json"))
    if json_bytes > MAX_TOTAL_JSON_BYTES:  # each file has its own cap (schema); this bounds the sum
        return manifest, [{"file": MANIFEST, "problem": f"lists {json_bytes} bytes of JSON files; a bundle holds at "
                                                        f"most {MAX_TOTAL_JSON_BYTES} (metadata only: tensors live "
                                                        "in safetensors); not read", "expected": MAX_TOTAL_JSON_BYTES,
                           "found": json_bytes}]
    def unsafe(rel: str) -> bool:
        return rel.startswith("/") or ".." in Path(rel).parts

    def aliased(rel: str) -> bool:  # "./run.json", "steps//x": a second spelling of a file the manifest may list
        return any(p in ("", ".") for p in rel.split("/"))

    def plain(rel: str) -> bool:
        return not unsafe(rel) and not aliased(rel) and (path / rel).is_file() and not (path / rel).is_symlink()

    digests = _sha256_many([path / rel for rel in listed if plain(rel)
                            and (hash_tensors or not rel.endswith(".safetensors"))])
    for rel, meta in sorted(listed.items()):
        target = path / rel
        if unsafe(rel):
            problems.append({"file": rel, "problem": "unsafe path in manifest"})
        elif aliased(rel):
            problems.append({"file": rel, "problem": "not a plain path in the manifest (an empty or '.' part): each "
                                                     "file is listed once, by one spelling"})
        elif target.is_symlink():
            problems.append({"file": rel, "problem": "a link, not a file (a bundle holds regular files only)"})
        elif not target.is_file():
            problems.append({"file": rel, "problem": "missing", "expected": meta.get("sha256")})
        elif not hash_tensors and rel.endswith(".safetensors"):
            if target.stat().st_size != meta.get("size"):
                problems.append({"file": rel, "problem": "size mismatch", "expected": meta.get("size"),
                                 "found": target.stat().st_size})
        elif isinstance(found := digests[target], OSError):
            problems.append({"file": rel, "problem": f"cannot be read: {found.strerror or found}"})
        else:
            if found != meta.get("sha256"):
                problems.append({"file": rel, "problem": "checksum mismatch", "expected": meta.get("sha256"),
                                 "found": found})
            elif target.stat().st_size != meta.get("size"):
                problems.append({"file": rel, "problem": "size mismatch", "expected": meta.get("size"),
                                 "found": target.stat().st_size})
    for rel in sorted(listed):
        parts = rel.split("/")
        if parts[0] == CODE and (not rel.endswith(".py") or "__pycache__" in parts):
            # Python imports a __pycache__ .pyc (an unchecked-hash one never looks at the source) or a native
            # module beside a .py in preference to it: the code that ran would not be the source anyone can read.
            problems.append({"file": rel, "problem": "not Python source: a code snapshot holds .py files only "
                                                     "(replay never runs compiled or native code in place of the "
                                                     "source it shows)"})
    problems += _code_problems(path, listed, {p["file"] for p in problems})
    problems += _layout_problems(listed, {p["file"] for p in problems})
    reported = {p["file"] for p in problems}
    problems += generated.bundle_problems(path, {rel: meta for rel, meta in listed.items() if rel not in reported},
                                          manifest.get("reprokit_version"))
    for rel, link, folder in _entries(path, problems):
        if rel in listed and link:
            continue  # reported above
        if link or (not folder and rel != MANIFEST and rel not in listed):
            problems.append({"file": rel, "problem": "unexpected file"})
    # Consistent is not well-formed: hold every JSON file and safetensors header to its schema too
    # (files reported above are not read again).
    problems += schema.check_bundle(path, listed, skip={p["file"] for p in problems})
    if REPLICATED in listed and not any(p["file"] == REPLICATED for p in problems):
        from reprokit.distributed import replicated

        try:
            ref = schema.load_listed_json(path, REPLICATED, listed[REPLICATED])
        except BundleError as e:  # swapped since it was checked above
            return manifest, problems + e.problems
        problems += [{k: v for k, v in x.items() if k != "status"}
                     for x in replicated.check(path, ref, hash_tensors=hash_tensors) if x["status"] != "ok"]
    return manifest, problems


LAYOUT = (re.compile(r"(failure|run|env)\.json"), re.compile(r"state/(state|replicated)\.json"),
          schema.STATE_FILE, re.compile(r"state/rng\.safetensors"), schema.STEP_FILE, re.compile(r"code/.+\.py"),
          re.compile(r"extract/op\.(json|safetensors)"), re.compile(re.escape(generated.OP_REPRO)))
"""Every file a bundle may list (the manifest itself is never listed): what any reprokit writes."""


def _layout_problems(listed: dict[str, Any], skip: set[str]) -> list[dict[str, Any]]:
    """Files the manifest lists that no reprokit writes (``notes.txt``, ``extract/run_me.sh``): no command reads
    them, but ``pack`` would ship them and a reader could take them for reprokit's. Problems, like a file the
    manifest does not list."""
    return [{"file": rel, "problem": "not part of the bundle layout (no reprokit writes this file; see the bundle "
                                     "layout in the README): remove it and re-record, or ask the sender"}
            for rel in sorted(listed) if rel not in skip and not any(r.fullmatch(rel) for r in LAYOUT)]


def _code_problems(path: Path, listed: dict[str, Any], skip: set[str]) -> list[dict[str, Any]]:
    """Code files no command can read safely: larger than :data:`reprokit.code.MAX_CODE_BYTES` (replay reads each
    whole into memory, pack parses it), or nested so deeply that Python's parser gives up (RecursionError,
    MemoryError: pack reads the imports of the code it ships, replay compiles it)."""
    import ast

    from reprokit.code import MAX_CODE_BYTES

    out: list[dict[str, Any]] = []
    for rel, meta in sorted(listed.items()):
        if not rel.startswith(f"{CODE}/") or not rel.endswith(".py") or rel in skip:
            continue
        if meta["size"] > MAX_CODE_BYTES:
            out.append({"file": rel, "problem": f"a code file of {meta['size']} bytes; a code snapshot's files are at "
                                                f"most {MAX_CODE_BYTES} bytes each (source a person can read); not "
                                                "read", "expected": MAX_CODE_BYTES, "found": meta["size"]})
            continue
        try:
            with hashing.open_regular(path / rel) as f:
                source = f.read(MAX_CODE_BYTES + 1)
            ast.parse(source)
        except (RecursionError, MemoryError):
            out.append({"file": rel, "problem": "Python source nested too deeply for Python's parser (it gives up "
                                                "with a RecursionError or MemoryError): no project's code looks like "
                                                "this; refused"})
        except (SyntaxError, ValueError, OSError):
            pass  # not ours to judge here (replay reports an import that fails); unreadable files are reported above
    return out


def _entries(root: Path, problems: list[dict[str, Any]]) -> list[tuple[str, bool, bool]]:
    """``(rel, is a link, is a folder)`` of everything under ``root``, sorted by path, links not followed.

    Without recursion (``Path.rglob`` recursed once per level: a bundle folder nesting a thousand empty folders
    crashed ``verify`` with a RecursionError); a folder that cannot be listed (a path too long for the OS) is a
    problem in ``problems``.
    """
    found: list[tuple[str, bool, bool]] = []
    todo = [""]
    while todo:
        rel_dir = todo.pop()
        try:
            with os.scandir(root / rel_dir) as it:
                entries = list(it)
        except OSError as e:
            problems.append({"file": rel_dir, "problem": f"folder cannot be listed: {e.strerror or e}"})
            continue
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            link = entry.is_symlink()
            folder = not link and entry.is_dir(follow_symlinks=False)
            if folder:
                todo.append(rel)
            found.append((rel, link, folder))
    return sorted(found, key=lambda x: x[0].split("/"))


def _sha256_many(paths: list[Path]) -> dict[Path, str | OSError]:
    """sha256 of every file, several at once (one file's hash is one sequential stream, so a bundle's
    files are spread over the cores, largest first); the ``OSError`` for a file that cannot be read (a FIFO
    or a device swapped in, permissions)."""
    def digest(p: Path) -> str | OSError:
        try:
            return sha256_file(p)
        except OSError as e:
            return e

    workers = min(len(paths), os.cpu_count() or 1, 8)
    if workers <= 1:
        return {p: digest(p) for p in paths}
    order = sorted(paths, key=lambda p: -p.stat().st_size)
    with ThreadPoolExecutor(workers, thread_name_prefix="reprokit-verify") as pool:
        return dict(zip(order, pool.map(digest, order)))


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    mpath = path / MANIFEST
    if not mpath.is_file():
        return None, [{"file": MANIFEST, "problem": "missing (an interrupted write, or not a bundle)"}]
    try:
        manifest = schema.load_json(mpath, MANIFEST)
    except schema.SchemaError as e:
        return None, e.problems
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        return None, [{"file": MANIFEST, "problem": f"not a {FORMAT} manifest"}]
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return None, [{"file": MANIFEST, "problem": f"unknown format version {version!r}"}]
    if version > VERSION:
        raise BundleVersionError(
            f"{path} uses bundle format version {version}, but this reprokit ({__version__}) reads versions "
            f"up to {VERSION}. Upgrade reprokit (pip install -U reprokit) to open it."
        )
    unknown = sorted(set(manifest) - MANIFEST_KEYS)
    if "self_sha256" not in manifest and not (set(manifest) == LEGACY_KEYS and version == 1):
        # Only the first release's manifests lack the digest, and they hold exactly LEGACY_KEYS; one
        # renamed key must not switch the check off.
        extra = f" (and unknown field(s) {', '.join(map(repr, unknown))}: a damaged manifest?)" if unknown else ""
        return None, [{"file": MANIFEST, "problem": f"no self_sha256 digest{extra}; every manifest carries one"}]
    if unknown:
        return None, [{"file": MANIFEST, "problem": f"unknown field(s) {', '.join(map(repr, unknown))}"}]
    if "self_sha256" in manifest and manifest["self_sha256"] != _self_digest(manifest):
        # An altered manifest cannot vouch for any other file: report it alone.
        return None, [{"file": MANIFEST, "problem": "checksum mismatch (the manifest itself was altered)",
                           "expected": manifest["self_sha256"], "found": _self_digest(manifest)}]
    try:
        schema.check_manifest(manifest, MANIFEST)
    except schema.SchemaError as e:
        return None, e.problems
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

    def code_files(self) -> dict[str, bytes]:
        """The code snapshot's files, ``{"code/train.py": bytes}``, each read once and kept only if those bytes
        hash to the manifest's digest: replay imports a private copy written from them (:func:`reprokit.code.
        materialize`), never the bundle folder, where a file swapped after verification would run unchecked.

        Raises:
            BundleError: a code file cannot be read, is not a regular file, or changed since the manifest was
                checked.
        """
        out = {}
        for rel, meta in sorted(self.manifest["files"].items()):
            if not rel.startswith(f"{CODE}/"):
                continue
            try:
                with hashing.open_regular(self.path / rel) as f:
                    data = f.read(meta["size"] + 1)  # one byte more: a longer file shows as a size mismatch
            except OSError as e:
                raise BundleError(f"{self.path}: {rel} cannot be read ({e.strerror or e}). {_FIX}",
                                  [{"file": rel, "problem": f"cannot be read: {e.strerror or e}"}]) from None
            found = hashlib.sha256(data).hexdigest()
            if len(data) != meta["size"] or found != meta["sha256"]:
                raise BundleError(f"{self.path}: {rel} changed since the manifest was checked (sha256 {found}, the "
                                  f"manifest says {meta['sha256']}); refusing to import it. {_FIX}",
                                  [{"file": rel, "problem": "checksum mismatch", "expected": meta["sha256"],
                                    "found": found}])
            out[rel] = data
        return out

    def state(self, on_part: Callable[[dict[str, torch.Tensor]], None] | None = None
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(tree, tensors)`` of the snapshot the window starts from (a state another rank's bundle holds, for a bundle
        that references it: see :mod:`reprokit.distributed.replicated`).

        ``on_part(tensors)`` is called with each state file's tensors as soon as that file is read and verified (on
        the reading thread, while other files may still be read; on this thread for a state in one file), never
        with a file that failed its check; an exception it raises propagates. Replay starts copying the tensors to
        the GPU there. Not called for a state another rank's bundle holds.
        """
        from reprokit import tensorfile

        if REPLICATED in self.manifest["files"]:
            from reprokit.distributed import replicated

            return self.state_tree(), replicated.state(self)
        rels = state_files(self.manifest["files"])
        if not rels:
            raise BundleError(f"{self.path}: the manifest lists no complete set of state files "
                              f"({STATE_TENSORS}, state/state-1.safetensors, ...); the bundle is incomplete. {_FIX}",
                              [{"file": STATE_TENSORS, "problem": "missing"}])
        def read(rel: str) -> dict[str, torch.Tensor]:
            part = self._tensors(rel)
            if on_part is not None:
                on_part(part)
            return part

        tree = self.state_tree()
        if len(rels) == 1:
            tensors = read(rels[0])
        else:
            with ThreadPoolExecutor(tensorfile.parallelism(len(rels)), thread_name_prefix="reprokit-read") as pool:
                parts = list(pool.map(read, rels))  # each file hashed as it is read, several at once
            tensors = {}
            for rel, part in zip(rels, parts):
                twice = tensors.keys() & part.keys()
                if twice:
                    raise BundleError(f"{self.path}: {rel} holds {sorted(twice)[0]!r} again (already in an earlier "
                                      f"state file); refusing an ambiguous state. {_FIX}",
                                      [{"file": rel, "problem": "duplicate tensor"}])
                tensors |= part
        # verify held the headers it read to the tree; these are the tensors of the bytes that hashed right.
        schema.check_state(tree, set(tensors), STATE_JSON)
        return tree, tensors

    def state_tree(self) -> dict[str, Any]:
        """The snapshot's JSON alone (no tensor is read)."""
        return self._json(STATE_JSON)

    def step(self, step: int) -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
        """``(batch, rng_tree, rng_tensors)`` recorded for one step of the window."""
        doc, tensors = self.step_doc(step)
        rng_tensors = {k: v for k, v in tensors.items() if k.startswith("rng/")}
        return pytree.decode(doc["batch"], tensors), doc["rng"], rng_tensors

    def step_doc(self, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(doc, tensors)`` of one step's files, both read from bytes that hash to the manifest's digests and
        held to the step schema together (the document names only tensors the file holds)."""
        name = f"{STEPS}/{step_name(step)}"
        doc, tensors = self._json(name + ".json"), self._tensors(name + ".safetensors")
        schema.check_step(doc, step, set(tensors), name + ".json")
        return doc, tensors

    def _json(self, rel: str) -> Any:
        """One JSON file, parsed from bytes whose size and sha256 are the manifest's (read once: a file swapped
        since :func:`open_bundle` verified the bundle is refused)."""
        meta = self.manifest["files"].get(rel)
        if meta is None:
            raise BundleError(f"{self.path}: {rel} is not in the manifest; the bundle is incomplete. {_FIX}",
                              [{"file": rel, "problem": "missing"}])
        return schema.load_listed_json(self.path, rel, meta)

    def _tensors(self, rel: str) -> dict[str, torch.Tensor]:
        """The tensors of one file, read once: hashed while read, and made only once the digest matched."""
        from reprokit import tensorfile

        meta = self.manifest["files"].get(rel)
        if meta is None:
            raise BundleError(f"{self.path}: {rel} is not in the manifest; the bundle is incomplete. {_FIX}",
                              [{"file": rel, "problem": "missing"}])
        try:
            return tensorfile.read_verified(self.path / rel, meta["sha256"], meta["size"])
        except tensorfile.TensorFileError as e:
            raise BundleError(f"{self.path}: {rel}: {e}; refusing to load it. {_FIX}",
                              [{"file": rel, "problem": str(e)}]) from None
        except OSError as e:
            raise BundleError(f"{self.path}: {rel} cannot be read ({e.strerror or e}). {_FIX}",
                              [{"file": rel, "problem": f"cannot be read: {e.strerror or e}"}]) from None

    def sizes(self) -> dict[str, int]:
        """Bytes on disk per part: state, batches (steps/), code, metadata, and the vendored runtime
        when the bundle sits in an unpacked ``reprokit pack`` archive."""
        out = {**part_sizes(self.manifest["files"]), "runtime": 0}
        top = self.path.parent
        if (top / "repro.py").is_file() and (top / "reprokit").is_dir():
            # Not verified with the bundle: walked without recursion or links (a deep tree, a link out).
            runtime = [top / "repro.py", top / "README.md", *(top / "reprokit" / rel for rel, link, folder
                                                                in _entries(top / "reprokit", []) if not link
                                                                and not folder)]
            out["runtime"] = sum(p.lstat().st_size for p in runtime if p.is_file() and not p.is_symlink())
        return out


_FIX = "Ask the sender for an intact copy, or run `reprokit verify` for details."


def folder_of_bundles(path: Path) -> str | None:
    """What to say when PATH is a folder that holds bundles (the recorder's ``out_dir``, an incident folder) but is
    not one itself, so that the user reads the bundles' names rather than only that ``manifest.json`` is missing."""
    if not path.is_dir() or (path / MANIFEST).exists():
        return None
    inner = sorted(p for p in path.iterdir() if p.is_dir() and (p / MANIFEST).is_file())
    if not inner:
        from reprokit.distributed.incident import is_incident

        holders = sorted(p for p in path.iterdir() if is_incident(p))  # folders one level up from bundles
        incidents = [p for p in holders if _is_incident_folder(p)]  # the out_dir of a multi-rank run
        if incidents:
            shown = ", ".join(p.name for p in incidents[-3:]) + (f" and {len(incidents) - 3} more"
                                                                 if len(incidents) > 3 else "")
            return (f"{path} is not a bundle but a folder holding {len(incidents)} incident folder(s) of a "
                    f"multi-rank run: {shown}. Replay one whole, e.g. `reprokit replay {incidents[-1]}`, or pass "
                    "one rank's bundle in it.")
        # Not incidents: a project folder holding its out_dir, a folder of unpacked repros (repro-*/bundle).
        found = [b for h in holders for b in sorted(h.iterdir()) if b.is_dir() and (b / MANIFEST).is_file()]
        if not found:
            return None
        shown = ", ".join(str(b.relative_to(path)) for b in found[:3]) + (f" and {len(found) - 3} more"
                                                                          if len(found) > 3 else "")
        return (f"{path} is not a bundle; bundle folders lie one level further down: {shown}. Pass one of them, "
                f"e.g. {found[-1]}")
    shown = ", ".join(p.name for p in inner[:3]) + (f" and {len(inner) - 3} more" if len(inner) > 3 else "")
    whole = (f" (an incident folder of a multi-rank run replays whole: `reprokit replay {path}`)"
             if _is_incident_folder(path) else "")
    return (f"{path} is not a bundle but a folder holding {len(inner)} bundle folder(s): {shown}. Pass one of "
            f"them, e.g. {inner[-1]}{whole}.")


_RANK_SUFFIX = re.compile(r"-rank\d+of\d+$")


def _is_incident_folder(folder: Path) -> bool:
    """An incident folder of a multi-rank run, told by the names the recorder gives: ``incident-...``, or
    bundles named ``...-rankNofM``."""
    return folder.name.startswith("incident-") or any(
        _RANK_SUFFIX.search(p.name) for p in folder.iterdir() if p.is_dir() and (p / MANIFEST).is_file())


def open_bundle(path: str | Path) -> Bundle:
    """Verify a bundle directory, then open it.

    Every JSON file and the code snapshot are hashed here, and every file's size and safetensors
    header checked; each tensor file is hashed when it is read (:meth:`Bundle.state`,
    :meth:`Bundle.step`), in the same pass, before any tensor is made from it. So loading a state
    reads it once, and a tampered tensor file is refused when it is loaded (``BundleError``).

    Raises:
        BundleError: listing every problem when verification fails.
        BundleVersionError: for a bundle written by a newer format version.

    Example:
        >>> b = open_bundle("repros/bundle-...")                  # doctest: +SKIP
        >>> b.failure.kind, b.steps                               # doctest: +SKIP
    """
    if path is None:  # TrainingFailure.bundle when the recorder could not write one
        raise BundleError("no bundle to open: got None (a TrainingFailure's .bundle is None when the recorder could "
                          "not write its bundle; its RecorderWarning says why)", [{"file": MANIFEST,
                                                                                  "problem": "missing"}])
    path = Path(path)
    if path.is_dir() and next(path.iterdir(), None) is None:
        raise BundleError(f"{path} is an empty folder, not a bundle; pass a bundle folder the recorder wrote "
                          "(bundle-..., with manifest.json in it)", [{"file": MANIFEST, "problem": "missing"}])
    hint = folder_of_bundles(path)  # the recorder's out_dir, or an incident folder, passed where one bundle goes
    if hint:
        raise BundleError(hint, [{"file": MANIFEST, "problem": "missing"}])
    if path.is_dir() and not any((path / name).exists() for name in (MANIFEST, RUN, FAILURE, ENV, "state", STEPS)):
        # Some other folder (a project, a download): not a damaged bundle, so asking the sender is no help.
        raise BundleError(f"{path} is not a bundle folder: it holds none of a bundle's files ({MANIFEST}, {RUN}, "
                          f"state/, {STEPS}/). Pass a bundle folder the recorder wrote (bundle-..., with "
                          f"{MANIFEST} in it) or an archive `reprokit pack` wrote.",
                          [{"file": MANIFEST, "problem": "missing (not a bundle folder)"}])
    manifest, problems = _verify(path, hash_tensors=False)
    if problems or manifest is None:
        from reprokit.text import one_line

        lines = "\n".join(one_line(f"  {p['file']}: {p['problem']}") for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise BundleError(
            f"{path} failed verification ({len(problems)} problem(s)); refusing to load it:\n{lines}{more}\n"
            + _FIX,
            problems,
        )
    # The manifest verify checked, and each file parsed from bytes that hash to its digest there (a file
    # swapped after verify is refused, never read unchecked).
    docs = {rel: schema.load_listed_json(path, rel, manifest["files"][rel]) for rel in (RUN, FAILURE, ENV)
            if rel in manifest["files"]}
    missing = {RUN, FAILURE, ENV} - docs.keys()
    if missing:
        raise BundleError(f"{path} has a valid manifest but lacks {', '.join(sorted(missing))}")
    for v in range(manifest["version"], VERSION):
        docs = UPGRADES[v](docs)
    return Bundle(path=path, manifest=manifest, docs=docs)
