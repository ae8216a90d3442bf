"""``reprokit pack``: one deterministic tarball a colleague runs with only torch, numpy and safetensors.

Layout inside the archive (one top folder, ``repro-<manifest sha256 prefix>``)::

    bundle/       the bundle, unchanged
    reprokit/     the runtime replay needs (vendored; no click, no gitpython)
    repro.py      python repro.py [--times N] [--device cpu|cuda] [--json]
    README.md     what failed, where it was recorded, the commands to run
    pack-manifest.json  sha256 and size of every other file in the archive (bundle, runtime,
                  repro.py, README) and a digest of itself: ``reprokit verify`` covers what runs too

Same bundle in, same bytes out: members sorted, mtime/uid/gid/owner fixed,
modes normalised, gzip headers without name or time.

The container is an **uncompressed** POSIX tar (``.tar``) unless the output's name ends in
``.tar.gz``/``.tgz``. Why: a bundle is almost all float tensors, which gzip shrinks by a few percent
at ~20-30 MB/s on one core, so a 1.5 GB state took over a minute to pack and half a minute to open;
a plain tar is written and read at disk speed, is still one file that ``tar tf`` lists, with a
``.sha256`` beside it, and is opened by the same reader with the same checks. A ``.tar.gz`` is written
by :class:`reprokit.gzip_members.GzipMembers`: a gzip member per MiB of the tar stream, compressed on
every core, and only where deflate saves at least 10% (float32 tensors are stored as they are; JSON,
code and token ids are deflated at level 6, as before, bfloat16 tensors at level 1); any gzip reader
reads it as one stream. ``.tar.gz`` archives that earlier versions wrote (one member) open the same way.

Packing reads each bundle file once: its bytes are hashed while they stream into the archive and
checked against the bundle's manifest (tensor files included), and the archive's own sha256 is
computed as it is written; a mismatch removes the half-written archive.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import io
import os
import queue
import re
import tarfile
import tempfile
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from reprokit._version import __version__
from reprokit.bundle import MANIFEST, REPLICATED, Bundle, _self_digest, dumps, open_bundle, reference, sha256_file
from reprokit.bundle.hashing import open_regular
from reprokit.bundle.reader import _read_manifest
from reprokit.env import FRAMEWORKS
from reprokit.errors import BundleError, ReprokitError
from reprokit.generated import PROBLEM_MARK, accepted, accepting, bundle_problems, digest, mismatch
from reprokit.gzip_members import GzipMembers

# The archive's own manifest; reprokit.archive checks it.
PACK_MANIFEST = "pack-manifest.json"
PACK_FORMAT = "reprokit-pack"
PACK_VERSION = 1
_PACKAGE = Path(__file__).resolve().parent
# Replay needs what ``import reprokit`` pulls in, plus the demo's build/step and what repro.py itself imports (text.py):
# found by following module-level ``reprokit.*`` imports from these, so a new module can never be forgotten.
# extract_op.py: an extract's rk_extract.py imports its check of the one op it may run. extract_repro.py: what an
# extract's rk_extract.py must be (generated.py compares the two, and the two templates are read, never imported).
RUNTIME_ROOTS = ("__init__.py", "demo.py", "text.py", "extract_op.py", "extract_repro.py")


def runtime_files(extra_roots: tuple[str, ...] = ()) -> list[str]:
    """Files of the reprokit package that ``import reprokit`` (and the demo, and ``extra_roots``) need, relative
    to it."""
    return list(_runtime_files(tuple(extra_roots)))


@functools.lru_cache(maxsize=8)
def _runtime_files(extra_roots: tuple[str, ...]) -> tuple[str, ...]:
    """:func:`runtime_files`, once per process: it parses the package's sources, and every archive opened compares
    its vendored runtime with this list (parsing ~40 files each time made opening an archive slow)."""
    todo, found = [*RUNTIME_ROOTS, *extra_roots], set()
    while todo:
        rel = todo.pop()
        if rel in found:
            continue
        found.add(rel)
        tree = ast.parse((_PACKAGE / rel).read_text())
        body = list(tree.body)
        for node in body:  # module level only: lazy imports inside functions are optional extras
            if isinstance(node, ast.If):
                # `if TYPE_CHECKING:` lists what reprokit/__init__.py loads lazily; elsewhere it names types only
                # (reprokit.skip's names the torch-heavy proof code, which replay never runs)
                checking = isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                if rel == "__init__.py" or not checking:
                    body += node.body + ([] if checking else node.orelse)
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "reprokit":
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "reprokit"]
            for name in names:
                parts = name.split(".")[1:]
                for cand in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
                    if parts and (_PACKAGE / cand).is_file():
                        todo.append(cand)
                # a module of a subpackage (reprokit.bundle.layout) imports its package's __init__ first
                todo += ["/".join(parts[:i]) + "/__init__.py" for i in range(1, len(parts))
                         if (_PACKAGE / "/".join(parts[:i]) / "__init__.py").is_file()]
    return tuple(sorted(found))


REPRO_PY = '''\
#!/usr/bin/env python3
"""Replay the bundle in ./bundle with the vendored reprokit runtime in ./reprokit.

    python repro.py [--times N] [--device cpu|cuda] [--json]

