"""Strict reading and explicit schemas for every file of a bundle.

A bundle may come from a buggy writer, another tool or a hand edit whose manifest checksums were
recomputed: consistent, yet malformed. Before anything uses a file, :func:`load_json` parses it
strictly (size cap, nesting depth checked on the raw text, no ``NaN``/``Infinity``/``1e999``, no
duplicate keys, bounded strings) and the ``check_*`` functions hold it to the schema the writer
(``record.py``, ``shrink``) produces: types, required keys, ranges. Safetensors headers are checked
the same way (:func:`check_safetensors`). Every refusal is a :class:`SchemaError` (a
:class:`~reprokit.errors.BundleError`, exit 3) naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from reprokit.bundle.hashing import open_regular
from reprokit.bundle.layout import (
    CODE,
    ENV,
    FAILURE,
    MANIFEST,
    OP_JSON,
    REPLICATED,
    RUN,
    STATE_FILE,
    STATE_JSON,
    STEP_FILE,
    STEPS,
    state_file_name,
    state_parts,
    step_name,
)
from reprokit.errors import DAMAGED_BUNDLE_ADVICE, BundleError
from reprokit.signature import KINDS, FailureKind

MAX_JSON_BYTES = 64 * 1024 * 1024
"""Largest JSON file a bundle may hold (tensors live in safetensors; JSON is metadata)."""
MAX_DEPTH = 200
"""Deepest nesting of arrays/objects in any JSON file (the writer's trees are a few levels deep)."""
MAX_STRING_CHARS = 1024 * 1024
"""Longest string value (the writer cuts git diffs at 1,000,000 characters, tracebacks at 20,000)."""
MAX_KEY_CHARS = 4096
"""Longest object key (a file path in the manifest is at most this long)."""
MAX_NAME_BYTES = 255
"""Longest component of a path the manifest lists (what filesystems allow)."""
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest safetensors header (the safetensors library's own limit)."""
MAX_DIMS = 64
"""Most dimensions of one tensor in a safetensors file (torch's CUDA kernels take 25; nothing real has more)."""
MAX_DIM = 1 << 48
"""Largest single dimension of a tensor (an empty tensor's other dimensions too: ``[0, 2**62]`` holds no byte, but
no array library can make it)."""
MAX_ELEMENTS = 1 << 48
"""Most elements of a tensor counting its non-zero dimensions only (so a ``[0, 2**30, 2**30]`` tensor is refused:
numpy and torch compute the shape's full extent, and it must fit their 64-bit sizes)."""
MAX_TENSORS = 1 << 17
"""Most tensors in one safetensors file (the writer splits a state in files of at most 256 MiB; a file listing a
million empty tensors took a minute to check and load)."""

NONFINITE = frozenset({"nan", "inf", "-inf"})
"""How the writer stores non-finite floats (``jsonable``)."""

# Bytes per element of each safetensors dtype torch can load.
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
            "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}

_HEX64 = re.compile(r"[0-9a-f]{64}")
_QUOTE_OR_BRACKET = b'"[]{}'
_OTHER_BYTES = bytes(sorted(set(range(256)) - set(_QUOTE_OR_BRACKET)))
_DEPTH_CHUNK = 4 << 20
_TREE_TAGS = ("__rk_tensor__", "__rk_ndarray__", "__rk_tuple__", "__rk_dict__", "__rk_float__")


class SchemaError(BundleError):
    """A bundle file that is well-formed on disk (checksums match) but not what a bundle holds."""

    def __init__(self, file: str, field: str, why: str):
        where = f"{file}: {field}" if field else file
        super().__init__(f"{where} {why}. {DAMAGED_BUNDLE_ADVICE}", [{"file": file, "problem": f"{field} {why}".strip()}])
        self.file, self.field, self.why = file, field, why


def type_name(v: Any) -> str:
    names: dict[type, str] = {dict: "object", list: "list"}
    return "null" if v is None else names.get(type(v), type(v).__name__)


# --- strict JSON --------------------------------------------------------------------------

def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (non-finite numbers are stored as the strings \"nan\", \"inf\", \"-inf\")")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:40]} is out of range for a float")
    return x


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup[:80]!r}")
    return out


def nesting_depth(data: bytes) -> int:
    """Deepest ``[``/``{`` nesting of JSON text, brackets inside strings ignored; no recursion.

    Linear at C speed whatever the text (64 MiB of brackets, of empty strings or one string: well under a
    second; a regex match per string or a Python step per bracket took 10-30 s): escapes are cut out
    (backslashes only occur inside strings in valid JSON), then a bracket counts when an even number of
    quotes precedes it. Up to the first syntax error this reads the text as ``json.loads`` does, so a
    parse never goes deeper than this says.
    """
    import numpy as np  # imported here: only a bundle's JSON needs it, and numpy is a dependency anyway

    kept = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _OTHER_BYTES)
    quotes, depth, deepest = 0, 0, 0
    for at in range(0, len(kept), _DEPTH_CHUNK):  # bounded pieces: int64 depths of 64 MiB would take 512 MiB
        a = np.frombuffer(kept, dtype=np.uint8, count=min(_DEPTH_CHUNK, len(kept) - at), offset=at)
        is_quote = a == ord('"')
        # Quote parity: a uint8 running count wraps at 256, an even number, so its lowest bit stays right.
        outside = ((np.cumsum(is_quote, dtype=np.uint8) + quotes) & 1) == 0
        step = (outside & ((a == ord("[")) | (a == ord("{")))).astype(np.int64)
        step -= outside & ((a == ord("]")) | (a == ord("}")))
        run = np.cumsum(step) + depth
        deepest = max(deepest, int(run.max()))
        quotes, depth = (quotes + int(np.count_nonzero(is_quote))) & 1, int(run[-1])
    return deepest


def parse_json(data: bytes, what: str) -> Any:
    """Parse ``data`` strictly; ``what`` names it in errors (a bundle file's path)."""
    if len(data) > MAX_JSON_BYTES:
        raise SchemaError(what, "", f"is {len(data)} bytes; bundle JSON files are at most {MAX_JSON_BYTES}")
    depth = nesting_depth(data)
    if depth > MAX_DEPTH:
        raise SchemaError(what, "", f"nests {depth} levels deep; at most {MAX_DEPTH} are allowed")
    try:
        text = data.decode("utf-8")
        doc = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                         object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SchemaError(what, "", f"is not valid strict JSON: {str(e)[:300]}") from None
    _check_sizes(what, doc, "")
    return doc


