"""Fuzzing what reads bundles from strangers: open / verify / inspect, and opening packed archives.

Seeds are a real recorded bundle (the tiny MLP whose loss goes NaN that the suite shares:
``shared_nan_bundle`` in conftest.py) and its packed ``.tar.gz``, made once per module. Hypothesis
mutates them: byte flips and truncations (checksums left as they are, or recomputed as a careless
tool would, so that the schema checks run and not only the checksums), JSON edits with the manifest
re-signed, safetensors header edits, files removed, added, replaced by folders or links; for
archives also flipped and truncated gzip streams, edited tar headers with their checksums fixed,
and rebuilt tarballs with hostile members (``..`` and absolute names, links, devices, FIFOs,
duplicates, lying sizes, pax records, extra bundles).

The property, for every input:

- only documented errors escape: :class:`reprokit.errors.ReprokitError` from the library, the
  documented exit codes from the CLI (``inspect`` 0/3, ``verify`` 0/1/3), and one JSON object on
  stdout with ``--json``; a bundle that ``verify`` finds clean must open and inspect;
- nothing is written outside the temporary folder that extraction uses (an audit hook watches every
  ``open`` for writing and every ``os``/``shutil``/``tempfile`` call that creates, renames, removes or
  changes a file, and refuses the ones elsewhere: writing into the bundle under test counts too),
  and that folder is empty again afterwards;
- each input is answered within ``BOUND_S`` seconds (a timer interrupts a hang).

CI runs a few hundred inputs (about 10 s). The long run:

    REPROKIT_FUZZ_EXAMPLES=20000 python -m pytest -q -s tests/integration/test_fuzz.py

(the count is per test; ``-s`` shows the tally line: inputs tried and how many escaped).
"""

from __future__ import annotations

import gc
import gzip
import io
import json
import os
import random
import re
import shutil
import signal
import struct
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reprokit import archive
from reprokit import bundle as B
from reprokit.cli import main
from reprokit.errors import ReprokitError
from reprokit.pack import pack
from reprokit.report import describe

LONG_RUN = int(os.environ.get("REPROKIT_FUZZ_EXAMPLES", "0"))
EXAMPLES = {"bundle": LONG_RUN or 200, "archive": LONG_RUN or 100}
BOUND_S = 10.0
"""Most seconds one input may take (every target together); generous for a loaded 2-core CI box."""