Needs only torch, numpy and safetensors. Exit codes: 1 the failure reproduces,
0 it does not (fixed), 3 the bundle is invalid, 125 it fails differently (another
failure, or at another step) or its code does not import here.
"""
import argparse
import importlib.util
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NEEDS = {}  # training frameworks the bundle's code imports: name -> version it was recorded with
missing = [f"{name} (recorded with {version})" if version else name for name, version in NEEDS.items()
           if importlib.util.find_spec(name) is None]
if missing:
    pins = " ".join(f"{name}=={version}" if version else name for name, version in NEEDS.items())
    print(f"Error: this repro needs {', '.join(missing)}, which is not installed here; "
          f"install it (pip install {pins}) and run repro.py again.", file=sys.stderr)
    sys.exit(125)
sys.path.insert(0, HERE)  # the vendored runtime wins over any installed reprokit

from reprokit.bundle import jsonable  # noqa: E402
from reprokit.errors import ReprokitError  # noqa: E402
from reprokit.replayer import format_report, replay  # noqa: E402
from reprokit.text import printable  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description="Replay this repro.")
    ap.add_argument("--times", type=int, default=1, help="replays, to tell deterministic from flaky")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: where it was recorded")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    try:
        report = replay(os.path.join(HERE, "bundle"), times=args.times, device=args.device)
    except ReprokitError as e:
        print(printable(f"Error: {e}"), file=sys.stderr)
        return e.exit_code
    d = report.to_json()
    print(json.dumps(jsonable(d), indent=2) if args.json else printable(format_report(d)))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
'''


@dataclass
class PackResult:
    output: Path
    sha256: str
    size: int
    breakdown: dict[str, int]
    folder: str = ""
    """The one top-level folder the archive extracts to (``repro-`` + 12 hex digits of the bundle's manifest)."""

    def to_json(self) -> dict[str, Any]:
        return {"output": str(self.output), "sha256": self.sha256, "bytes": self.size,
                "sha256_file": str(self.output) + ".sha256", "folder": self.folder, "breakdown": self.breakdown}


def frameworks_needed(b: Bundle) -> dict[str, str | None]:
    """Training frameworks (:data:`reprokit.env.FRAMEWORKS`) the bundle's replay imports, with the version recorded:
    named by its refs (``reprokit.integrations.NAME``), or imported by the code replay imports from its snapshot
    (the refs' modules and, transitively, the snapshot's modules they import)."""
    refs = b.run.get("refs") or {}
    roots = [r for r in (refs.get("build"), refs.get("step"), *refs.get("predicates", [])) if isinstance(r, dict)]
    names = {str(r.get("module", "")).removeprefix("reprokit.integrations.") for r in roots}
    code = b.code_dir
    files = [] if code is None else [
        [code / r["script"]] if "script" in r else _module_files(code, str(r.get("module", ""))) for r in roots]
    todo, seen = [f for fs in files for f in fs], set()
    while todo and code is not None:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, ValueError, OSError, RecursionError, MemoryError):
            continue  # (verify refuses code too deep to parse; a file it cannot parse names no framework here)
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for module in modules:
                names.add(module.split(".")[0])
                todo += _module_files(code, module)
    recorded = b.env.get("frameworks") or {}
    return {name: recorded.get(name) for name in FRAMEWORKS if name in names}