def load_json(path: Path, what: str, *, follow_links: bool = True) -> Any:
    """Read and parse one JSON file of a bundle strictly.

    The file is opened once, refused unless that open file is a regular one (a FIFO is opened without blocking,
    so one swapped in cannot hang the reader; a device such as ``/dev/zero`` is refused unread), and its size is
    checked on that same descriptor before it is read; at most :data:`MAX_JSON_BYTES` + 1 bytes are read
    whatever the size said, so a file that grows meanwhile is refused too.
    """
    try:
        with open_regular(path, follow_links=follow_links) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise SchemaError(what, "", f"is {size} bytes; bundle JSON files are at most {MAX_JSON_BYTES}")
            data = f.read(MAX_JSON_BYTES + 1)
    except OSError as e:
        raise SchemaError(what, "", f"cannot be read: {e.strerror or e}") from None
    return parse_json(data, what)


def available_memory() -> int | None:
    """Bytes of memory this process can still get now: on Linux ``MemAvailable`` plus free swap (``/proc/meminfo``),
    else free physical pages (``os.sysconf``); None when neither is known."""
    try:
        with open("/proc/meminfo", "rb") as f:
            info = {k.strip(): v.split() for k, _, v in (line.decode("ascii", "replace").partition(":") for line in f)}
        if "MemAvailable" in info:
            return sum(int(info[k][0]) * 1024 for k in ("MemAvailable", "SwapFree") if k in info)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(size: int, what: str, why: str = "read it") -> None:
    """Refuse to allocate ``size`` bytes for ``what`` (a bundle file, named in the message) when that is more than
    the memory available now (:func:`available_memory`): a size from a manifest is not verified until the file's
    bytes are hashed, and a buffer of it must not take the machine down (or end in an internal error) first.

    Raises:
        DoesNotFitError: (exit 125) saying how much is needed and how much there is.
    """
    from reprokit.errors import DoesNotFitError

    free = available_memory()
    if free is not None and size > free:
        raise DoesNotFitError(
            f"{what} is {size} bytes ({size / 2**30:.1f} GiB) in the manifest; to {why} it must be held in memory, "
            f"but only {free} bytes ({free / 2**30:.1f} GiB) are available on this machine. Use a machine with more "
            "free memory, or run `reprokit verify` (it hashes without holding the file) to check the file is what "
            "the manifest says: a size this large from a damaged or crafted manifest is refused here too.")