def fuzz_settings(kind: str) -> settings:
    return settings(max_examples=EXAMPLES[kind], deadline=None, database=None, derandomize=not LONG_RUN,
                    print_blob=True, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


TALLY = {"inputs": 0, "escaped": 0}
OUTCOMES: dict[str, int] = {}
"""How the inputs were answered (clean, or the kind of the first problem): shows which checks the fuzzer reached."""


def _outcome(problems: list[dict] | None, exit_code: int) -> None:
    if not problems:
        key = "clean" if exit_code == 0 else f"exit {exit_code}"
    else:
        text = str(problems[0].get("problem", ""))
        if "checksum mismatch" in text or "size mismatch" in text or "self_sha256" in text:
            key = "checksum"
        elif text.startswith(("missing", "unexpected file")):
            key = "missing/unexpected file"
        elif any(w in text for w in ("tar", "gzip", "archive", "extraction", "not allowed", "path", "name",
                                     "pax", "member", "bundles")):
            key = "archive/member"
        else:
            key = "schema"
    OUTCOMES[key] = OUTCOMES.get(key, 0) + 1


# --- the write guard: an audit hook, installed once per process, switched on around each input ----

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_ONE_PATH = {"os.mkdir", "os.remove", "os.rmdir", "os.truncate", "os.chmod", "os.chown", "os.utime", "os.mkfifo",
             "os.mknod", "shutil.rmtree", "tempfile.mkstemp", "tempfile.mkdtemp", "os.chflags", "os.lchmod"}
_TWO_PATHS = {"os.rename", "os.replace", "os.link", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
              "shutil.copytree", "shutil.move"}


class WriteOutside(PermissionError):
    """Raised by the guard instead of letting a write outside the allowed folder happen."""


class _Guard:
    root: str | None = None  # writes allowed under this folder while set; None: guard off
    violations: list[str] = []
    installed = False


_DIR_FD_LAST = {"os.mkdir", "os.remove", "os.rmdir", "os.chmod", "os.chown", "os.utime", "os.mkfifo", "os.mknod"}


def _paths(event: str, args: tuple) -> list[tuple[Any, Any]]:
    """``(path, dir_fd)`` of everything ``event`` would create, change or remove."""
    if event == "open":
        path, _mode, flags = args
        return [(path, None)] if isinstance(flags, int) and flags & _WRITE_FLAGS else []
    if event in _ONE_PATH:
        return [(args[0], args[-1] if event in _DIR_FD_LAST else None)]
    if event in ("os.rename", "os.replace"):
        return [(args[0], args[2]), (args[1], args[3])]
    if event in _TWO_PATHS:
        return [(args[0], None), (args[1], None)]
    if event == "os.symlink":
        return [(args[1], args[2])]  # the link; its target is only a string
    return []


def _full(path: Any, dir_fd: Any) -> str:
    name = os.fsdecode(path)
    if isinstance(dir_fd, int) and not os.path.isabs(name):  # shutil.rmtree removes relative to folder fds
        name = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
    return os.path.realpath(name)


def _audit(event: str, args: tuple) -> None:
    root = _Guard.root
    if root is None:
        return
    for p, dir_fd in _paths(event, args):
        if p is None or isinstance(p, int):
            continue  # a file descriptor: its open was checked
        full = _full(p, dir_fd)
        if full != root and not full.startswith(root + os.sep):
            _Guard.violations.append(f"{event} {full}")
            raise WriteOutside(f"fuzz guard: {event} outside {root}: {full}")


def _install_guard() -> None:
    if not _Guard.installed:  # audit hooks cannot be removed: one per process, switched by _Guard.root
        sys.addaudithook(_audit)
        _Guard.installed = True


class _Timeout(BaseException):
    """Not an Exception: library code that catches Exception must not swallow it."""


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout(f"an input took more than {BOUND_S} s")


@pytest.fixture(autouse=True)
def _no_garbage_of_earlier_tests() -> None:
    """Collect what earlier tests in this process left unreachable before any guard is on: a replay session one of
    them dropped removes its code copy (outside this test's scratch) whenever the garbage collector gets to it, which
    could be inside a guarded input, as a write outside that is neither this input's nor reprokit's doing here."""
    gc.collect()


def guarded(scratch: Path, fn: Callable[[], None]) -> None:
    """Run ``fn`` with writes allowed only under ``scratch`` (also the temp dir), within BOUND_S seconds;
    afterwards ``scratch`` must be empty again (extraction folders removed)."""
    _install_guard()
    scratch.mkdir(exist_ok=True)
    old_tmp, old_bytecode = tempfile.tempdir, sys.dont_write_bytecode
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    tempfile.tempdir = str(scratch)
    sys.dont_write_bytecode = True  # a late import writing a .pyc is python's doing, not reprokit's
    _Guard.violations = []
    TALLY["inputs"] += 1
    t0 = time.perf_counter()
    try:
        _Guard.root = os.path.realpath(scratch)
        signal.setitimer(signal.ITIMER_REAL, BOUND_S)
        fn()
    except BaseException:
        TALLY["escaped"] += 1
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _Guard.root = None
        signal.signal(signal.SIGALRM, old_handler)
        tempfile.tempdir, sys.dont_write_bytecode = old_tmp, old_bytecode
    elapsed = time.perf_counter() - t0
    left = sorted(p.name for p in scratch.iterdir())
    if _Guard.violations or left or elapsed > BOUND_S:
        TALLY["escaped"] += 1
    assert not _Guard.violations, f"writes outside the temp dir: {_Guard.violations}"
    assert not left, f"left behind in the temp dir: {left}"
    assert elapsed <= BOUND_S, f"took {elapsed:.1f} s"


# --- the targets ------------------------------------------------------------------------------

def library(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when it raised a documented error; anything else propagates (an escape)."""
    try:
        return fn()
    except ReprokitError:
        return None


def cli(args: list[str], allowed: set[int]) -> tuple[int, dict]:
    r = CliRunner().invoke(main, [*args, "--json"])
    assert isinstance(r.exception, SystemExit) or r.exception is None, repr(r.exception)
    assert r.exit_code in allowed, (args, r.exit_code, r.output[-2000:])
    doc = json.loads(r.stdout)  # exactly one JSON object on stdout, also on failure
    assert isinstance(doc, dict), r.stdout[:500]
    return r.exit_code, doc


def read_everything(path: Path) -> None:
    """What replay reads before it imports any code, and what inspect shows."""
    b = B.open_bundle(path)
    b.state()
    for k in b.steps:
        b.step(k)
    b.failure.describe()
    describe(b)


def check_folder(path: Path) -> None:
    problems = library(lambda: B.verify(path))
    opened = library(lambda: read_everything(path) or True)
    inspect_code, _ = cli(["inspect", str(path)], {0, 3})
    verify_code, doc = cli(["verify", str(path)], {0, 1, 3})
    _outcome(doc.get("problems") or (doc.get("error") or {}).get("problems"), verify_code)
    if problems == []:  # clean by verify: every reader must take it
        assert opened and inspect_code == 0 and verify_code == 0 and doc["ok"], (opened, inspect_code, doc)
    else:
        assert not (verify_code == 0), doc


def check_archive(tar: Path) -> None:
    def open_it() -> bool:
        with archive.bundle_dir(tar) as d:
            read_everything(d)
        return True

    scanned = archive.scan(tar, archive.Limits())
    assert isinstance(scanned, list)
    opened = library(open_it)
    inspect_code, _ = cli(["inspect", str(tar)], {0, 3})
    verify_code, doc = cli(["verify", str(tar)], {0, 1, 3})
    _outcome(doc.get("problems") or (doc.get("error") or {}).get("problems"), verify_code)
    if verify_code == 0:
        assert opened and inspect_code == 0, (opened, inspect_code)


# --- seeds ------------------------------------------------------------------------------------

class Seeds(dict):
    def __repr__(self) -> str:  # short: Hypothesis prints the arguments of a failing example
        return f"Seeds({self['bundle']})"

    __init__ = dict.__init__


@pytest.fixture(scope="module")
def seeds(shared_nan_bundle, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("fuzz")
    bundle = shared_nan_bundle
    tar = pack(bundle, root / "repro.tar.gz").output
    (root / "repro.tar.gz.sha256").unlink()  # a mutated archive would fail its digest before anything else
    with gzip.open(tar, "rb") as f:
        raw = f.read()
    plain = io.BytesIO()  # the bundle folder alone, tarred by hand (no pack manifest)
    with tarfile.open(fileobj=plain, mode="w", format=tarfile.GNU_FORMAT) as tf:
        tf.add(bundle, arcname=bundle.name)
    # Warm up every target on the valid seeds: lazy imports happen here, not under the guard.
    for target, arg in ((check_folder, bundle), (check_archive, tar)):
        guarded(root / "scratch", lambda t=target, a=arg: t(a))  # type: ignore[misc]
    TALLY["inputs"] = TALLY["escaped"] = 0
    OUTCOMES.clear()
    yield Seeds(root=root, bundle=bundle, tar=tar, raw=raw, plain=plain.getvalue())
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    answers = ", ".join(f"{k} {v}" for k, v in sorted(OUTCOMES.items(), key=lambda kv: -kv[1]))
    line = f"fuzz: {TALLY['inputs']} inputs tried, {TALLY['escaped']} escaped (answers: {answers})"
    print(line)
    if reporter is not None:
        reporter.write_line(line)


_counter = [0]


def workdir(seeds: dict) -> Path:
    _counter[0] += 1
    d = seeds["root"] / f"case{_counter[0]}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    return d


# --- bundle mutations -------------------------------------------------------------------------

SPECIAL_STRINGS = ["", "nan", "inf", "-inf", "../../etc/passwd", "/etc/passwd", "os:system", "code/../x.py",
                   "__rk_tensor__", "\x00", "é" * 3, "x" * 5000]
JSON_LEAVES = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(SPECIAL_STRINGS))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                              max_size=3), max_leaves=8)
RAW_TOKENS = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "true", "null", '"x"', "-1", "0", "1e308",
              "123456789012345678901234567890", "0.5", "[]", "{}", '"' + "y" * (1 << 21) + '"',
              "[" * 300 + "]" * 300, "[" * 100_000 + "]" * 100_000]


class Picks:
    """The choices of one mutation. What it picks depends on the files it finds, but what Hypothesis draws must
    not (it replays and shrinks draws): positions and indices come from a seeded generator, the values written
    (edge-case JSON, text) from Hypothesis's strategies, taken in turn."""

    def __init__(self, seed: int, values: list[Any], texts: list[str]):
        # Hypothesis repeats simple draws (seed 0...) often: the values drawn beside the seed vary the stream too.
        self._seed, self._rng = seed, random.Random(f"{seed}|{values!r}|{texts!r}")
        self._values, self._texts = values, texts
        self._v = self._t = 0

    def __repr__(self) -> str:  # short: Hypothesis prints the failing example
        return f"Picks({self._seed}, {repr(self._values)[:300]}, {self._texts!r})"

    def int(self, lo: int, hi: int) -> int:
        # Edges (first, last) as often as the rest: most parsers break there.
        r = self._rng.random()
        return lo if r < 0.1 else hi if r < 0.2 else self._rng.randint(lo, hi)

    def choice(self, seq: list) -> Any:
        return seq[self._rng.randrange(len(seq))]

    def value(self) -> Any:
        self._v += 1
        return self._values[(self._v - 1) % len(self._values)]

    def text(self) -> str:
        self._t += 1
        return self._texts[(self._t - 1) % len(self._texts)]


PICKS = st.builds(Picks, st.integers(0, 2**32 - 1), st.lists(JSON_VALUES, min_size=3, max_size=3),
                  st.lists(st.text(max_size=8), min_size=3, max_size=3))


def reseal(bundle: Path) -> None:
    """Recompute every checksum the manifest lists and its self digest, as a careless tool would.

    Tolerant of a manifest the fuzzer broke: what cannot be recomputed is left as it is.
    """
    mpath = bundle / B.MANIFEST
    if mpath.is_symlink() or not mpath.is_file():  # a link to /dev/zero is for reprokit to refuse, not to read here
        return
    try:
        m = json.loads(mpath.read_text())
    except (ValueError, OSError, RecursionError):
        return
    if not isinstance(m, dict):
        return
    files = m.get("files")
    if isinstance(files, dict):
        for rel, meta in files.items():
            p = bundle / rel
            try:  # a fuzzed name may be too long for the file system (ENAMETOOLONG): reprokit's to refuse, not ours
                if isinstance(meta, dict) and p.is_file() and not p.is_symlink():
                    meta["sha256"], meta["size"] = B.sha256_file(p), p.stat().st_size
            except OSError:
                continue
    try:
        m["self_sha256"] = B._self_digest(m)
        (bundle / B.MANIFEST).write_text(json.dumps(m))
    except (TypeError, ValueError, RecursionError):
        pass


def _walk_to(doc: Any, pk: Picks) -> tuple[Any, Any] | None:
    """A (container, key) pair somewhere in ``doc``, chosen by the fuzzer."""
    parent, key = None, None
    node = doc
    while isinstance(node, (dict, list)) and node and pk.int(0, 3) > 0:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        k = keys[pk.int(0, len(keys) - 1)]
        parent, key, node = node, k, node[k]
    return (parent, key) if parent is not None else None


def mutate_json(path: Path, pk: Picks) -> None:
    try:
        doc = json.loads(path.read_text())
    except (ValueError, OSError, UnicodeDecodeError, RecursionError):
        return
    op = pk.choice(["set", "delete", "insert", "replace_root", "raw_token", "duplicate_key"])
    if op == "raw_token":  # text-level: a number or literal JSON cannot express through json.dumps
        text = json.dumps(doc)
        spots = [m.start() for m in re.finditer(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null|\"[^\"]*\"", text)]
        if spots:
            at = spots[pk.int(0, len(spots) - 1)]
            m = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?|true|false|null|\"[^\"]*\"").match(text, at)
            assert m is not None
            text = text[:at] + pk.choice(RAW_TOKENS) + text[m.end():]
        path.write_text(text)
        return
    if op == "duplicate_key":
        text = json.dumps(doc)
        if text.startswith("{") and len(text) > 2:
            first = text[1:].split(",", 1)[0].rstrip("}")
            text = "{" + first + "," + text[1:]
        path.write_text(text)
        return
    if op == "replace_root":
        doc = pk.value()
    else:
        where = _walk_to(doc, pk)
        if where is not None:
            parent, key = where
            if op == "set":
                parent[key] = pk.value()
            elif op == "delete":
                del parent[key]
            elif isinstance(parent, dict):
                parent[pk.text()] = pk.value()
            else:
                parent.insert(key, pk.value())
    path.write_text(json.dumps(doc, allow_nan=True))


def mutate_safetensors(path: Path, pk: Picks) -> None:
    blob = path.read_bytes()
    if len(blob) < 8:
        return
    (n,) = struct.unpack("<Q", blob[:8])
    try:
        header = json.loads(blob[8:8 + n])
    except ValueError:
        return
    body = blob[8 + n:]
    op = pk.choice(["length", "dtype", "shape", "offsets", "entry", "drop"])
    names = [k for k in header if k != "__metadata__"] or ["t"]
    name = names[pk.int(0, len(names) - 1)]
    entry = header.get(name) if isinstance(header.get(name), dict) else {}
    if op == "length":
        n = pk.choice([0, 1, n - 1, n + 1, len(blob), 2**63, 2**64 - 1, pk.int(0, 2**64 - 1)])
        path.write_bytes(struct.pack("<Q", n) + blob[8:])
        return
    if op == "dtype":
        entry["dtype"] = pk.choice(["F32", "F64", "BF16", "I8", "BOOL", "X", "", "F4", None, 3])
    elif op == "shape":
        entry["shape"] = pk.choice([[], [0], [-1], [2**62, 2**62], [1.5], ["2"], None,
                                    [pk.int(-2, 2**40) for _ in range(pk.int(0, 4))]])
    elif op == "offsets":
        entry["data_offsets"] = [pk.choice([pk.int(-5, len(body) + 5), pk.int(-5, len(body) + 5), 2**64, 1.0])
                                 for _ in range(pk.int(0, 3))]
    elif op == "entry":
        entry = pk.value()
    else:
        header.pop(name, None)
        entry = None
    if entry is not None:
        header[name] = entry
    text = json.dumps(header, allow_nan=True).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def mutate_bundle(bundle: Path, pk: Picks) -> None:
    files = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file() and not p.is_symlink())
    if not files:
        return
    # Mostly edits that keep the file set (so that, re-signed, they reach the schema checks).
    op = pk.choice(["json"] * 6 + ["safetensors"] * 2 + ["flip", "flip", "truncate", "remove", "extra", "dir",
                                                         "symlink", "empty_bundle"])
    suffix = {"json": ".json", "safetensors": ".safetensors"}.get(op, "")
    rel = pk.choice([f for f in files if f.endswith(suffix)] or files)
    p = bundle / rel
    if op == "flip":
        blob = bytearray(p.read_bytes())
        if blob:
            i = pk.int(0, len(blob) - 1)
            blob[i] ^= pk.int(1, 255)
        p.write_bytes(bytes(blob))
    elif op == "truncate":
        blob = p.read_bytes()
        p.write_bytes(blob[:pk.int(0, max(0, len(blob) - 1))])
    elif op == "json" and rel.endswith(".json"):
        mutate_json(p, pk)
    elif op == "safetensors" and rel.endswith(".safetensors"):
        mutate_safetensors(p, pk)
    elif op == "remove":
        p.unlink()
    elif op == "extra":
        extra = bundle / pk.choice(["steps/00000009.json", "extra.bin", "state/x", "code/os.py", ".hidden"])
        extra.write_bytes(b"{}")
    elif op == "dir":
        p.unlink()
        p.mkdir()
    elif op == "symlink":
        p.unlink()
        p.symlink_to(pk.choice(["/etc/hostname", "/dev/zero", "../manifest.json", str(p), "nowhere"]))
    elif op == "empty_bundle":
        for child in bundle.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


