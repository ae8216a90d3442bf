"""Open bundles that come from other people: tarballs checked before anything is written.

Archives are plain ``.tar`` (what ``reprokit pack`` writes) or ``.tar.gz`` (earlier versions);
gzip is recognised by its magic bytes, whatever the name.

The order of defences: (1) the archive's own sha256, when a ``.sha256`` sits
beside it or one is given, before decompressing a byte; (2) a pre-scan of
every member header, reading but writing nothing, that refuses links,
devices, FIFOs, absolute or ``..`` paths, duplicate and case-colliding names,
caps member count, file size, total size, compression ratio and every header,
name and sidecar read, and reads the stream to its end (the gzip CRC and
length are checked; a damaged header is an error, never a silent end);
(3) extraction into a fresh temporary directory by the same reader, which
creates only regular files and folders; (4) the manifests: the packed
archive's ``pack-manifest.json`` must cover every file (``repro.py`` and the
vendored runtime included), and the bundle's own manifest every bundle file.
Every problem found is reported, not only the first.

The tar reader is our own (ustar, GNU long names, pax records), about a
hundred lines: ``tarfile`` reads a GNU long name or a pax header whole however
large it claims to be, and stops without a word at a damaged header after the
first member. It reads every number in a header with a bounded number of digits (a pax record's
length and ``size`` at most 20), so a crafted header costs its bytes, never quadratic time
(CPython's tarfile took 79-135 s on a 200,000-digit pax record), and never escapes as a
``ValueError`` (Python refuses ``int()`` of more than 4,300 digits).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import shutil
import struct
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, cast

from reprokit.archive_limits import Limits
from reprokit.bundle import _self_digest, schema, sha256_file, verify
from reprokit.bundle.layout import MANIFEST
from reprokit.errors import BundleError, BundleVersionError, ConfigError

# This module must not import torch (nor does reprokit.bundle until tensors are read): verify and inspect of an
# archive need none; reprokit.pack is imported inside the functions that use it. Limits lives in
# reprokit.archive_limits, which the command line reads at start-up for its --max-* defaults (reprokit.archive.Limits
# is the same class).
PACK_MANIFEST = "pack-manifest.json"  # reprokit.pack.PACK_MANIFEST

MAX_PROBLEMS = 100
SIDECAR_MAX_BYTES = 4096
"""A ``.sha256`` file holds one line; a larger one is refused unread."""
BLOCK = 512
CHUNK = 8 << 20
COMPILED = (".pyc", ".pyo", ".so", ".pyd", ".dylib", ".dll")
"""Names Python would import as bytecode or native code, in preference to (or without) a ``.py``."""
MAX_PATH_PARTS = 128
"""Most names in one member's path: a bundle nests a few folders, a code snapshot a few more. A thousand nested
folders would crash Python's own recursive tree walks (``shutil.rmtree`` of the temp dir among them)."""
MAX_PAX_NUMBER_DIGITS = 20
"""A pax ``size`` (or record length) is a 64-bit count: more digits are refused before ``int()`` sees them."""


class _Refused(Exception):
    """The archive cannot be read further; ``file`` names the member when one is to blame."""

    def __init__(self, problem: str, file: str | None = None):
        super().__init__(problem)
        self.file = file