def _unicode(what: str, field: str, s: str, role: str) -> None:
    """Refuse a string holding an unpaired surrogate (JSON's ``\\ud800`` escape): it is no Unicode text, and
    printing it, or using it as a file name, fails far from here."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise SchemaError(what, field or "<root>", f"holds a {role} with an unpaired surrogate "
                                                       f"({s[e.start]!r} at {e.start}): not Unicode text") from None


def load_listed_json(root: Path, rel: str, meta: dict[str, Any]) -> Any:
    """Read and parse ``root/rel``, a JSON file a manifest lists with ``meta`` (``{"sha256", "size"}``).

    The bytes are read once, checked against the manifest's size and sha256, and parsed from that same
    buffer: what is checked and used is what was hashed, even if the file is swapped after ``verify``.
    A link, a FIFO or a device in its place is refused unopened (no hang on a FIFO).

    Raises:
        BundleError: the file cannot be read, is not a regular file, or its bytes are not the manifest's.
        SchemaError: the bytes are not strict JSON (see :func:`parse_json`).
    """
    size = meta["size"]
    if size > MAX_JSON_BYTES:
        raise SchemaError(rel, "", f"is {size} bytes; bundle JSON files are at most {MAX_JSON_BYTES}")
    try:
        with open_regular(root / rel) as f:
            data = f.read(size + 1)  # one byte more: a longer file shows as a size mismatch
    except OSError as e:
        raise BundleError(f"{root}: {rel} cannot be read ({e.strerror or e}). {DAMAGED_BUNDLE_ADVICE}",
                          [{"file": rel, "problem": f"cannot be read: {e.strerror or e}"}]) from None
    found = hashlib.sha256(data).hexdigest()
    if len(data) != size or found != meta["sha256"]:
        what = "size" if len(data) != size else "checksum"
        raise BundleError(f"{root}: {rel}: {what} mismatch: it changed since the manifest was checked (sha256 {found}, "
                          f"the manifest says {meta['sha256']}); refusing to read it. {DAMAGED_BUNDLE_ADVICE}",
                          [{"file": rel, "problem": f"{what} mismatch", "expected": meta["sha256"], "found": found}])
    return parse_json(data, rel)


def _check_sizes(what: str, v: Any, field: str) -> None:
    if isinstance(v, str):
        if len(v) > MAX_STRING_CHARS:
            raise SchemaError(what, field or "<root>", f"is a string of {len(v)} characters; at most "
                                                       f"{MAX_STRING_CHARS} are allowed")
        _unicode(what, field, v, "string")
    elif isinstance(v, dict):
        for k, x in v.items():
            if len(k) > MAX_KEY_CHARS:
                raise SchemaError(what, field or "<root>", f"has a key of {len(k)} characters (starting "
                                                           f"{k[:40]!r}); at most {MAX_KEY_CHARS} are allowed")
            _unicode(what, field, k, "key")
            _check_sizes(what, x, _join(field, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_sizes(what, x, f"{field}[{i}]")


def _join(field: str, key: str) -> str:
    key = key if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) else repr(key[:80])
    return f"{field}.{key}" if field else key


# --- small checkers -----------------------------------------------------------------------

class _File:
    def __init__(self, name: str):
        self.name = name

    def fail(self, field: str, why: str) -> SchemaError:
        return SchemaError(self.name, field, why)

    def obj(self, v: Any, field: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(field or "<root>", f"must be an object, got {type_name(v)}")
        for k in required:
            if k not in v:
                raise self.fail(_join(field, k), "is missing")
        return v

    def lst(self, v: Any, field: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(field, f"must be a list, got {type_name(v)}")
        return v

    def integer(self, v: Any, field: str, lo: int | None = 0, hi: int | None = None) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(field, f"must be an integer, got {type_name(v)}")
        if lo is not None and v < lo:
            raise self.fail(field, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise self.fail(field, f"must be <= {hi}, got {_short(v)}")
        return v

    def plain(self, v: Any, field: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
        """An object that is a mapping of the tree, not a tagged leaf (``{"__rk_tensor__": ...}`` is a tensor)."""
        self.obj(v, field, required)
        if len(v) == 1 and next(iter(v)) in _TREE_TAGS:
            raise self.fail(field, f"must be an object of named entries, got a {next(iter(v))} leaf")
        return v

    def mapping(self, v: Any, field: str) -> list[tuple[str, Any]]:
        """A dict of the tree: a plain object, or ``{"__rk_dict__": [[key, value], ...]}`` (non-string keys);
        its ``(field, value)`` pairs."""
        if isinstance(v, dict) and set(v) == {"__rk_dict__"} and isinstance(v["__rk_dict__"], list):
            return [(f"{field}.__rk_dict__[{i}][1]", pair[1]) for i, pair in enumerate(v["__rk_dict__"])]
        return [(_join(field, k), x) for k, x in self.plain(v, field).items()]

    def string(self, v: Any, field: str, *, null: bool = False) -> None:
        if not (isinstance(v, str) or (null and v is None)):
            raise self.fail(field, f"must be a string{' or null' if null else ''}, got {type_name(v)}")

    def boolean(self, v: Any, field: str) -> None:
        if not isinstance(v, bool):
            raise self.fail(field, f"must be true or false, got {type_name(v)}")

    def number(self, v: Any, field: str, *, null: bool = True) -> None:
        """A finite number, null, or one of the strings the writer uses for NaN/inf."""
        if v is None and null:
            return
        if isinstance(v, bool) or not (isinstance(v, (int, float)) or (isinstance(v, str) and v in NONFINITE)):
            raise self.fail(field, f"must be a number{', null' if null else ''} or \"nan\"/\"inf\"/\"-inf\", "
                                   f"got {type_name(v)}")

    def tree(self, v: Any, field: str, keys: set[str] | None) -> None:
        """A pytree (``reprokit.pytree``): tags well-formed; tensor refs name a key of ``keys`` when given."""
        if isinstance(v, list):
            for i, x in enumerate(v):
                self.tree(x, f"{field}[{i}]", keys)
            return
        if not isinstance(v, dict):
            return
        if len(v) == 1 and next(iter(v)) in _TREE_TAGS:
            (tag, val), = v.items()
            f = _join(field, tag)
            if tag in ("__rk_tensor__", "__rk_ndarray__"):
                self.string(val, f)
                if keys is not None and val not in keys:
                    raise self.fail(f, f"names tensor {val[:200]!r}, which is not in the file's tensors")
            elif tag == "__rk_tuple__":
                self.tree(self.lst(val, f), f, keys)
            elif tag == "__rk_dict__":
                for i, pair in enumerate(self.lst(val, f)):
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise self.fail(f"{f}[{i}]", f"must be a [key, value] pair, got {type_name(pair)}")
                    if isinstance(pair[0], (dict, list)) and not _hashable_key(pair[0]):
                        raise self.fail(f"{f}[{i}][0]", "must be a number, string, null or tuple of those")
                    self.tree(pair[1], f"{f}[{i}][1]", keys)
            else:
                self.string(val, f)
                try:
                    float(val)
                except ValueError:
                    raise self.fail(f, f"must be a float as a string, got {val[:40]!r}") from None
            return
        for k, x in v.items():
            self.tree(x, _join(field, k), keys)

    def rng(self, v: Any, field: str, keys: set[str] | None) -> None:
        """The RNG tree ``reprokit.rng.encode`` writes (and its tensors, when ``keys`` is given)."""
        self.obj(v, field, ("python", "numpy"))
        py = self.lst(v["python"], f"{field}.python")
        if len(py) != 2:
            raise self.fail(f"{field}.python", f"must be [version, gauss], got {len(py)} items")
        self.integer(py[0], f"{field}.python[0]")
        self.number(py[1], f"{field}.python[1]")
        npy = self.lst(v["numpy"], f"{field}.numpy")
        if len(npy) != 4:
            raise self.fail(f"{field}.numpy", f"must be [name, pos, has_gauss, cached], got {len(npy)} items")
        self.string(npy[0], f"{field}.numpy[0]")
        self.integer(npy[1], f"{field}.numpy[1]")
        self.integer(npy[2], f"{field}.numpy[2]")
        self.number(npy[3], f"{field}.numpy[3]", null=False)
        for i, e in enumerate(self.lst(v.get("owned", []), f"{field}.owned")):
            ef = f"{field}.owned[{i}]"
            self.obj(e, ef, ("path", "kind", "device"))
            self.lst(e["path"], f"{ef}.path")
            self.string(e["kind"], f"{ef}.kind")
            self.string(e["device"], f"{ef}.device", null=True)
            if "tensor" in e:
                self.string(e["tensor"], f"{ef}.tensor")
                if keys is not None and e["tensor"] not in keys:
                    raise self.fail(f"{ef}.tensor", f"names tensor {e['tensor'][:200]!r}, which is not in the "
                                                    "file's tensors")
            elif "state" not in e:
                raise self.fail(ef, "must hold a \"tensor\" or a \"state\"")
        if keys is not None:
            for k in ("rng/python", "rng/numpy", "rng/torch"):
                if k not in keys:
                    raise self.fail(field, f"needs tensor {k!r}, which is not in the file's tensors")


def _hashable_key(v: Any) -> bool:
    if isinstance(v, dict):
        return set(v) == {"__rk_tuple__"} and isinstance(v["__rk_tuple__"], list) and all(
            _hashable_key(x) for x in v["__rk_tuple__"])
    return not isinstance(v, list)


# --- the files ----------------------------------------------------------------------------

def check_manifest_files(files: dict[str, Any], name: str = MANIFEST) -> None:
    """The ``files`` table: each a relative path -> ``{"sha256": 64 hex, "size": int >= 0}``."""
    f = _File(name)
    for rel, meta in files.items():
        field = f"files[{rel[:80]!r}]"
        parts = rel.split("/")
        if not rel or any(len(p.encode()) > MAX_NAME_BYTES for p in parts):
            raise f.fail(field, f"is not a usable file path (empty, or a name over {MAX_NAME_BYTES} bytes)")
        f.obj(meta, field, ("sha256", "size"))
        extra = sorted(set(meta) - {"sha256", "size"})
        if extra:
            raise f.fail(field, f"has unknown field(s) {', '.join(map(repr, extra))}")
        if not isinstance(meta["sha256"], str) or not _HEX64.fullmatch(meta["sha256"]):
            raise f.fail(f"{field}.sha256", "must be 64 lowercase hex digits")
        f.integer(meta["size"], f"{field}.size")


def check_manifest(m: Any, name: str = MANIFEST) -> None:
    f = _File(name)
    f.obj(m, "", ("format", "version", "files"))
    f.string(m["format"], "format")
    f.integer(m["version"], "version", lo=1)
    for k in ("created", "reprokit_version"):
        if k in m:
            f.string(m[k], k)
    if "self_sha256" in m and not (isinstance(m["self_sha256"], str) and _HEX64.fullmatch(m["self_sha256"])):
        raise f.fail("self_sha256", "must be 64 lowercase hex digits")
    check_manifest_files(f.obj(m["files"], "files"), name)


def check_failure(d: Any, name: str = FAILURE) -> None:
    f = _File(name)
    f.obj(d, "", ("kind", "step"))
    f.string(d["kind"], "kind")
    if d["kind"] not in KINDS:
        raise f.fail("kind", f"must be one of {', '.join(KINDS)}, got {d['kind'][:80]!r}")
    f.integer(d["step"], "step")
    for k in ("exc_type", "frame", "frame_qualname"):
        if k in d:
            f.string(d[k], k, null=True)
    for k in ("message", "traceback"):
        if k in d:
            f.string(d[k], k)
    for k in ("detail", "signature"):
        if k in d:
            f.obj(d[k], k)
    if isinstance(d.get("detail"), dict) and d["detail"].get("incident") is not None:
        _check_incident(f, d["detail"]["incident"], "detail.incident")


def _detect_fields() -> dict[str, Any]:
    from reprokit.detect_settings import DetectSettings

    return {x.name: x.type for x in dataclasses.fields(DetectSettings)}


def check_run(d: Any, name: str = RUN) -> None:
    """What replay, inspect, shrink and bisect read of ``run.json`` (extra keys, like provenance, are kept)."""
    from reprokit.code import _check_shape

    f = _File(name)
    f.obj(d, "", ("refs", "config", "recorder", "window", "history"))
    refs = f.obj(d["refs"], "refs", ("build", "step"))
    preds = f.lst(refs.get("predicates", []), "refs.predicates")
    _check_shape(name, "refs.build", refs["build"])
    _check_shape(name, "refs.step", refs["step"])
    for i, r in enumerate(preds):
        if r is not None:
            _check_shape(name, f"refs.predicates[{i}]", r)
    f.tree(d["config"], "config", set())
    rec = f.obj(d["recorder"], "recorder", ("detect",))
    detect = f.obj(rec["detect"], "recorder.detect")
    known = _detect_fields()
    for k, v in detect.items():
        field = _join("recorder.detect", k)
        if k not in known:
            raise f.fail(field, f"is not a detector setting (known: {', '.join(known)})")
        if k.startswith("check_") or k == "loss_from_mapping":
            f.boolean(v, field)
        elif k == "spike_factor":
            f.number(v, field)
            if v is not None and (v in NONFINITE or v <= 1):
                raise f.fail(field, f"must be > 1 or null, got {v!r}")
        else:
            f.integer(v, field, lo=1 if k == "scaler_patience" else 2, hi=MAX_COUNT)
    if "snapshot_every" in rec:
        f.integer(rec["snapshot_every"], "recorder.snapshot_every", lo=1)
    if "max_lag" in rec:
        f.integer(rec["max_lag"], "recorder.max_lag", hi=MAX_COUNT)
    if "detected_lag" in d:
        f.integer(d["detected_lag"], "detected_lag", hi=MAX_COUNT)
    if "distributed" in d:
        _check_distributed(f, d["distributed"])
    if "determinism" in d:
        for k, v in f.obj(d["determinism"], "determinism").items():
            f.boolean(v, _join("determinism", k))
    if "precision" in d:
        from reprokit.env import FP32_PRECISION

        prec = f.obj(d["precision"], "precision")
        if "float32_matmul_precision" in prec:
            f.string(prec["float32_matmul_precision"], "precision.float32_matmul_precision")
        if "fp32_precision" in prec:
            for k, v in f.obj(prec["fp32_precision"], "precision.fp32_precision").items():
                if k not in FP32_PRECISION:
                    raise f.fail(_join("precision.fp32_precision", k), f"is not one of {', '.join(FP32_PRECISION)}")
                f.string(v, _join("precision.fp32_precision", k))
    if "device" in d:
        f.string(d["device"], "device")
    w = f.obj(d["window"], "window", ("start", "end", "steps"))
    f.integer(w["start"], "window.start")
    f.integer(w["end"], "window.end")
    steps = f.lst(w["steps"], "window.steps")
    for i, s in enumerate(steps):
        f.integer(s, f"window.steps[{i}]")
        if s > 99_999_999:
            raise f.fail(f"window.steps[{i}]", f"must be at most 99999999 (8-digit file names), got {s}")
    if len(set(steps)) != len(steps):
        raise f.fail("window.steps", "lists a step twice")
    if "model" in d:
        _check_tables(f, d["model"])
    if "extract" in d:
        _check_extract(f, d["extract"])
    if "provenance" in d:
        _check_provenance(f, d["provenance"])
    for i, h in enumerate(f.lst(d["history"], "history")):
        f.obj(h, f"history[{i}]", ("step", "loss", "grad_norm"))
        f.integer(h["step"], f"history[{i}].step")
        f.number(h["loss"], f"history[{i}].loss")
        f.number(h["grad_norm"], f"history[{i}].grad_norm")
        for k in ("lr", "loss_scale"):
            f.number(h.get(k), f"history[{i}].{k}")


def detected_lag(run: dict[str, Any]) -> int:
    """How many steps ran after the failing step before the recorder saw its failure (``run.json``'s
    ``detected_lag``); 0 for bundles written before checks lagged, which judged every step at its own end.

    Example:
        >>> detected_lag({"detected_lag": 3}), detected_lag({})
        (3, 0)
    """
    return int(run.get("detected_lag", 0))


MAX_WORLD = 1 << 20
"""Most ranks a bundle's run may name (far more than any job; it sizes the processes an incident replay starts)."""