def _module_files(code: Path, module: str) -> list[Path]:
    """The snapshot's file for ``module`` (a module or a package), if it holds one."""
    base = code.joinpath(*module.split("."))
    return [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()] if module else []


def _needs_line(needs: dict[str, str | None]) -> str:
    return ", ".join(f"{name} {version}" if version else name for name, version in needs.items())


def _readme(b: Bundle, needs: dict[str, str | None]) -> str:
    f, env, run = b.failure, b.env, b.run
    git = env.get("git") or {}
    return "\n".join([
        "# A reprokit repro",
        "",
        f"**Failure:** {f.describe()}",
        "",
        f"- window: steps {run['window']['start']}..{run['window']['end']} ({len(b.steps)} "
        f"step{'' if len(b.steps) == 1 else 's'}), replayed from "
        f"the snapshot at step {run['window']['start']}",
        f"- recorded with python {env.get('python')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"devices {env.get('devices') or ['cpu']}",
        f"- code: git {git.get('commit') or 'n/a'}{' (dirty)' if git.get('dirty') else ''}",
        "",
        "## Run it",
        "",
        "Needs python >= 3.10 with torch, numpy and safetensors; nothing else." if not needs else
        f"Needs python >= 3.10 with torch, numpy, safetensors and {_needs_line(needs)} (repro.py checks it first "
        "and says what to install).",
        "",
        "`repro.py` runs code: it imports `build` and the step function from `bundle/code/` (the recording",
        "project's own source) and executes them. Read that folder, or run it in a sandbox, unless you trust",
        "where this archive came from; check the archive against a `.sha256` you received separately.",
        "",
        "```bash",
        "python repro.py            # exit 1: reproduced, 0: not reproduced (fixed)",
        "python repro.py --times 5  # deterministic or flaky?",
        "python repro.py --device cpu --json",
        "```",
        "",
        "With reprokit installed, `reprokit replay`, `inspect` and `shrink` also take this folder's `bundle/`,",
        "or the archive itself (`reprokit verify repro.tar` checks it against its .sha256 first).",
        "",
    ])


COPY_BYTES = 16 << 20
"""Bytes per read/write while streaming files into the archive."""


def compressed_name(output: Path) -> bool:
    """Whether ``output`` asks for gzip (``.tar.gz``/``.tgz``); anything else gets a plain ``.tar``."""
    return output.name.endswith((".tar.gz", ".tgz"))