@given(plan=st.lists(st.tuples(PICKS, st.sampled_from([True, True, True, True, False])), min_size=1, max_size=3))
@fuzz_settings("bundle")
@pytest.mark.slow
def test_fuzzed_bundle_folders_get_documented_answers_only(seeds, plan):
    case = workdir(seeds)
    bundle = Path(shutil.copytree(seeds["bundle"], case / seeds["bundle"].name, symlinks=True))
    for pk, reseal_it in plan:
        if not any(bundle.iterdir()):
            break
        mutate_bundle(bundle, pk)
        if reseal_it:  # mostly re-signed: the schema checks must hold, not only the checksums
            reseal(bundle)
    guarded(case / "scratch", lambda: check_folder(bundle))
    shutil.rmtree(case, ignore_errors=True)


# --- archive mutations ------------------------------------------------------------------------

def _fix_checksums(raw: bytearray, offsets: list[int]) -> None:
    for off in offsets:
        block = raw[off:off + 512]
        if len(block) < 512 or block.count(0) == 512:
            continue
        block[148:156] = b" " * 8
        raw[off + 148:off + 156] = b"%06o\0 " % sum(block)


def _header_offsets(raw: bytes) -> list[int]:
    out = set()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        for m in tf.getmembers():
            out.update((m.offset, m.offset_data - 512))
    return sorted(out)