def _check_distributed(f: _File, d: Any) -> None:
    """``run.json``'s ``distributed``: this rank's place in a multi-rank run (``RankInfo.to_json`` + ``incident``)."""
    f.obj(d, "distributed")
    for k in ("rank", "world_size"):  # every reader relies on these two (the recorder always writes them)
        if not isinstance(d.get(k), int) or isinstance(d.get(k), bool):
            raise f.fail(f"distributed.{k}", "is missing or not an integer")
    for k, lo in (("rank", 0), ("world_size", 1), ("local_rank", 0), ("restart", 0)):
        if d.get(k) is not None:
            f.integer(d[k], f"distributed.{k}", lo=lo, hi=MAX_WORLD if k != "restart" else MAX_COUNT)
    for k in ("backend", "incident"):
        if k in d:
            f.string(d[k], f"distributed.{k}", null=True)
    if isinstance(d.get("rank"), int) and isinstance(d.get("world_size"), int) and d["rank"] >= d["world_size"]:
        raise f.fail("distributed.rank", f"is {d['rank']}, not below world_size {d['world_size']}")


def _check_incident(f: _File, doc: Any, field: str) -> None:
    """An incident a rank declared (``failure.json``'s ``detail.incident``)."""
    f.obj(doc, field)
    for k in ("rank", "step"):
        if doc.get(k) is not None:
            f.integer(doc[k], _join(field, k), hi=MAX_COUNT)
    for k in ("incident", "what"):
        if k in doc:
            f.string(doc[k], _join(field, k), null=True)


