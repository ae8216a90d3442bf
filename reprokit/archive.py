"""Open bundles that come from other people: tarballs checked before anything is written.

The order of defences: (1) the archive's own sha256, when a ``.sha256`` sits
beside it or one is given, before decompressing a byte; (2) a pre-scan of
every member header, reading but writing nothing, that refuses links,
devices, FIFOs, absolute or ``..`` paths, duplicate and case-colliding names,
and caps member count, file size, total size and compression ratio;
(3) extraction into a fresh temporary directory through ``tarfile``'s
``data`` filter; (4) the bundle's manifest. Every problem found is reported,
not only the first.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from reprokit.bundle import MANIFEST, sha256_file
from reprokit.errors import BundleError

GiB = 1 << 30
MAX_PROBLEMS = 100


@dataclass(kw_only=True, slots=True)
class Limits:
    """Caps applied while opening an archive (defaults sized for real model state)."""

    max_members: int = 100_000
    """Most members (files and directories) an archive may hold."""
    max_file_bytes: int = 64 * GiB
    """Largest single file, as declared in its header."""
    max_total_bytes: int = 256 * GiB
    """Most bytes, all files together, after decompression."""
    max_ratio: float = 200.0
    """Most decompressed bytes per compressed byte, checked once 256 MiB are out (gzip bombs)."""

    def __post_init__(self) -> None:
        for name in ("max_members", "max_file_bytes", "max_total_bytes", "max_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)}")


class _Budget(io.RawIOBase):
    """A decompressing reader that refuses to inflate past the caps (counts what it hands out)."""

    def __init__(self, path: Path, limits: Limits):
        self._raw = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._gz = gzip.GzipFile(fileobj=self._raw, mode="rb")
        self._limits = limits
        self.inflated = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._gz.readinto(b)
        self.inflated += n
        cap = self._limits.max_total_bytes + self._limits.max_members * 1024 + (1 << 20)
        if self.inflated > cap:
            raise _Refused(f"archive inflates past {cap} bytes (max_total_bytes)")
        if self.inflated > 256 << 20 and self.inflated > self._limits.max_ratio * max(1, self._raw.tell()):
            raise _Refused(f"archive inflates more than {self._limits.max_ratio:g}x its compressed size "
                           "(a decompression bomb?); raise --max-ratio if this bundle is genuine")
        return n

    def close(self) -> None:
        self._gz.close()
        self._raw.close()
        super().close()


class _Refused(Exception):
    pass


def is_archive(path: Path) -> bool:
    return path.is_file() and (path.name.endswith((".tar.gz", ".tgz")) or _gzip_magic(path))


def _gzip_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def check_digest(path: Path, expected: str | None) -> list[dict[str, Any]]:
    """Compare the archive's sha256 with ``expected`` or with ``<archive>.sha256`` beside it."""
    side = path.with_name(path.name + ".sha256")
    source = "--sha256"
    if expected is None and side.is_file():
        words = side.read_text(errors="replace").split()
        expected, source = (words[0] if words else ""), side.name
    if expected is None:
        return []
    found = sha256_file(path)
    if found != expected.strip().lower():
        return [{"file": path.name, "problem": f"archive sha256 does not match {source}", "expected": expected,
                 "found": found}]
    return []


def scan(path: Path, limits: Limits) -> list[dict[str, Any]]:
    """Every problem with the archive's members, found without writing anything."""
    problems: list[dict[str, Any]] = []
    fatal: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    count = total = 0
    stream = _Budget(path, limits)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tf:  # type: ignore[call-overload]
            for m in tf:
                count += 1
                if count > limits.max_members:
                    fatal.append({"file": m.name, "problem": f"more than {limits.max_members} members "
                                                              "(max_members); stopped scanning"})
                    break
                problems += _member_problems(m, seen, limits)
                total += m.size if m.isfile() else 0
                if total > limits.max_total_bytes:
                    fatal.append({"file": m.name, "problem": f"files add up to more than {limits.max_total_bytes} "
                                                              "bytes (max_total_bytes); stopped scanning"})
                    break
                if m.isfile() and m.size > limits.max_file_bytes:
                    break  # do not inflate a member we already refused
    except _Refused as e:
        fatal.append({"file": path.name, "problem": str(e)})
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as e:
        fatal.append({"file": path.name, "problem": f"not a readable .tar.gz: {e}"})
    finally:
        stream.close()
    if count == 0 and not problems and not fatal:
        fatal.append({"file": path.name, "problem": "empty archive"})
    if len(problems) > MAX_PROBLEMS:
        more = len(problems) - MAX_PROBLEMS
        problems = problems[:MAX_PROBLEMS] + [{"file": path.name, "problem": f"... and {more} more problems"}]
    return problems + fatal  # what stopped the scan is always reported