HOSTILE_NAMES = ["../evil", "/abs/evil", "a/../../b", "x\\y", "C:/win", "", ".", "./", "x" * 300, "é/ü",
                 "bundle-x/MANIFEST.JSON", "two/bundle/manifest.json"]


def rebuild(raw: bytes, data: st.DataObject) -> bytes:
    """The tarball rebuilt by tarfile with one member made hostile (or added, or dropped)."""
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        members = [(m, tf.extractfile(m).read() if m.isfile() else b"") for m in tf.getmembers()]  # type: ignore
    i = data.draw(st.integers(0, len(members) - 1), label="member")
    m, blob = members[i]
    op = data.draw(st.sampled_from(["name", "type", "size", "mode", "pax", "add", "drop", "content", "dup"]),
                   label="member op")
    if op == "name":
        m.name = data.draw(st.sampled_from(HOSTILE_NAMES + [members[-1][0].name.upper()]))
    elif op == "type":
        m.type = data.draw(st.sampled_from([tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE,
                                            tarfile.FIFOTYPE, tarfile.CONTTYPE, b"V", b"S", b"g", b"Z"]))
        m.linkname = data.draw(st.sampled_from(["/etc/passwd", "../../x", members[0][0].name, ""]))
    elif op == "size":
        m.size = data.draw(st.sampled_from([0, max(0, m.size - 1), m.size + 1, m.size + 512, 2**33]))
        blob = (blob + b"\0" * (m.size - len(blob)))[:m.size] if m.size < 1 << 20 else blob
    elif op == "mode":
        m.mode = data.draw(st.sampled_from([0o4755, 0o7777, 0, 0o777]))
    elif op == "pax":
        m.pax_headers = {data.draw(st.sampled_from(["path", "linkpath", "size", "mtime", "GNU.sparse.map", "x"])):
                         data.draw(st.sampled_from(["../evil", "abc", "-1", "99999999999999999999", "", "\n"]))}
    elif op == "add":
        extra = tarfile.TarInfo(data.draw(st.sampled_from(HOSTILE_NAMES + ["repro-0/extra.py", "z/manifest.json"])))
        extra.size = 2
        members.append((extra, b"{}"))
    elif op == "drop":
        members.pop(i)
    elif op == "content" and m.isfile():
        blob = data.draw(st.binary(max_size=64)) + blob[64:]
        m.size = len(blob)
    elif op == "dup":
        members.append((m, blob))
    fmt = data.draw(st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for info, content in members:
            try:
                tf.addfile(info, io.BytesIO(content) if info.isfile() and len(content) >= info.size else None)
            except (ValueError, tarfile.TarError, OSError):
                pass  # tarfile will not write this member: the hand-made header blocks of "insert" go further
    return out.getvalue()


def mutate_archive(seeds: dict, data: st.DataObject) -> bytes:
    raw = seeds[data.draw(st.sampled_from(["raw", "plain"]), label="seed")]
    op = data.draw(st.sampled_from(["gz_flip", "gz_truncate", "tar_flip", "tar_flip", "header_edit", "rebuild",
                                    "rebuild", "rebuild", "tail", "insert"]), label="archive op")
    if op in ("gz_flip", "gz_truncate"):
        gz = bytearray(gzip.compress(raw, mtime=0))
        if op == "gz_flip":
            gz[data.draw(st.integers(0, len(gz) - 1))] ^= data.draw(st.integers(1, 255))
            return bytes(gz)
        return bytes(gz[:data.draw(st.integers(0, len(gz) - 1))])
    tar = bytearray(raw)
    offsets = _header_offsets(raw)
    if op == "tar_flip":
        for _ in range(data.draw(st.integers(1, 4))):
            tar[data.draw(st.integers(0, len(tar) - 1))] ^= data.draw(st.integers(1, 255))
        if data.draw(st.booleans()):
            _fix_checksums(tar, offsets)
    elif op == "header_edit":  # one field of one header rewritten, checksum fixed: past the checksum check
        off = offsets[data.draw(st.integers(0, len(offsets) - 1))]
        start, length = data.draw(st.sampled_from([(0, 100), (100, 8), (124, 12), (156, 1), (157, 100), (257, 8),
                                                   (345, 155)]))
        value = data.draw(st.sampled_from([b"", b"../../x", b"77777777777", b"\x80" + b"\xff" * 11, b"\xff" * 12,
                                           b"-1", b"abc", b"2", b"x", b"ustar\x0000", b"/etc/passwd"])
                          | st.binary(max_size=length))
        tar[off + start:off + start + length] = value[:length].ljust(length, b"\0")
        _fix_checksums(tar, [off])
    elif op == "rebuild":
        return gzip.compress(rebuild(raw, data), mtime=0)
    elif op == "tail":
        tar += data.draw(st.sampled_from([b"garbage", b"\0" * 512 + b"x", b"\0" * 10240]))
    elif op == "insert":  # a hand-made header block (pax/long name with a big or lying size) spliced in
        typ = data.draw(st.sampled_from([b"x", b"L", b"K", b"g", b"S", b"0", b"5"]))
        size = data.draw(st.sampled_from([0, 10, 512, 70_000, 10**9, 2**40]))
        block = bytearray(b"\0" * 512)
        block[0:5] = b"fuzzy"
        block[100:108] = b"0000644\0"
        block[124:136] = b"%011o\0" % size if size < 8**11 else b"\x80" + size.to_bytes(11, "big")
        block[156:157] = typ
        block[257:263] = b"ustar\0"
        _fix_checksums(block, [0])
        payload = data.draw(st.sampled_from([b"", b"30 path=../../../../etc/x\n", b"9 size=-1\n", b"99999 path=x\n",
                                             b"1" * 600])) + b"\0"
        payload = payload.ljust(-(-len(payload) // 512) * 512, b"\0")
        at = offsets[data.draw(st.integers(0, len(offsets) - 1))]
        tar[at:at] = bytes(block) + payload
    return gzip.compress(bytes(tar), mtime=0)


@given(data=st.data())
@fuzz_settings("archive")
@pytest.mark.slow
def test_fuzzed_archives_get_documented_answers_only(seeds, data):
    case = workdir(seeds)
    tar = case / "repro.tar.gz"
    tar.write_bytes(mutate_archive(seeds, data))
    sidecar = data.draw(st.sampled_from([None, None, None, "right", "wrong", "huge", "junk"]), label="sidecar")
    if sidecar is not None:
        text = {"right": B.sha256_file(tar) + "  repro.tar.gz\n", "wrong": "0" * 64 + "\n", "huge": "a" * 10_000,
                "junk": "\xff\xfe not hex"}[sidecar]
        (case / "repro.tar.gz.sha256").write_text(text)
    guarded(case / "scratch", lambda: check_archive(tar))
    shutil.rmtree(case, ignore_errors=True)


def test_the_guard_catches_a_write_outside_a_leftover_and_a_hang(tmp_path, monkeypatch):
    """The harness itself can fail: a write outside the temp dir, a leftover extraction folder and a hang."""
    monkeypatch.setattr(sys.modules[__name__], "BOUND_S", 0.5)
    outside = tmp_path / "outside.txt"
    before = dict(TALLY)
    with pytest.raises(WriteOutside):
        guarded(tmp_path / "scratch", lambda: outside.write_text("x"))
    assert not outside.exists(), "the guard refused the write"
    with pytest.raises(AssertionError, match="left behind"):
        guarded(tmp_path / "scratch2", lambda: Path(tempfile.mkdtemp(prefix="reprokit-open-")))
    with pytest.raises(_Timeout):
        guarded(tmp_path / "scratch3", lambda: time.sleep(5))

    def inside() -> None:
        (Path(tempfile.gettempdir()) / "ok").write_text("x")
        (Path(tempfile.gettempdir()) / "ok").unlink()

    guarded(tmp_path / "scratch4", inside)  # a write inside the temp dir, cleaned up, passes
    TALLY.update(before)