def _check_tables(f: _File, m: Any) -> None:
    """``run.json``'s ``model``: the lookup tables the batch diagnosis reads (``reprokit.diagnose``)."""
    f.obj(m, "model")
    for key in ("embeddings", "positions"):
        for i, e in enumerate(f.lst(m.get(key, []), f"model.{key}")):
            ef = f"model.{key}[{i}]"
            f.obj(e, ef, ("name", "num_embeddings"))
            f.string(e["name"], f"{ef}.name")
            f.integer(e["num_embeddings"], f"{ef}.num_embeddings")
            if e.get("padding_idx") is not None:
                f.integer(e["padding_idx"], f"{ef}.padding_idx", lo=None)


def _check_provenance(f: _File, p: Any) -> None:
    """``run.json``'s ``provenance``: where a shrunk bundle came from (``reprokit.shrink``), as ``inspect`` reads it."""
    f.obj(p, "provenance")
    for k in ("source_bundle", "source_manifest_sha256"):
        if k in p:
            f.string(p[k], _join("provenance", k), null=True)
    for k in ("replays", "different_failures", "origin_checks", "origin_changed", "confirm_runs"):
        if p.get(k) is not None:
            f.integer(p[k], _join("provenance", k), hi=MAX_COUNT)
    for k in ("origin", "code"):
        if p.get(k) is not None:
            f.obj(p[k], _join("provenance", k))
    if p.get("kept_rows") is not None:
        for i, r in enumerate(f.lst(p["kept_rows"], "provenance.kept_rows")):
            if isinstance(r, list):  # a batch of micro-batches: [micro-batch, row] (reprokit.shrink.micro)
                if len(r) != 2:
                    raise f.fail(f"provenance.kept_rows[{i}]", f"must be a row or [micro-batch, row], got {len(r)} "
                                                               "value(s)")
                for j, x in enumerate(r):
                    f.integer(x, f"provenance.kept_rows[{i}][{j}]")
            else:
                f.integer(r, f"provenance.kept_rows[{i}]")
    if p.get("state_check") is not None:
        check = f.obj(p["state_check"], "provenance.state_check")
        for k in ("verdict", "message", "reason"):
            if k in check:
                f.string(check[k], _join("provenance.state_check", k), null=k != "verdict")
    if "rows_ambiguous" in p:
        f.string(p["rows_ambiguous"], "provenance.rows_ambiguous", null=True)
    if p.get("dataset_indices") is not None:
        f.lst(p["dataset_indices"], "provenance.dataset_indices")
    if p.get("seq_window") is not None:
        w = f.lst(p["seq_window"], "provenance.seq_window")
        if len(w) != 2:
            raise f.fail("provenance.seq_window", f"must be [start, end], got {len(w)} value(s)")
        for i, x in enumerate(w):
            f.integer(x, f"provenance.seq_window[{i}]")
    if p.get("before") is not None:
        for k, v in f.obj(p["before"], "provenance.before").items():
            if v is not None:
                f.integer(v, _join("provenance.before", k))
    if p.get("passes") is not None:
        for name, stats in f.obj(p["passes"], "provenance.passes").items():
            field = _join("provenance.passes", name)
            for k, v in f.obj(stats, field).items():
                f.number(v, _join(field, k), null=False)


def _check_extract(f: _File, x: Any) -> None:
    """``run.json``'s ``extract``: where a ``reprokit extract`` bundle came from (``reprokit.extract``)."""
    f.obj(x, "extract", ("source_bundle", "module", "class", "phase", "op"))
    for k in ("source_bundle", "module", "class", "source_failure", "source_manifest_sha256"):
        if k in x:
            f.string(x[k], _join("extract", k))
    if x["phase"] not in ("forward", "backward"):
        raise f.fail("extract.phase", f"must be \"forward\" or \"backward\", got {str(x['phase'])[:40]!r}")
    f.string(x["op"], "extract.op", null=True)
    if "source_step" in x:
        f.integer(x["source_step"], "extract.source_step")


def check_op(d: Any, keys: set[str] | None, name: str = OP_JSON) -> None:
    """An extract's one-op repro: ``{"op": "aten.NAME.OVERLOAD", "args": [...], "kwargs": {...}}``."""
    f = _File(name)
    f.obj(d, "", ("op", "args", "kwargs"))
    f.string(d["op"], "op")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*){1,2}", d["op"]):
        raise f.fail("op", f"must be an op name like aten.exp.default, got {d['op'][:80]!r}")

    def arg(v: Any, field: str) -> None:
        if isinstance(v, list):
            for i, x in enumerate(v):
                arg(x, f"{field}[{i}]")
        elif isinstance(v, dict):
            if len(v) != 1 or next(iter(v)) not in ("tensor", "float", "dtype", "device"):
                raise f.fail(field, "must be a tensor, float, dtype or device reference")
            (k, ref), = v.items()
            f.string(ref, _join(field, k))
            if k == "tensor" and keys is not None and ref not in keys:
                raise f.fail(_join(field, k), f"names tensor {ref[:80]!r}, which is not in extract/op.safetensors")

    arg(f.lst(d["args"], "args"), "args")
    for k, v in f.obj(d["kwargs"], "kwargs").items():
        arg(v, _join("kwargs", k))