class _Ahead(io.RawIOBase):
    """A file read one chunk ahead on a helper thread, each chunk hashed on another, in order.

    Reading, hashing the source (checked against the bundle's manifest), writing and hashing the archive
    each run on their own thread (:class:`_Behind` takes the writing side), so packing a state costs the
    slowest of the four, not their sum: sha256 on one core is about as fast as a disk.
    """

    def __init__(self, f: BinaryIO, hashing: ThreadPoolExecutor, chunk: int = COPY_BYTES):
        """``hashing`` must have one thread: the chunks are hashed in the order they were read."""
        self.sha, self.n = hashlib.sha256(), 0
        self._f, self._chunk, self._hashing = f, chunk, hashing
        self._queue: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        self._rest, self._eof = b"", False
        self._pending: Future[None] | None = None
        self._thread = threading.Thread(target=self._fill, name="reprokit-pack-read", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                data = self._f.read(self._chunk)
                self._put(data)
                if not data:
                    return
        except BaseException as e:  # handed to the reading thread, which raises it
            self._put(e)

    def _put(self, item: bytes | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        out = [self._rest] if self._rest else []
        have = len(self._rest)
        while (n < 0 or have < n) and not self._eof:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if not item:
                self._eof = True
                break
            out.append(item)
            have += len(item)
        data = out[0] if len(out) == 1 else b"".join(out)
        if 0 <= n < len(data):
            data, self._rest = data[:n], data[n:]
        else:
            self._rest = b""
        if data:  # exactly the bytes handed to the archive, in order (one hashing thread)
            self._pending = self._hashing.submit(self.sha.update, data)
        self.n += len(data)
        return data

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._pending is not None:
            self._pending.result()  # the digest is complete once the reader is closed
        super().close()


class _Behind(io.RawIOBase):
    """The archive, written on a helper thread one piece behind, and hashed on another, in order."""

    def __init__(self, f: BinaryIO, writing: ThreadPoolExecutor, hashing: ThreadPoolExecutor):
        self.sha, self.n = hashlib.sha256(), 0
        self._f, self._writing, self._hashing = f, writing, hashing
        self._written: Future[None] | None = None
        self._hashed: Future[None] | None = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.n

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self._f.write(view):]

    def write(self, data: Any) -> int:
        data = bytes(data) if not isinstance(data, bytes) else data  # the caller may reuse a mutable buffer
        self.wait()  # at most one piece in flight: memory stays bounded, errors surface at the next write
        self._written = self._writing.submit(self._write_all, data)
        self._hashed = self._hashing.submit(self.sha.update, data)
        self.n += len(data)
        return len(data)

    def wait(self) -> None:
        for fut in (self._written, self._hashed):
            if fut is not None:
                fut.result()

    def flush(self) -> None:
        self.wait()


def pack(bundle: str | Path, output: str | Path) -> PackResult:
    """Write ``output`` (a plain ``.tar``; gzip when its name ends in ``.tar.gz``) and ``output.sha256``
    for a verified bundle folder.

    Files are streamed from disk into a temporary archive beside ``output`` and renamed into
    place, so model state larger than memory packs too. Each bundle file is hashed as it is
    copied and must match the bundle's manifest (else nothing is written).

    Example:
        >>> r = pack("repros/bundle-...", "repro.tar")                # doctest: +SKIP
        >>> r.sha256                                                   # doctest: +SKIP
    """
    b = open_bundle(Path(bundle))  # JSON, code and sizes now; tensor files hashed as they are copied below
    if REPLICATED in b.manifest["files"]:
        # A rank's bundle that references rank 0's state: the archive must stand alone, so the state is written
        # into a self-contained copy (digests checked as it is read) and that copy is packed.
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".reprokit-materialise-", dir=Path(output).parent) as tmp:
            return _pack(open_bundle(reference.materialise(b, Path(tmp), b.path.name)), Path(output))
    return _pack(b, Path(output))


def generated_files(b: Bundle) -> dict[str, bytes]:
    """What this reprokit writes beside ``bundle/`` in the archive of ``b``: the vendored runtime, ``repro.py`` and
    ``README.md`` (:mod:`reprokit.generated` holds an archive's files to exactly these)."""
    needs = frameworks_needed(b)
    integrations = tuple(f"integrations/{name}.py" for name in needs if (_PACKAGE / "integrations" / f"{name}.py").is_file())
    integrations += ("integrations/__init__.py",) if integrations else ()
    out = {f"reprokit/{name}": (_PACKAGE / name).read_bytes() for name in runtime_files(integrations)}
    repro_py = REPRO_PY.replace("NEEDS = {}", f"NEEDS = {needs!r}", 1)
    return out | {"repro.py": repro_py.encode(), "README.md": _readme(b, needs).encode()}


# --- generated files of an archive (reprokit.generated holds a bundle's own) -------------------------

_VERSION_RE = re.compile(rb"""^__version__\s*=\s*["']([^"'\n]{1,64})["']""", re.M)


