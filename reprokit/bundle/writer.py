"""Write bundles: the one writer every command uses (the recorder, shrink, extract, a referencing bundle's copy).

:class:`BundleWriter` builds a bundle in a hidden temp dir beside its final name, fsyncs every file, writes the
manifest last and renames the folder into place; :func:`write_bundle` writes every part of a bundle through it, its
state either its own tensors or, for a rank of a replicated DDP run, a reference to the owner rank's
(:mod:`reprokit.bundle.reference`). Writers killed outright leave their temp dirs behind, named after their
process: :func:`find_leftovers` and :func:`remove_leftovers` (``reprokit gc``) find and remove abandoned ones.
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
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprokit._version import __version__
from reprokit.bundle import hashing
from reprokit.bundle.hashing import _self_digest
from reprokit.bundle.layout import (
    CLAIM_SUFFIX,
    CODE,
    ENV,
    FAILURE,
    FORMAT,
    LOCAL_RNG,
    MANIFEST,
    OLD_TMP_DIR,
    REPLICATED,
    RUN,
    STATE_JSON,
    STEPS,
    TMP_DIR,
    TMP_PREFIX,
    VERSION,
    state_file_name,
    step_name,
)
from reprokit.errors import BundleError, ReprokitError

if TYPE_CHECKING:
    import torch

    from reprokit.bundle import tensorfile

# torch and reprokit.bundle.tensorfile (whose dtype table needs torch) are imported only by the methods that write
# tensors: opening and verifying a bundle (inspect) must not pay torch's import.

# --- JSON that stays strict (NaN/inf as strings) ------------------------------

def jsonable(obj: Any) -> Any:
    """Replace non-finite floats by ``"nan"``/``"inf"``/``"-inf"`` so output is strict JSON, and an unpaired
    surrogate in a string (a file name decoded with ``surrogateescape`` in an exception message) by its
    ``\\udcff`` spelling: readers refuse strings that are not Unicode text (:mod:`reprokit.bundle.schema`)."""
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


# --- writing --------------------------------------------------------------------

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
        (:func:`reprokit.bundle.tensorfile.write_safetensors`); a Path is an already-written safetensors
        file, copied in chunks."""
        from reprokit.bundle import tensorfile

        if isinstance(tensors, Path):
            self.copy_file(rel, tensors)
            return
        try:
            sha, size = tensorfile.write_safetensors(self._target(rel), tensors)
        except FileNotFoundError:
            raise self._vanished() from None
        self.files[rel] = {"sha256": sha, "size": size}

    def write_state(self, tensors: dict[str, torch.Tensor] | list[tensorfile.WrittenFile]) -> None:
        """The state's tensors, in files of at most :data:`~reprokit.bundle.tensorfile.SHARD_BYTES` written several at
        once (each hashed as it is written); a spilled snapshot's files, already on disk, are linked in (else copied)."""
        from reprokit.bundle import tensorfile

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
                 steps: Iterable[StepRecord], code: Iterable[tuple[str, Path]] = (),
                 reference: dict[str, Any] | None = None) -> Path:
    """Write every part of a bundle through ``w`` and commit it (manifest last).

    Args:
        state: ``(tree, tensors)``: the snapshot's JSON (``state/state.json``) and its tensors, or the files of a
            spilled snapshot already on disk.
        steps: the window, one record per step (``steps/``).
        code: ``(path in code/, source file)`` of the code snapshot.
        reference: state by reference (:mod:`reprokit.bundle.reference`): the ``state/replicated.json`` document
            naming the owner rank's bundle and state files. The state's tensors are then the owner's; ``tensors``
            holds only this rank's own (its RNG states), written to ``state/rng.safetensors``.

    Any exception on the way, ``KeyboardInterrupt`` included, removes the temp dir before it propagates.
    """
    with w:
        return _write_parts(w, failure=failure, run=run, env=env, state=state, steps=steps, code=code,
                            reference=reference)


def _write_parts(w: BundleWriter, *, failure: dict[str, Any], run: dict[str, Any], env: dict[str, Any],
                 state: tuple[dict[str, Any], dict[str, torch.Tensor] | list[tensorfile.WrittenFile]],
                 steps: Iterable[StepRecord], code: Iterable[tuple[str, Path]],
                 reference: dict[str, Any] | None) -> Path:
    tree, tensors = state
    w.write_json(FAILURE, failure)
    w.write_json(RUN, run)
    w.write_json(ENV, env)
    w.write_json(STATE_JSON, tree)
    if reference is None:
        w.write_state(tensors)
    else:
        if not isinstance(tensors, dict):
            raise TypeError("a bundle that references another's state holds its own RNG tensors as a dict, "
                            f"got {type(tensors).__name__}")
        w.write_json(REPLICATED, reference)
        w.write_tensors(LOCAL_RNG, tensors)
    for rec in steps:
        name = f"{STEPS}/{step_name(rec.step)}"
        w.write_json(name + ".json", {"step": rec.step, "batch": rec.batch, "rng": rec.rng,
                                      "loss": rec.loss, "grad_norm": rec.grad_norm})
        w.write_tensors(name + ".safetensors", rec.tensors)
    for rel, src in code:
        w.copy_file(f"{CODE}/{rel}", src)
    return w.commit()


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


@contextmanager
def claimed_output(path: Path) -> Iterator[None]:
    """Take the output folder ``path`` for this process before any work (``shrink -o``, ``extract -o``): a hidden
    ``.NAME.reprokit-writing`` file beside it, created atomically (``O_EXCL``), says which process writes it.

    Two commands given the same ``-o`` at once: the second is refused here, before its run, instead of finding the
    name taken after it (or writing ``NAME-1``). A claim whose writer is gone from this host is taken over.

    Raises:
        ReprokitError: another live process claimed ``path`` (exit 2: name another folder).
    """
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

# A temp dir's name says which process writes it (layout.TMP_DIR): the pid, its start time and the host.
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
        m = TMP_DIR.match(d.name)
        if m is None and not OLD_TMP_DIR.match(d.name):
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