def check_env(d: Any, name: str = ENV) -> None:
    f = _File(name)
    f.obj(d, "", ("python", "torch", "cuda", "devices"))
    f.string(d["python"], "python")
    f.string(d["torch"], "torch")
    f.string(d["cuda"], "cuda", null=True)
    for i, x in enumerate(f.lst(d["devices"], "devices")):
        f.string(x, f"devices[{i}]")
    if d.get("git") is not None:
        git = f.obj(d["git"], "git")
        sub = git.get("code_subdir")
        if sub is not None:
            # Commit bisection replays ``<worktree>/<code_subdir>`` with --code: it must stay inside the worktree.
            f.string(sub, "git.code_subdir")
            if sub.startswith("/") or "\\" in sub or ".." in sub.split("/") or (len(sub) > 1 and sub[1] == ":"):
                raise f.fail("git.code_subdir", f"must be a folder inside the repository (relative, no '..'), "
                                                f"got {sub[:80]!r}")


MAX_COUNT = 2**31 - 1
"""Largest value of a bundle's counters and settings that sizes something (a window, a streak, a patience)."""


def _tensor_refs(v: Any, field: str) -> Iterator[tuple[str, Any]]:
    """``(field, name)`` of every tensor reference in a tree (depth bounded by :data:`MAX_DEPTH`)."""
    if isinstance(v, list):
        for i, x in enumerate(v):
            yield from _tensor_refs(x, f"{field}[{i}]")
    elif isinstance(v, dict):
        if _is_tensor_ref(v):
            (tag, ref), = v.items()
            yield _join(field, tag), ref
            return
        for k, x in v.items():
            yield from _tensor_refs(x, _join(field, k))


def _is_tensor_ref(v: Any) -> bool:
    return isinstance(v, dict) and len(v) == 1 and next(iter(v)) in ("__rk_tensor__", "__rk_ndarray__")


def _check_state_tree(f: _File, st: dict[str, Any]) -> None:
    """The parts of a snapshot's tree (``reprokit.state.capture_state``) that replay hands to torch as they are: their
    shapes, so that a malformed one is refused here rather than failing inside ``load_state_dict``."""
    if not st:  # a rank's bundle that references a state no bundle holds (state/replicated.json says why)
        return
    f.plain(st, "state", ("model", "optimizer"))
    for part, v in st.items():  # the writer names each part's tensors under the part: restore hands them out so
        for field, ref in _tensor_refs(v, _join("state", part)):
            if isinstance(ref, str) and not ref.startswith(f"{part}/"):
                raise f.fail(field, f"names tensor {ref[:200]!r}, which is not one of state.{part}'s (those start "
                                    f"with {part + '/'!r})")
    f.plain(st["model"], "state.model")  # a state_dict: names -> tensors (a module's extra state may be anything)
    opt = f.plain(st["optimizer"], "state.optimizer")
    for i, g in enumerate(f.lst(opt.get("param_groups", []), "state.optimizer.param_groups")):
        gf = f"state.optimizer.param_groups[{i}]"
        f.plain(g, gf)
        for j, x in enumerate(f.lst(g.get("params", []), f"{gf}.params")):
            if isinstance(x, bool) or not isinstance(x, (int, str)):
                raise f.fail(f"{gf}.params[{j}]", f"must be a parameter index, got {type_name(x)}")
    for pf, per in f.mapping(opt.get("state", {}), "state.optimizer.state"):
        for kf, v in f.mapping(per, pf):
            if kf.endswith(".step") and not (_is_tensor_ref(v) or (isinstance(v, (int, float))
                                                                    and not isinstance(v, bool))):
                raise f.fail(kf, f"must be a tensor or a number (an optimizer's step count), got {type_name(v)}")
    for k in ("scheduler", "scaler"):
        if st.get(k) is not None:
            f.plain(st[k], f"state.{k}")
    for k in ("grads", "outside_grads", "shards"):
        if k in st:
            f.mapping(st[k], f"state.{k}")
    if "training" in st:
        f.boolean(st["training"], "state.training")
    if st.get("modes") is not None:
        for k, v in f.plain(st["modes"], "state.modes").items():
            f.boolean(v, _join("state.modes", k))
    if st.get("frozen") is not None:
        for i, x in enumerate(f.lst(st["frozen"], "state.frozen")):
            f.string(x, f"state.frozen[{i}]")
    if "extra" in st:
        f.mapping(st["extra"], "state.extra")


def check_state(d: Any, keys: set[str] | None, name: str = STATE_JSON) -> None:
    f = _File(name)
    f.obj(d, "", ("state", "rng"))
    f.tree(f.obj(d["state"], "state"), "state", keys)
    _check_state_tree(f, d["state"])
    f.rng(d["rng"], "rng", keys)
    if "monitor" in d:
        mon = f.obj(d["monitor"], "monitor")
        for i, x in enumerate(f.lst(mon.get("history", []), "monitor.history")):
            f.number(x, f"monitor.history[{i}]", null=False)
            if isinstance(x, str):
                raise f.fail(f"monitor.history[{i}]", f"must be a finite loss, got {x!r}")
        if "skip_streak" in mon:
            f.integer(mon["skip_streak"], "monitor.skip_streak", hi=MAX_COUNT)
        f.number(mon.get("last_scale"), "monitor.last_scale")
    if "step" in d and d["step"] is not None:
        f.integer(d["step"], "step")


_BUNDLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def check_replicated(d: Any, name: str = REPLICATED) -> None:
    """A reference to another rank's state (:mod:`reprokit.bundle.reference`): the owner bundle is one plain
    folder name beside this bundle (no separators, no ``..``), and the files are that bundle's state files."""
    f = _File(name)
    f.obj(d, "", ("owner", "files"))
    owner = f.obj(d["owner"], "owner", ("rank", "bundle", "step"))
    f.integer(owner["rank"], "owner.rank")
    f.integer(owner["step"], "owner.step")
    f.string(owner["bundle"], "owner.bundle", null=True)
    if owner["bundle"] is not None and (not _BUNDLE_NAME.fullmatch(owner["bundle"]) or owner["bundle"] == ".."):
        raise f.fail("owner.bundle", f"must be a plain folder name beside this bundle, got {owner['bundle'][:80]!r}")
    files = f.obj(d["files"], "files")
    for rel in files:
        if not STATE_FILE.fullmatch(rel):
            raise f.fail(f"files[{rel[:80]!r}]", "must be a state file (state/state.safetensors, state/state-1...)")
    check_manifest_files(files, name)
    if "problem" in d:
        f.string(d["problem"], "problem", null=True)
    if owner["bundle"] is None and not d.get("problem"):
        raise f.fail("problem", "must say why no owner bundle is named")