def _member_problems(m: tarfile.TarInfo, seen: dict[str, str], limits: Limits) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    kind = ("symlink" if m.issym() else "hard link" if m.islnk() else "FIFO" if m.isfifo() else
            "device" if m.isdev() else None if m.isfile() or m.isdir() else f"member type {m.type!r}")
    if kind:
        target = f" -> {m.linkname}" if m.issym() or m.islnk() else ""
        out.append({"file": m.name, "problem": f"{kind}{target} not allowed (only regular files and directories)"})
    p = PurePosixPath(m.name)
    if m.name.startswith(("/", "\\")) or (len(m.name) > 1 and m.name[1] == ":"):
        out.append({"file": m.name, "problem": "absolute path"})
    if ".." in p.parts or "\\" in m.name or "\x00" in m.name:
        out.append({"file": m.name, "problem": "path escapes the archive ('..' or backslash)"})
    norm = "/".join(part for part in p.parts if part not in ("", "."))
    key = norm.casefold()
    if key in seen:
        what = "duplicate name" if seen[key] == norm else f"name collides case-insensitively with {seen[key]}"
        out.append({"file": m.name, "problem": what})
    else:
        seen[key] = norm
    if m.isfile() and m.size > limits.max_file_bytes:
        out.append({"file": m.name, "problem": f"{m.size} bytes, above max_file_bytes {limits.max_file_bytes}",
                    "expected": limits.max_file_bytes, "found": m.size})
    return out


def _find_bundle(root: Path) -> Path:
    if (root / MANIFEST).is_file():
        return root
    candidates = [p.parent for p in root.glob("*/" + MANIFEST)] + [p.parent for p in root.glob("*/bundle/" + MANIFEST)]
    if len(candidates) != 1:
        raise BundleError(f"the archive holds {len(candidates)} bundles (folders with {MANIFEST}); expected one")
    return candidates[0]


@contextlib.contextmanager
def extracted(path: Path, *, sha256: str | None = None, limits: Limits | None = None) -> Iterator[Path]:
    """Check, pre-scan and extract an archive into a temp dir; yield the bundle folder inside.

    The temp dir is removed afterwards, and on any refusal.

    Raises:
        BundleError: with ``.problems`` listing everything wrong (digest, members, manifest).
    """
    limits = limits or Limits()
    problems = check_digest(path, sha256)
    if problems:
        raise BundleError(_summary(path, problems, "its checksum does not match; nothing was decompressed"), problems)
    problems = scan(path, limits)
    if problems:
        raise BundleError(_summary(path, problems, "refusing to extract it; nothing was written"), problems)
    if not hasattr(tarfile, "data_filter"):
        raise BundleError("this Python's tarfile lacks the 'data' extraction filter (added in 3.12 and in security "
                          "releases of 3.10/3.11); upgrade Python to open archives safely")
    tmp = Path(tempfile.mkdtemp(prefix="reprokit-open-"))
    try:
        stream = _Budget(path, limits)
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tf:  # type: ignore[call-overload]
                tf.extractall(tmp, filter="data")
        except (_Refused, tarfile.TarError, OSError) as e:
            raise BundleError(f"{path}: extraction stopped: {e}",
                              [{"file": path.name, "problem": f"extraction stopped: {e}"}]) from None
        finally:
            stream.close()
        yield _find_bundle(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _summary(path: Path, problems: list[dict[str, Any]], what: str) -> str:
    lines = "\n".join(f"  {p['file']}: {p['problem']}" for p in problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    return f"{path}: {len(problems)} problem(s), {what}:\n{lines}{more}"


@contextlib.contextmanager
def bundle_dir(path: str | Path, *, sha256: str | None = None, limits: Limits | None = None) -> Iterator[Path]:
    """Yield a bundle folder for ``path``, a bundle folder or a packed archive (extracted safely)."""
    path = Path(path)
    if path.is_dir():
        if sha256 is not None:
            raise BundleError("--sha256 checks an archive; for a bundle folder the manifest's checksums are used")
        yield path
    elif is_archive(path):
        with extracted(path, sha256=sha256, limits=limits) as d:
            yield d
    elif not path.exists():
        raise BundleError(f"{path} does not exist")
    else:
        raise BundleError(f"{path} is neither a bundle folder nor a .tar.gz archive")