class _Stream:
    """The archive's tar stream (gunzipped when it is a .tar.gz), read in bounded pieces; refuses to
    inflate past the caps.

    Every decompression error (a bad CRC or length in the gzip trailer, a corrupt deflate
    stream, a truncated file) becomes :class:`_Refused`. An uncompressed tar is read as it is, and
    member data nobody reads is skipped with a seek.
    """

    def __init__(self, path: Path, limits: Limits, *, hashed: bool = False):
        self._raw = open(path, "rb")  # noqa: SIM115 - closed in close()
        self.compressed = self._raw.read(2) == b"\x1f\x8b"
        self._raw.seek(0)
        self._size = os.fstat(self._raw.fileno()).st_size
        # hashed: every byte of the file goes through one sha256 (nothing is skipped with a seek), so the caller
        # can tell whether what it extracted is the file whose digest was checked before.
        self.sha256 = hashlib.sha256() if hashed else None
        self._file: Any = _Hashing(self._raw, self.sha256) if self.sha256 is not None else self._raw
        self._src: Any = gzip.GzipFile(fileobj=cast(Any, self._file), mode="rb") if self.compressed else self._file
        self._limits = limits
        self.inflated = 0

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; fewer only at the end of the stream."""
        try:
            data = self._src.read(n)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise _Refused(f"not a readable {'.tar.gz' if self.compressed else '.tar'}: "
                           f"{e or type(e).__name__}") from None
        self._count(len(data))
        return data

    def skip(self, n: int, what: str) -> None:
        """Pass over ``n`` bytes: a seek in an uncompressed tar, reading them in a .tar.gz."""
        if self.compressed or self.sha256 is not None:
            for _ in self.chunks(n, what):
                pass
            return
        if self._raw.tell() + n > self._size:
            raise _Refused(f"archive ends inside {what} (truncated?)")
        self._raw.seek(n, os.SEEK_CUR)
        self._count(n)

    def _count(self, n: int) -> None:
        self.inflated += n
        cap = self._limits.max_total_bytes + self._limits.max_members * 1024 + (1 << 20)
        if self.inflated > cap:
            raise _Refused(f"archive inflates past {cap} bytes (max_total_bytes)")
        if self.inflated > 256 << 20 and self.inflated > self._limits.max_ratio * max(1, self._raw.tell()):
            raise _Refused(f"archive inflates more than {self._limits.max_ratio:g}x its compressed size "
                           "(a decompression bomb?); raise --max-ratio if this bundle is genuine")

    def exact(self, n: int, what: str) -> bytes:
        data = self.read(n)
        if len(data) != n:
            raise _Refused(f"archive ends inside {what} (truncated?)")
        return data

    def chunks(self, n: int, what: str) -> Iterator[bytes]:
        while n > 0:
            data = self.exact(min(n, CHUNK), what)
            n -= len(data)
            yield data

    def drain(self) -> None:
        """Read to the end of the gzip stream (its CRC and length are checked there); only zeros may follow
        the tar end-of-archive marker."""
        while data := self.read(CHUNK):
            if data.count(0) != len(data):
                raise _Refused("data after the tar end-of-archive marker (a damaged or altered archive)")

    def digest(self) -> str:
        """sha256 of the whole file (a hashed stream, read to its end by :meth:`drain`; any bytes the gzip
        reader left are hashed here)."""
        assert self.sha256 is not None
        while self._file.read(CHUNK):
            pass
        return self.sha256.hexdigest()

    def close(self) -> None:
        self._src.close()
        self._raw.close()


class _Hashing:
    """A file object whose reads also feed a sha256 (what gzip, or the tar reader, reads through)."""

    def __init__(self, raw: Any, h: Any):
        self._raw, self._h = raw, h

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self._h.update(data)
        return data

    def tell(self) -> int:
        return int(self._raw.tell())

    def close(self) -> None:
        pass  # the _Stream closes the file


class _Data:
    """One member's data: iterate to read it in chunks; :meth:`skip` passes over what was not read."""

    def __init__(self, stream: _Stream, n: int, what: str):
        self._stream, self._left, self._what = stream, n, what

    def __iter__(self) -> Iterator[bytes]:
        while self._left > 0:
            data = self._stream.exact(min(self._left, CHUNK), self._what)
            self._left -= len(data)
            yield data

    def skip(self) -> None:
        self._stream.skip(self._left, self._what)
        self._left = 0


@dataclass(slots=True)
class _Member:
    name: str
    kind: str
    """``file``, ``dir``, or what it is when refused (``symlink``, ``FIFO``, ``member type 'V'``...)."""
    size: int
    mode: int
    linkname: str = ""


_KINDS = {b"0": "file", b"\0": "file", b"7": "file", b"5": "dir", b"1": "hard link", b"2": "symlink",
          b"3": "device", b"4": "device", b"6": "FIFO"}
_MAX_EXTENDED = 8  # extended headers in a row before one member (pax + long name + long link need 3)