def check_step(d: Any, step: int | None, keys: set[str] | None, name: str) -> None:
    f = _File(name)
    f.obj(d, "", ("step", "batch", "rng"))
    f.integer(d["step"], "step")
    if step is not None and d["step"] != step:
        raise f.fail("step", f"is {d['step']}, but the file is named for step {step}")
    f.tree(d["batch"], "batch", keys)
    f.rng(d["rng"], "rng", keys)
    f.number(d.get("loss"), "loss")
    f.number(d.get("grad_norm"), "grad_norm")


# --- safetensors --------------------------------------------------------------------------

def safetensors_header(fh: BinaryIO, size: int, name: str) -> tuple[dict[str, Any], int]:
    """``(header, where the data starts)`` of a safetensors file open as ``fh`` (at its start; ``size``
    bytes in all), parsed as strict JSON. Only the header is read (``inspect`` sums tensor sizes from it
    without reading, or importing anything to read, the tensors); :func:`check_safetensors` checks the rest.

    Raises:
        SchemaError: for a header length that does not fit the file, or a header that is not a JSON object.
    """
    f = _File(name)
    head = fh.read(8)
    if len(head) < 8:
        raise f.fail("", f"is {size} bytes, too short for a safetensors file (an 8-byte header length)")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise f.fail("", f"declares a {n}-byte header, but the file holds {size - 8} bytes after the "
                         f"length (and headers are at most {MAX_HEADER_BYTES})")
    return f.obj(parse_header(fh.read(n), name), "header"), 8 + n


def parse_header(raw: bytes, name: str) -> Any:
    """A safetensors header's bytes parsed as strict JSON, once they are known to list at most :data:`MAX_TENSORS`
    tensors (counted on the raw bytes first: parsing a 60 MB header of a million empty tensors took seconds)."""
    listed = raw.count(b'"data_offsets"')
    if listed > MAX_TENSORS:
        raise SchemaError(name, "header", f"lists {listed} tensors; a file holds at most {MAX_TENSORS}")
    return parse_json(raw, f"{name} (header)")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:80] + "..."


def check_safetensors(path: Path, name: str) -> set[str]:
    """Check a safetensors file's header against the file; returns its tensor names.

    The header length must fit the file, the header is strict JSON, each tensor has a known dtype,
    a shape of ints >= 0 whose byte size equals its data range, and the ranges tile the data section
    exactly, in order, without overlap or gaps.
    """
    f = _File(name)
    try:
        with open_regular(path) as fh:  # a FIFO or device swapped in is refused unread (no hang)
            size = os.fstat(fh.fileno()).st_size
            doc, data_start = safetensors_header(fh, size, name)
    except OSError as e:
        raise f.fail("", f"cannot be read: {e.strerror or e}") from None
    return check_header(doc, size - data_start, name)


def check_header(doc: dict[str, Any], data_len: int, name: str) -> set[str]:
    """Check a parsed safetensors header against a data section of ``data_len`` bytes (see
    :func:`check_safetensors`); returns its tensor names. The tensor reader runs it too, on the header of the
    bytes it hashed (:func:`reprokit.bundle.tensorfile.read_verified`)."""
    f = _File(name)
    if len(doc) > MAX_TENSORS + 1:  # + __metadata__
        raise f.fail("header", f"lists {len(doc)} tensors; a file holds at most {MAX_TENSORS}")
    ranges = []
    for key, info in doc.items():
        field = f"header[{key[:80]!r}]"
        if key == "__metadata__":
            for k, v in f.obj(info, field).items():
                f.string(v, f"{field}[{k[:80]!r}]")
            continue
        f.obj(info, field, ("dtype", "shape", "data_offsets"))
        dtype = info["dtype"]
        if dtype not in ITEMSIZE:
            raise f.fail(f"{field}.dtype", f"must be one of {', '.join(ITEMSIZE)}, got {str(dtype)[:40]!r}")
        shape = f.lst(info["shape"], f"{field}.shape")
        if len(shape) > MAX_DIMS:
            raise f.fail(f"{field}.shape", f"has {len(shape)} dimensions; at most {MAX_DIMS} are allowed")
        count, extent = 1, 1
        for i, d in enumerate(shape):
            count *= f.integer(d, f"{field}.shape[{i}]")
            if count > data_len:  # stop before the product of huge dimensions grows past all use (and time)
                raise f.fail(field, f"shape {_short(shape)} of {dtype} needs more bytes than the whole "
                                    f"{data_len}-byte data section holds")
            if d > MAX_DIM:
                raise f.fail(f"{field}.shape[{i}]", f"is {d}; a dimension is at most {MAX_DIM}")
            extent *= max(d, 1)
            if extent > MAX_ELEMENTS:  # also for an empty tensor: no library makes a [0, 2**62] array
                raise f.fail(f"{field}.shape", f"{_short(shape)} spans more than {MAX_ELEMENTS} elements (its "
                                               "non-zero dimensions multiplied); no tensor of it can be made")
        offs = f.lst(info["data_offsets"], f"{field}.data_offsets")
        if len(offs) != 2:
            raise f.fail(f"{field}.data_offsets", f"must be [start, end], got {len(offs)} items")
        start, end = (f.integer(x, f"{field}.data_offsets[{i}]") for i, x in enumerate(offs))
        if not start <= end <= data_len:
            raise f.fail(f"{field}.data_offsets", f"[{start}, {end}] is not a range within the "
                                                  f"{data_len}-byte data section")
        if count * ITEMSIZE[dtype] != end - start:  # Python ints: no overflow
            raise f.fail(field, f"shape {_short(shape)} of {dtype} needs {count * ITEMSIZE[dtype]} bytes, but its "
                                f"data_offsets span {end - start}")
        ranges.append((start, end, key))
    at = 0
    for start, end, key in sorted(ranges):
        if start != at:
            raise f.fail(f"header[{key[:80]!r}].data_offsets",
                         f"starts at {start}, but the previous tensor ends at {at} ("
                         f"{'overlapping' if start < at else 'a gap in the'} data)")
        at = end
    if at != data_len:
        raise f.fail("", f"has {data_len - at} bytes of data no tensor covers")
    return {k for k in doc if k != "__metadata__"}