def _packed_by(top: Path) -> str | None:
    """The version of the runtime an archive vendors (read, never imported)."""
    try:
        m = _VERSION_RE.search((top / "reprokit" / "_version.py").read_bytes()[:4096])
    except OSError:
        return None
    return m[1].decode(errors="replace") if m else None


def archive_problems(bundle: Path) -> list[dict[str, Any]]:
    """Files ``reprokit pack`` writes beside ``bundle`` (``repro.py``, ``README.md``, the vendored runtime) that
    differ from what this reprokit writes for it, or are missing, or are there though pack writes no such file.
    Empty for a bundle folder tarred by hand (no pack manifest), for a bundle that does not open (its own problems
    are reported where it is opened), and while :func:`accepting`."""
    top = bundle.parent
    if accepted() or bundle.name != "bundle" or not (top / PACK_MANIFEST).is_file():
        return []
    try:
        with accepting():  # the bundle's own generated files are reported where the bundle is verified
            expected = generated_files(open_bundle(bundle))
    except ReprokitError:
        return []
    writer = _packed_by(top)
    present = sorted(p.relative_to(top).as_posix() for p in top.rglob("*")
                     if p.is_file() and not p.is_symlink() and p.relative_to(top).parts[0] not in ("bundle",)
                     and p.name != PACK_MANIFEST)
    out = []
    for rel in present:
        if rel not in expected:
            out.append({"file": rel, "problem": f"not a file reprokit pack writes: the archive {PROBLEM_MARK} "
                                                f"({__version__}) packs (packed by reprokit {writer or 'unknown'})"})
            continue
        data = (top / rel).read_bytes()
        want = expected[rel]
        if data != want:
            out.append(mismatch(rel, digest(data), digest(want), writer, "the packed " + rel + " of this bundle"))
    for rel in sorted(set(expected) - set(present)):
        out.append({"file": rel, "problem": f"missing: the archive {PROBLEM_MARK} ({__version__}) packs, which "
                                            f"writes this file (packed by reprokit {writer or 'unknown'})"})
    return out


def differences(bundle: Path) -> list[dict[str, Any]]:
    """Every generated file of the bundle folder ``bundle`` (and of the archive it was extracted from) that differs
    from what this reprokit writes, accepted or not: what ``verify --accept-generated`` lists as accepted
    (:mod:`reprokit.generated`)."""
    manifest, _ = _read_manifest(bundle)
    if manifest is None:
        return []
    with accepting(False):
        return bundle_problems(bundle, manifest["files"], manifest.get("reprokit_version")) + archive_problems(bundle)


def _pack(b: Bundle, output: Path) -> PackResult:
    top = "repro-" + sha256_file(b.path / MANIFEST)[:12]
    # Exactly the files the verified manifest lists (and the manifest): never whatever else is in the folder by
    # now (a file, or a link to one outside, added after the bundle was opened would be shipped to others).
    files: dict[str, Path | bytes] = {f"bundle/{rel}": b.path / rel for rel in sorted([*b.manifest["files"], MANIFEST])}
    runtime: dict[str, Path | bytes] = dict(generated_files(b))
    files |= runtime
    pack_manifest = files[PACK_MANIFEST] = _pack_manifest(b, files)
    dirs = {"/".join(name.split("/")[:i]) for name in files for i in range(1, name.count("/") + 1)}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_tmp(output)
    try:
        with _create(tmp) as raw, \
                ThreadPoolExecutor(1, thread_name_prefix="reprokit-pack-write") as writing, \
                ThreadPoolExecutor(1, thread_name_prefix="reprokit-pack-hash") as hashing, \
                ThreadPoolExecutor(1, thread_name_prefix="reprokit-pack-check") as checking:
            out = _Behind(raw, writing, hashing)  # the archive's sha256, as it is written
            with GzipMembers(out) if compressed_name(output) else contextlib.nullcontext(out) as stream, \
                    tarfile.open(fileobj=stream, mode="w", format=tarfile.PAX_FORMAT) as tf:
                tf.copybufsize = COPY_BYTES  # type: ignore[attr-defined]  # (a TarFile attribute since 3.8)
                tf.addfile(_info(top, 0, directory=True))
                for name in sorted(dirs | files.keys()):
                    _add(tf, top, name, files.get(name), b, checking)
            out.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)
    digest = out.sha.hexdigest()
    _atomic_write(output.with_name(output.name + ".sha256"), f"{digest}  {output.name}\n".encode())
    breakdown = b.sizes()
    breakdown["metadata"] += (b.path / MANIFEST).stat().st_size + len(pack_manifest)
    breakdown["runtime"] = sum(len(v) if isinstance(v, bytes) else v.stat().st_size for v in runtime.values())
    return PackResult(output, digest, output.stat().st_size, breakdown, top)