def _nts(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _number(field: bytes, what: str) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256
        n = int.from_bytes(field[1:], "big")
        return n - (1 << (8 * (len(field) - 1))) if field[:1] == b"\xff" else n
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise _Refused(f"invalid {what} field {text!r} in a tar header (a damaged archive)") from None


def _header_ok(block: bytes) -> bool:
    stored = _number(block[148:156], "checksum")
    rest = block[:148] + b" " * 8 + block[156:]
    return stored in (sum(rest), sum(struct.unpack("512b", rest)))  # tar writers use either sum


def _pax(data: bytes) -> dict[str, Any]:
    """The records of a pax header that matter here: path, linkpath, size. Sparse files are refused."""
    out: dict[str, Any] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        sp = data.find(b" ", pos, pos + MAX_PAX_NUMBER_DIGITS + 1)
        try:
            length = int(data[pos:sp]) if sp > pos else -1
        except ValueError:
            length = -1
        record = data[sp + 1:pos + length] if length > sp - pos + 1 else b""
        if pos + length > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise _Refused("malformed pax header record (a damaged archive)")
        key, value = (x.decode("utf-8", "surrogateescape") for x in record[:-1].split(b"=", 1))
        if key.startswith("GNU.sparse."):
            raise _Refused("sparse member not allowed (only regular files and directories)")
        if key in ("path", "linkpath"):
            out[key] = value
        elif key == "size":
            if not (value.isascii() and value.isdigit()) or len(value) > MAX_PAX_NUMBER_DIGITS:
                raise _Refused(f"invalid pax size {value[:40]!r}{'...' if len(value) > 40 else ''} "
                               f"({len(value)} characters; a damaged or crafted archive)")
            out["size"] = int(value)
        pos += length
    return out


def _members(stream: _Stream, limits: Limits) -> Iterator[tuple[_Member, _Data]]:
    """Each member with an iterator over its data (skipped when not consumed), to the verified end.

    Raises:
        _Refused: a damaged, truncated or oversized header, a header read past the caps, or
            anything but zeros after the end-of-archive marker.
    """
    pending: dict[str, Any] = {}
    extended = 0
    while True:
        block = stream.read(BLOCK)
        if len(block) < BLOCK:
            raise _Refused("archive ends without the tar end-of-archive marker (truncated?)" if not block else
                           "archive ends inside a tar header (truncated?)")
        if block.count(0) == BLOCK:
            if pending:
                raise _Refused("archive ends after an extended header, before its member")
            stream.drain()
            return
        if not _header_ok(block):
            raise _Refused("tar header checksum mismatch (a damaged or altered archive)",
                           pending.get("path") or _nts(block[:100]))
        typ, size = block[156:157], _number(block[124:136], "size")
        if size < 0:
            raise _Refused(f"negative size {size} in a tar header", _nts(block[:100]))
        if typ in (b"x", b"L", b"K"):
            what = {b"x": "pax header", b"L": "GNU long name", b"K": "GNU long link name"}[typ]
            if size > limits.max_header_bytes:
                raise _Refused(f"{what} of {size} bytes, above max_header_bytes {limits.max_header_bytes}; "
                               "not read", pending.get("path") or _nts(block[:100]))
            extended += 1
            if extended > _MAX_EXTENDED:
                raise _Refused(f"more than {_MAX_EXTENDED} extended headers in a row")
            header = stream.exact(size, what)
            stream.exact(-size % BLOCK, what)
            if typ == b"x":
                pending.update(_pax(header))
            else:
                pending["path" if typ == b"L" else "linkpath"] = _nts(header)
            continue
        if typ in (b"g", b"S", b"X"):
            what = {b"g": "pax global header", b"S": "GNU sparse member", b"X": "Solaris extended header"}[typ]
            raise _Refused(f"{what} not allowed (only regular files and directories)", _nts(block[:100]))
        name = pending.get("path")
        if name is None:
            name = _nts(block[:100])
            if block[257:263] == b"ustar\0" and block[345] != 0:  # POSIX ustar: name = prefix/name
                name = _nts(block[345:500]) + "/" + name
        kind = _KINDS.get(typ, f"member type {typ.decode('latin-1')!r}")
        if typ in (b"\0", b"0") and name.endswith("/"):
            kind = "dir"  # old V7 tars mark folders by a trailing slash
        size = pending.get("size", size)
        member = _Member(name=name, kind=kind, size=size, mode=_number(block[100:108], "mode") & 0o7777,
                         linkname=pending.get("linkpath") or _nts(block[157:257]))
        pending, extended = {}, 0
        data_size = size if kind == "file" or kind.startswith("member type") else 0  # as tar does
        data = _Data(stream, data_size, f"the data of {name}")
        yield member, data
        data.skip()  # what the caller did not read
        stream.exact(-data_size % BLOCK, f"the padding of {name}")


def is_archive(path: Path) -> bool:
    """A packed repro: ``.tar`` (what ``reprokit pack`` writes) or ``.tar.gz`` (earlier versions), by name or
    by content (gzip magic, or a ustar header)."""
    return path.is_file() and (path.name.endswith((".tar", ".tar.gz", ".tgz")) or _archive_magic(path))


def _archive_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(BLOCK)
    return head[:2] == b"\x1f\x8b" or (len(head) == BLOCK and head[257:262] == b"ustar")


def digest_source(path: Path, expected: str | None) -> str | None:
    """Where the archive's expected sha256 comes from: ``--sha256``, ``<name>.sha256`` beside it, or None."""
    if expected is not None:
        return "--sha256"
    side = path.with_name(path.name + ".sha256")
    return side.name if side.is_file() else None


def check_digest(path: Path, expected: str | None) -> list[dict[str, Any]]:
    """Compare the archive's sha256 with ``expected`` or with ``<archive>.sha256`` beside it.

    The sidecar is read only up to :data:`SIDECAR_MAX_BYTES`; a larger one is refused unread.
    """
    return _checked_digest(path, expected)[1]


def _checked_digest(path: Path, expected: str | None) -> tuple[str | None, list[dict[str, Any]]]:
    """:func:`check_digest`, and the digest the archive matched (None when there was none to check)."""
    source = digest_source(path, expected)
    if source is None:
        return None, []
    if expected is None:
        side = path.with_name(source)
        with open(side, "rb") as f:
            text = f.read(SIDECAR_MAX_BYTES + 1)
        if len(text) > SIDECAR_MAX_BYTES:
            return None, [{"file": side.name, "problem": f"larger than {SIDECAR_MAX_BYTES} bytes, not a .sha256 file "
                                                   "(one line: the hex digest and the archive's name); not read"}]
        words = text.decode("ascii", "replace").split()
        expected = words[0] if words else ""
    want = expected.strip().lower()
    if len(want) != 64 or any(c not in "0123456789abcdef" for c in want):
        return None, [{"file": source, "problem": "not a sha256", "expected": "64 hex digits",
                       "found": want[:80]}]
    found = sha256_file(path)
    if found != want:
        return None, [{"file": path.name, "problem": f"archive sha256 does not match {source}", "expected": want,
                       "found": found}]
    return want, []


def scan(path: Path, limits: Limits) -> list[dict[str, Any]]:
    """Every problem with the archive's members, found without writing anything."""
    problems: list[dict[str, Any]] = []
    fatal: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    count = total = 0
    stream = _Stream(path, limits)
    try:
        for m, _ in _members(stream, limits):
            count += 1
            if count > limits.max_members:
                fatal.append({"file": m.name, "problem": f"more than {limits.max_members} members "
                                                          "(max_members); stopped scanning"})
                break
            problems += _member_problems(m, seen, limits)
            total += m.size if m.kind == "file" else 0
            if total > limits.max_total_bytes:
                fatal.append({"file": m.name, "problem": f"files add up to more than {limits.max_total_bytes} "
                                                          "bytes (max_total_bytes); stopped scanning"})
                break
            if m.kind == "file" and m.size > limits.max_file_bytes:
                break  # do not inflate a member we already refused
    except _Refused as e:
        fatal.append({"file": e.file or path.name, "problem": str(e)})
    finally:
        stream.close()
    if count == 0 and not problems and not fatal:
        fatal.append({"file": path.name, "problem": "empty archive"})
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS
        problems = problems[:MAX_PROBLEMS] + [{"file": path.name, "problem": f"... and {more} more problems"}]
    return problems + fatal  # what stopped the scan is always reported


def _norm(name: str) -> str:
    return "/".join(part for part in PurePosixPath(name).parts if part not in ("", "."))


def _member_problems(m: _Member, seen: dict[str, str], limits: Limits) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if m.kind not in ("file", "dir"):
        target = f" -> {m.linkname}" if m.kind in ("symlink", "hard link") else ""
        out.append({"file": m.name, "problem": f"{m.kind}{target} not allowed (only regular files and directories)"})
    p = PurePosixPath(m.name)
    if m.name.startswith(("/", "\\")) or (len(m.name) > 1 and m.name[1] == ":"):
        out.append({"file": m.name, "problem": "absolute path"})
    if ".." in p.parts or "\\" in m.name or "\x00" in m.name:
        out.append({"file": m.name, "problem": "path escapes the archive ('..' or backslash)"})
    try:
        m.name.encode("utf-8")
    except UnicodeEncodeError:
        out.append({"file": m.name.encode("utf-8", "replace").decode(), "problem": "name is not UTF-8"})
    norm = _norm(m.name)
    if m.kind == "file" and (norm.endswith(COMPILED) or "__pycache__" in norm.split("/")):
        out.append({"file": m.name, "problem": "compiled or native code not allowed (an archive ships Python source "
                                               "only: Python would run such a file in place of the source beside it)"})
    if norm.count("/") >= MAX_PATH_PARTS:
        out.append({"file": m.name[:200] + ("..." if len(m.name) > 200 else ""),
                    "problem": f"path nests {norm.count('/') + 1} names deep; at most {MAX_PATH_PARTS}"})
    if not norm and m.kind != "dir":
        out.append({"file": m.name, "problem": "empty name"})
    key = norm.casefold()
    if not norm:
        pass  # "./": the archive's root folder
    elif key in seen:
        what = "duplicate name" if seen[key] == norm else f"name collides case-insensitively with {seen[key]}"
        out.append({"file": m.name, "problem": what})
    else:
        seen[key] = norm
    if m.kind == "file" and m.size > limits.max_file_bytes:
        out.append({"file": m.name, "problem": f"{m.size} bytes, above max_file_bytes {limits.max_file_bytes}",
                    "expected": limits.max_file_bytes, "found": m.size})
    return out


def _extract(path: Path, limits: Limits, dest: Path, sha256: str | None = None) -> dict[str, tuple[str, int]]:
    """Write the archive's files and folders under ``dest``; ``{name: (sha256, size)}`` of every file.

    The checks of :func:`scan` run again member by member (the file may have changed since), and
    any problem stops extraction. With ``sha256`` (the digest :func:`check_digest` matched), the bytes
    extracted are hashed on the way, and an archive swapped or rewritten since that check is refused.
    """
    seen: dict[str, str] = {}
    files: dict[str, tuple[str, int]] = {}
    count = total = 0
    stream = _Stream(path, limits, hashed=sha256 is not None)
    try:
        for m, data in _members(stream, limits):
            count += 1
            total += m.size if m.kind == "file" else 0
            problems = _member_problems(m, seen, limits)
            if problems or count > limits.max_members or total > limits.max_total_bytes:
                what = problems[0]["problem"] if problems else "over max_members or max_total_bytes"
                raise _Refused(f"{what} (the archive changed since it was scanned?)", m.name)
            norm = _norm(m.name)
            if m.kind == "dir":
                if norm:
                    _mkdirs(dest, norm.split("/"))
                continue
            parts = norm.split("/")
            _mkdirs(dest, parts[:-1])
            h, size = hashlib.sha256(), 0
            fd = os.open(dest / norm, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                         0o755 if m.mode & 0o100 else 0o644)
            with os.fdopen(fd, "wb") as f:
                for chunk in data:
                    f.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
            files[norm] = (h.hexdigest(), size)
        if sha256 is not None and (found := stream.digest()) != sha256:
            raise _Refused(f"the archive changed after its sha256 was checked (it was {sha256}, the bytes "
                           f"extracted hash to {found}); refusing what was extracted. Is something still "
                           "writing the file? Copy it somewhere private and try again")
    finally:
        stream.close()
    return files


def _mkdirs(dest: Path, parts: list[str]) -> None:
    d = dest
    for part in parts:
        d = d / part
        try:
            d.mkdir(mode=0o755)
        except FileExistsError:
            if d.is_symlink() or not d.is_dir():
                raise _Refused("a file and a folder share this name", str(d.relative_to(dest))) from None


def _coverage(root: Path, bundle: Path, files: dict[str, tuple[str, int]]) -> list[dict[str, Any]]:
    """Problems with files outside what the manifests vouch for.

    With a ``pack-manifest.json`` beside the bundle (``reprokit pack`` writes one), it must list every
    file of the archive but itself, with matching sha256 and size. Without one (a bundle folder tarred
    by hand), every file must lie inside the bundle folder, whose own manifest covers it.
    """
    top = root if bundle == root else bundle.parent
    prefix = "" if top == root else top.relative_to(root).as_posix() + "/"
    inside = "" if bundle == root else bundle.relative_to(root).as_posix() + "/"
    pm = top / PACK_MANIFEST
    problems: list[dict[str, Any]] = []
    listed: dict[str, Any] | None = None
    if pm.is_file():
        listed, problems = _read_pack_manifest(pm, files.get(prefix + PACK_MANIFEST, ("", 0))[1])
        if listed is None:
            return problems
    for name, (sha, size) in sorted(files.items()):
        rel = name[len(prefix):] if name.startswith(prefix) else name
        if rel == PACK_MANIFEST and name.startswith(prefix):
            continue
        if listed is None:
            if not name.startswith(inside):
                problems.append({"file": name, "problem": "not covered by any manifest (the bundle's manifest "
                                                          f"covers its own folder; no {PACK_MANIFEST} here)"})
            continue
        meta = listed.get(rel) if name.startswith(prefix) else None
        if not isinstance(meta, dict):
            problems.append({"file": rel, "problem": f"unexpected file (not in {PACK_MANIFEST})"})
        elif meta.get("sha256") != sha:
            problems.append({"file": rel, "problem": f"checksum mismatch ({PACK_MANIFEST})",
                             "expected": meta.get("sha256"), "found": sha})
        elif meta.get("size") != size:
            problems.append({"file": rel, "problem": f"size mismatch ({PACK_MANIFEST})", "expected": meta.get("size"),
                             "found": size})
    for rel in sorted(set(listed or ()) - {n[len(prefix):] for n in files if n.startswith(prefix)}):
        problems.append({"file": rel, "problem": f"missing (listed in {PACK_MANIFEST})"})
    return problems


def _read_pack_manifest(pm: Path, size: int) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    from reprokit.pack import PACK_FORMAT, PACK_VERSION

    def bad(problem: str) -> tuple[None, list[dict[str, Any]]]:
        return None, [{"file": PACK_MANIFEST, "problem": problem}]

    if size > 64 << 20:
        return bad(f"{size} bytes; a pack manifest is small, not read")
    try:
        m = schema.parse_json(pm.read_bytes(), PACK_MANIFEST)  # strict, with the depth and size limits
    except schema.SchemaError as e:
        return bad(e.why)
    if not isinstance(m, dict) or m.get("format") != PACK_FORMAT or not isinstance(m.get("files"), dict):
        return bad(f"not a {PACK_FORMAT} manifest")
    if not isinstance(m.get("version"), int) or m["version"] < 1:
        return bad(f"unknown format version {m.get('version')!r}")
    if m["version"] > PACK_VERSION:
        raise BundleVersionError(f"this archive's {PACK_MANIFEST} has format version {m['version']}, but this "
                                 f"reprokit reads versions up to {PACK_VERSION}. Upgrade reprokit "
                                 "(in your clone: git pull && pip install -e .) to open it.")
    if set(m) != {"format", "version", "files", "self_sha256"}:
        return bad("no self_sha256 digest, or unknown fields: "
                   + ", ".join(sorted(set(m) ^ {"format", "version", "files", "self_sha256"})))
    if m["self_sha256"] != _self_digest(m):
        return None, [{"file": PACK_MANIFEST, "problem": "checksum mismatch (the pack manifest itself was altered)",
                       "expected": m["self_sha256"], "found": _self_digest(m)}]
    return m["files"], []


def _find_bundle(root: Path) -> Path:
    if (root / MANIFEST).is_file():
        return root
    candidates = [p.parent for p in root.glob("*/" + MANIFEST)] + [p.parent for p in root.glob("*/bundle/" + MANIFEST)]
    if len(candidates) != 1:
        problem = f"the archive holds {len(candidates)} bundles (folders with {MANIFEST}); expected one"
        raise BundleError(f"{problem}. Pack one bundle per archive (reprokit pack BUNDLE -o OUT.tar).",
                          [{"file": ".", "problem": problem}])
    return candidates[0]


@contextlib.contextmanager
def extracted(path: Path, *, sha256: str | None = None, limits: Limits | None = None) -> Iterator[Path]:
    """Check, pre-scan and extract an archive into a temp dir; yield the bundle folder inside.

    The temp dir is removed afterwards, and on any refusal. Files outside the bundle folder
    (``repro.py``, the vendored runtime) must be covered by the archive's pack manifest.

    Raises:
        BundleError: with ``.problems`` listing everything wrong (digest, members, manifests).
        BundleVersionError: for a bundle or pack manifest newer than this reprokit reads.
    """
    limits = limits or Limits()
    digest, problems = _checked_digest(path, sha256)
    if problems:
        raise BundleError(_summary(path, problems, "its checksum does not match; nothing was decompressed"), problems)
    problems = scan(path, limits)
    if problems:
        raise BundleError(_summary(path, problems, "refusing to extract it; nothing was written"), problems)
    tmp = Path(tempfile.mkdtemp(prefix="reprokit-open-"))
    try:
        try:
            files = _extract(path, limits, tmp, digest)
        except (_Refused, OSError) as e:
            file = getattr(e, "file", None) or path.name
            raise BundleError(f"{path}: extraction stopped: {file}: {e}",
                              [{"file": file, "problem": f"extraction stopped: {e}"}]) from None
        bundle = _find_bundle(tmp)
        problems = _coverage(tmp, bundle, files)
        if not problems:  # consistent: then what runs beside the bundle must be what this reprokit packs
            from reprokit.pack import archive_problems

            problems = archive_problems(bundle)
        if problems:
            problems += verify(bundle)  # every problem, not only the archive-level ones
            raise BundleError(_summary(path, problems, "its files do not match its manifests"), problems)
        yield bundle
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _summary(path: Path, problems: list[dict[str, Any]], what: str) -> str:
    lines = "\n".join(f"  {p['file']}: {p['problem']}" for p in problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    return (f"{path}: {len(problems)} problem(s), {what}:\n{lines}{more}\n"
            "Copy or download the archive again (a cut-off transfer truncates it), or ask the sender for an intact "
            "one and its .sha256.")


@contextlib.contextmanager
def bundle_dir(path: str | Path, *, sha256: str | None = None, limits: Limits | None = None) -> Iterator[Path]:
    """Yield a bundle folder for ``path``, a bundle folder or a packed archive (extracted safely)."""
    path = Path(path)
    if path.is_dir():
        if sha256 is not None:
            raise ConfigError.option("sha256", "{opt} checks an archive; for a bundle folder the manifest's checksums are used")
        yield path
    elif is_archive(path):
        with extracted(path, sha256=sha256, limits=limits) as d:
            yield d
    elif not path.exists():
        raise BundleError(f"{path} does not exist")
    else:
        raise BundleError(f"{path} is neither a bundle folder nor a packed archive (.tar, or .tar.gz from earlier "
                          "versions); pass a bundle folder or the file `reprokit pack` wrote")