# --- a whole bundle -----------------------------------------------------------------------

def _state_keys(files: dict[str, Any], keys: dict[str, set[str] | None], skip: set[str],
                problems: list[dict[str, Any]]) -> set[str] | None:
    """The tensor names of all the state's files together (None when one of them could not be read)."""
    parts, missing = state_parts(files)
    if missing is not None:
        problems.append({"file": state_file_name(missing), "problem": f"not in the manifest, which lists "
                         f"{sum(1 for rel in files if STATE_FILE.fullmatch(rel))} other part(s) of the state: "
                         "the state is incomplete"})
        return None
    union: set[str] = set()
    for rel in parts:
        k = keys.get(rel) if rel not in skip else None
        if k is None:
            return None
        twice = union & k
        if twice:
            problems.append({"file": rel, "problem": f"tensor {sorted(twice)[0]!r} is also in another state file"})
        union |= k
    return union


def check_bundle(path: Path, files: dict[str, Any], skip: set[str] = frozenset()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """Problems (``[{"file", "problem"}]``) of every JSON and safetensors file a bundle lists.

    ``files`` is the manifest's table (already checked by :func:`check_manifest_files`); files in
    ``skip`` (missing or altered ones, reported already) are not read.
    """
    problems: list[dict[str, Any]] = []
    keys: dict[str, set[str] | None] = {}
    docs: dict[str, Any] = {}

    def run(rel: str, fn: Any) -> Any:
        try:
            return fn()
        except BundleError as e:
            problems.extend(e.problems or [{"file": rel, "problem": str(e)}])
            return None

    for rel in sorted(files):
        if rel in skip or rel.startswith(f"{CODE}/"):
            continue
        if rel.endswith(".safetensors") and rel.split("/", 1)[0] in (STEPS, "state", "extract"):
            keys[rel] = run(rel, lambda rel=rel: check_safetensors(path / rel, rel))
        elif rel.endswith(".json"):
            # [doc]: a file may hold null. Parsed from the bytes that hash to the manifest's digest.
            docs[rel] = run(rel, lambda rel=rel: [load_listed_json(path, rel, files[rel])])
    checks = {RUN: check_run, FAILURE: check_failure, ENV: check_env}
    for rel, loaded in docs.items():
        if loaded is None:  # not strict JSON: reported already
            continue
        doc = loaded[0]
        tensors = rel.removesuffix(".json") + ".safetensors"
        k = keys.get(tensors) if tensors not in skip else None
        m = STEP_FILE.fullmatch(rel)
        if rel in checks:
            run(rel, lambda rel=rel, doc=doc: checks[rel](doc, rel))
        elif rel == OP_JSON:
            run(rel, lambda doc=doc, k=k: check_op(doc, k))
        elif rel == STATE_JSON:
            # A state referenced from another rank's bundle: its tensor names are known once those files are read
            # (Bundle.state() checks them then).
            k = _state_keys(files, keys, skip, problems) if REPLICATED not in files else None
            run(rel, lambda doc=doc, k=k: check_state(doc, k))
        elif rel == REPLICATED:
            run(rel, lambda doc=doc: check_replicated(doc))
            if any(STATE_FILE.fullmatch(x) for x in files):
                problems.append({"file": rel, "problem": "references another rank's state, but the bundle also lists "
                                                         "state files of its own: ambiguous, refused"})
        elif m:
            run(rel, lambda rel=rel, doc=doc, k=k, m=m: check_step(doc, int(m[1]), k, rel))
    window = (docs.get(RUN) or [None])[0]
    if isinstance(window, dict) and not any(p["file"] == RUN for p in problems):
        for i, s in enumerate(window["window"]["steps"]):
            for ext in ("json", "safetensors"):
                rel = f"{STEPS}/{step_name(s)}.{ext}"
                if rel not in files:
                    problems.append({"file": RUN, "problem": f"window.steps[{i}] is step {s}, but the "
                                                                    f"manifest lists no {rel}"})
        failure = (docs.get(FAILURE) or [None])[0]
        if isinstance(failure, dict) and not any(p["file"] == FAILURE for p in problems):
            problems += [{"file": rel, "problem": why} for rel, why in uncheckable(window, failure)]
    return problems


def uncheckable(run: dict[str, Any], failure: dict[str, Any]) -> list[tuple[str, str]]:
    """``(file, why)`` for each reason a replay of this bundle could never fail the recorded way: a test that cannot
    fail would be reported as fixed. ``run`` and ``failure`` have passed :func:`check_run` / :func:`check_failure`.

    The recorder never writes these (its window always holds the step that failed, its detectors fired): they come
    from an edit, re-signed. A ``peer`` bundle (a rank that did not fail itself) is exempt from the window rule: its
    window is what that rank had recorded, and replay refuses it alone anyway.
    """
    steps, kind, step = run["window"]["steps"], failure["kind"], failure["step"]
    out = []
    if not steps:
        out.append(("run.json", "window.steps is empty: a replay would run no step, and nothing can fail in no step "
                                "(a test that cannot fail is never \"fixed\")"))
    elif kind != FailureKind.PEER and step not in steps:
        out.append(("run.json", f"window.steps {_steps_text(steps)} does not hold step {step}, where failure.json says "
                                "the run failed: a replay would never reach the failure (a test that cannot fail is "
                                "never \"fixed\")"))
    if kind == FailureKind.LOSS_SPIKE and run["recorder"]["detect"].get("spike_factor") is None:
        out.append(("run.json", "recorder.detect.spike_factor is null, but failure.json's kind is loss_spike: replay "
                                "could not check the recorded failure"))
    if kind == FailureKind.PREDICATE and not run["refs"].get("predicates"):
        out.append(("run.json", "refs.predicates is empty, but failure.json's kind is predicate: replay could not "
                                "check the recorded failure"))
    return out


def _steps_text(steps: list[int]) -> str:
    return str(steps) if len(steps) <= 6 else f"[{steps[0]}, ..., {steps[-1]}] ({len(steps)} steps)"