def _add(tf: tarfile.TarFile, top: str, name: str, src: Path | bytes | None, b: Bundle,
         checking: ThreadPoolExecutor) -> None:
    """One member; a bundle file is hashed while copied and checked against the bundle's manifest."""
    if src is None:
        tf.addfile(_info(f"{top}/{name}", 0, directory=True))
    elif isinstance(src, bytes):
        tf.addfile(_info(f"{top}/{name}", len(src), executable=name == "repro.py"), io.BytesIO(src))
    else:
        # A bundle file must still be a regular file (not a link or FIFO swapped in since it was verified).
        try:
            fh = open_regular(src) if name.startswith("bundle/") else open(src, "rb", buffering=0)  # noqa: SIM115
        except OSError as e:
            raise BundleError(f"{src} cannot be read ({e.strerror or e}): was the bundle changed while it was being "
                              "packed? Nothing was packed. Run `reprokit verify` on it.",
                              [{"file": name.removeprefix("bundle/"), "problem": f"cannot be read: {e.strerror or e}"}]
                              ) from None
        with fh:
            size = os.fstat(fh.fileno()).st_size
            hashing = _Ahead(fh, checking)  # type: ignore[arg-type]
            try:
                tf.addfile(_info(f"{top}/{name}", size), hashing)
            finally:
                hashing.close()
        meta = b.manifest["files"].get(name.removeprefix("bundle/")) if name.startswith("bundle/") else None
        if meta is not None and (hashing.sha.hexdigest() != meta["sha256"] or hashing.n != meta["size"]):
            raise BundleError(f"{src} changed or is damaged: its sha256 does not match the bundle's manifest; "
                              "nothing was packed. Re-record the bundle, or run `reprokit verify` on it.",
                              [{"file": name.removeprefix("bundle/"), "problem": "checksum mismatch",
                                "expected": meta["sha256"], "found": hashing.sha.hexdigest()}])


def _pack_manifest(b: Bundle, files: dict[str, Path | bytes]) -> bytes:
    """Every file of the archive with its sha256 and size. Bundle files reuse the digests of the bundle's
    manifest (verified when it was opened); if one changed on disk since, the archive fails ``verify``."""
    listed: dict[str, dict[str, Any]] = {}
    for name, src in files.items():
        rel = name.removeprefix("bundle/")
        if name.startswith("bundle/") and rel in b.manifest["files"]:
            meta = b.manifest["files"][rel]
            listed[name] = {"sha256": meta["sha256"], "size": meta["size"]}
        else:
            data = src if isinstance(src, bytes) else src.read_bytes()
            listed[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    m: dict[str, Any] = {"format": PACK_FORMAT, "version": PACK_VERSION, "files": dict(sorted(listed.items()))}
    m["self_sha256"] = _self_digest(m)
    return dumps(m)


def _info(name: str, size: int, *, directory: bool = False, executable: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.size = size
    info.mode = 0o755 if directory or executable else 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _fresh_tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _create(tmp: Path) -> io.FileIO:
    """A new file at ``tmp``, never an existing one or a link (the output folder may be shared, say /tmp: a link
    planted at a predictable temp name would have had the archive written through it, over its target)."""
    return io.FileIO(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644), "wb")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = _fresh_tmp(path)
    try:
        with _create(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
