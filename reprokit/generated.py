"""Files reprokit generates, held to what this reprokit writes.

A bundle's manifest proves its files are the ones it lists, not who wrote them: anyone can re-sign it. That is the
trust model for the project's own code (``code/``: replay says it runs it). But some files are reprokit's, and a user
runs them because reprokit told them to: ``extract/op_repro.py`` ("python .../extract/op_repro.py"), an extract's
``code/rk_extract.py`` (what its replay imports), and in a packed archive ``repro.py``, ``README.md`` and the vendored
``reprokit/`` runtime ("python repro.py"). Each is compared byte for byte with what this reprokit writes for that
bundle; a difference is a problem (``verify`` exits 1, every other command refuses the bundle, exit 3) unless the user
accepts it explicitly: ``--accept-generated`` on the command line, :func:`accepting` in Python.

A file an earlier reprokit wrote differs too (the templates change between versions): the problem names the version
that wrote it (the manifest's ``reprokit_version``, the archive's vendored ``_version.py``) and, for files of earlier
builds this reprokit knows by digest, says so; re-extract or re-pack with this reprokit, or accept it after reading it.

This module checks a bundle's own generated files (:func:`bundle_problems`, part of every verification); an archive's
(:func:`reprokit.pack.archive_problems`) are checked where archives are written.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from reprokit._version import __version__

_PACKAGE = Path(__file__).resolve().parent
OP_REPRO = "extract/op_repro.py"
EXTRACT_STEP = "code/rk_extract.py"
TEMPLATES = {OP_REPRO: "extract_op.py", EXTRACT_STEP: "extract_repro.py"}
"""Generated files a bundle folder may hold -> the file of this package they are copies of."""

EARLIER = {
    "11124efa0e15fb1dcb964508dbd1a05b5c0665732fe0747023bf7b2061623baf": "the first extract (2026-11-26)",
    "b5acd415bf62a93eee5ffa118000c7f9226281c8144dd883d534dc351ffb79c1": "extract with op-level narrowing (2026-11-26)",
    "b01b13824025f477563a1f360584f80dad1b196dfb802402001123c92a4e2fc0": "extract before class refs were vetted "
                                                                        "(2026-11-26)",
    "3536a38ed707fc3bb17db406725564df8877c057afaf301cb494f180195ff49d": "the first extract (2026-11-26)",
    "57617b27b994537d80f9bd59c43bd8581284b1fe37b2106b510edd6b327776de": "extract before op.json was vetted "
                                                                        "(2026-11-26)",
}
"""sha256 of ``rk_extract.py`` / ``op_repro.py`` as earlier builds of reprokit wrote them -> which build. Known is not
trusted (those builds ran what an op.json or a config named, unchecked): it only makes the problem say where the
file came from."""

PROBLEM_MARK = "differs from what this reprokit"
"""Every generated-file problem says this (how callers and tests tell them from others)."""

_ACCEPT: ContextVar[bool] = ContextVar("reprokit_accept_generated", default=False)


@contextlib.contextmanager
def accepting(accept: bool = True) -> Iterator[None]:
    """Within this block, generated files that differ from what this reprokit writes are not problems.

    Accept only files you have read: they are what runs when the bundle's instructions are followed.

    Example:
        >>> with accepting():                                     # doctest: +SKIP
        ...     verify("repros/extract-from-an-older-reprokit")   # [] when only generated files differ
    """
    token = _ACCEPT.set(accept)
    try:
        yield
    finally:
        _ACCEPT.reset(token)


def accepted() -> bool:
    """Whether the caller accepts generated files that differ (:func:`accepting`)."""
    return _ACCEPT.get()


def is_generated_problem(problem: dict[str, Any]) -> bool:
    return PROBLEM_MARK in str(problem.get("problem", ""))


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mismatch(rel: str, found: str, expected: str, writer: str | None, what: str) -> dict[str, Any]:
    """One difference, worded by who wrote the file: this version (so it was edited), another version, or a known
    earlier build."""
    if found in EARLIER:
        origin = f"it is the {rel.rsplit('/', 1)[-1]} an earlier reprokit build wrote ({EARLIER[found]})"
    elif writer and writer != __version__:
        origin = f"it was written by reprokit {writer}"
    else:
        origin = (f"edited after reprokit {writer or __version__} wrote it, or written by another build of that "
                  "version")
    return {"file": rel, "problem": f"{PROBLEM_MARK} ({__version__}) writes as {what}: {origin}. It runs when the "
                                    "bundle's instructions are followed; regenerate it with this reprokit, or read it "
                                    "and pass --accept-generated", "expected": expected, "found": found}


def bundle_problems(path: Path, listed: dict[str, Any], writer: str | None) -> list[dict[str, Any]]:
    """Generated files of the bundle folder ``path`` (those ``listed`` in its manifest, checked against it already)
    that differ from this reprokit's; ``writer`` is the manifest's ``reprokit_version``. Empty while
    :func:`accepting`."""
    if accepted():
        return []
    out = []
    for rel, template in TEMPLATES.items():
        meta = listed.get(rel)
        if meta is None:
            continue
        expected = digest((_PACKAGE / template).read_bytes())
        if meta.get("sha256") != expected:  # the file's own digest, checked against the manifest by the caller
            out.append(mismatch(rel, str(meta.get("sha256")), expected, writer, f"the {rel.rsplit('/', 1)[-1]} "
                                                                                "of every bundle"))
    return out
