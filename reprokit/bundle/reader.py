"""Read and verify bundles: :func:`verify` lists every problem of a bundle folder, :func:`open_bundle` verifies one
and opens it, and :class:`Bundle` reads its parts.

``manifest.json`` is written last and lists every file with its sha256 and size; a reader verifies all of them
before it loads anything, holds every JSON file and safetensors header to its schema, and never unpickles anything.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprokit import generated
from reprokit._version import __version__
from reprokit.bundle import reference, schema
from reprokit.bundle.hashing import _self_digest, open_regular, sha256_many
from reprokit.bundle.layout import (
    CODE,
    ENV,
    FAILURE,
    FORMAT,
    INCIDENT_PREFIX,
    LAYOUT,
    LEGACY_KEYS,
    MANIFEST,
    MANIFEST_KEYS,
    RANK_SUFFIX,
    REPLICATED,
    RUN,
    STATE_JSON,
    STATE_TENSORS,
    STEPS,
    VERSION,
    is_incident,
    state_files,
    step_name,
)
from reprokit.errors import DAMAGED_BUNDLE_ADVICE, BundleError, BundleVersionError
from reprokit.signature import Failure
from reprokit.text import one_line

if TYPE_CHECKING:
    import torch

# torch and reprokit.bundle.tensorfile (whose dtype table needs torch) are imported only by the methods that read
# tensors: opening and verifying a bundle (inspect) must not pay torch's import, and importing this package (the
# command line's archive options do, through reprokit.archive) must not pay numpy's either.

MAX_TOTAL_JSON_BYTES = 512 << 20
"""Most bytes of JSON (outside code/) one bundle may list: with schema's per-file cap, depth and string
limits, this bounds the time and memory any command spends parsing a bundle's metadata."""

# Upgrades take a bundle's parsed JSON files ({"run.json": {...}, ...}) from
# version v to v + 1. Version 2 split large states over several files (STATE_TENSORS,
# state/state-1.safetensors, ...); its JSON files are those of version 1, and a version 1
# bundle is one whose state is one file. An older reprokit refuses version 2 by its number
# instead of loading the first part of a state.
UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: lambda docs: docs}


def part_sizes(files: dict[str, Any]) -> dict[str, int]:
    """Bytes per part of the files a manifest lists (``state``, ``batches``: steps/, ``code``, ``metadata``)."""
    out = {"state": 0, "batches": 0, "code": 0, "metadata": 0}
    names = {"state": "state", STEPS: "batches", CODE: "code"}
    for rel, meta in files.items():
        out[names.get(rel.split("/", 1)[0], "metadata")] += int(meta["size"])
    return out


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

    digests = sha256_many([path / rel for rel in listed if plain(rel)
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
        try:
            ref = schema.load_listed_json(path, REPLICATED, listed[REPLICATED])
        except BundleError as e:  # swapped since it was checked above
            return manifest, problems + e.problems
        problems += [{k: v for k, v in x.items() if k != "status"}
                     for x in reference.check(path, ref, hash_tensors=hash_tensors) if x["status"] != "ok"]
    return manifest, problems


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
            with open_regular(path / rel) as f:
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
            f"up to {VERSION}. Upgrade reprokit (in your clone: git pull && pip install -e .) to open it."
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
                with open_regular(self.path / rel) as f:
                    data = f.read(meta["size"] + 1)  # one byte more: a longer file shows as a size mismatch
            except OSError as e:
                raise BundleError(f"{self.path}: {rel} cannot be read ({e.strerror or e}). {DAMAGED_BUNDLE_ADVICE}",
                                  [{"file": rel, "problem": f"cannot be read: {e.strerror or e}"}]) from None
            found = hashlib.sha256(data).hexdigest()
            if len(data) != meta["size"] or found != meta["sha256"]:
                raise BundleError(f"{self.path}: {rel} changed since the manifest was checked (sha256 {found}, the "
                                  f"manifest says {meta['sha256']}); refusing to import it. {DAMAGED_BUNDLE_ADVICE}",
                                  [{"file": rel, "problem": "checksum mismatch", "expected": meta["sha256"],
                                    "found": found}])
            out[rel] = data
        return out

    def state(self, on_part: Callable[[dict[str, torch.Tensor]], None] | None = None
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(tree, tensors)`` of the snapshot the window starts from (a state another rank's bundle holds, for a bundle
        that references it: see :mod:`reprokit.bundle.reference`).

        ``on_part(tensors)`` is called with each state file's tensors as soon as that file is read and verified (on
        the reading thread, while other files may still be read; on this thread for a state in one file), never
        with a file that failed its check; an exception it raises propagates. Replay starts copying the tensors to
        the GPU there. Not called for a state another rank's bundle holds.
        """
        from reprokit.bundle import tensorfile

        if REPLICATED in self.manifest["files"]:
            return self.state_tree(), reference.state(self)
        rels = state_files(self.manifest["files"])
        if not rels:
            raise BundleError(f"{self.path}: the manifest lists no complete set of state files "
                              f"({STATE_TENSORS}, state/state-1.safetensors, ...); the bundle is incomplete. "
                              f"{DAMAGED_BUNDLE_ADVICE}",
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
                                      f"state file); refusing an ambiguous state. {DAMAGED_BUNDLE_ADVICE}",
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
        from reprokit import pytree  # numpy: only a step's batch needs it (the CLI's options import this package)

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
            raise BundleError(f"{self.path}: {rel} is not in the manifest; the bundle is incomplete. {DAMAGED_BUNDLE_ADVICE}",
                              [{"file": rel, "problem": "missing"}])
        return schema.load_listed_json(self.path, rel, meta)

    def _tensors(self, rel: str) -> dict[str, torch.Tensor]:
        """The tensors of one file, read once: hashed while read, and made only once the digest matched."""
        from reprokit.bundle import tensorfile

        meta = self.manifest["files"].get(rel)
        if meta is None:
            raise BundleError(f"{self.path}: {rel} is not in the manifest; the bundle is incomplete. {DAMAGED_BUNDLE_ADVICE}",
                              [{"file": rel, "problem": "missing"}])
        try:
            return tensorfile.read_verified(self.path / rel, meta["sha256"], meta["size"])
        except tensorfile.TensorFileError as e:
            raise BundleError(f"{self.path}: {rel}: {e}; refusing to load it. {DAMAGED_BUNDLE_ADVICE}",
                              [{"file": rel, "problem": str(e)}]) from None
        except OSError as e:
            raise BundleError(f"{self.path}: {rel} cannot be read ({e.strerror or e}). {DAMAGED_BUNDLE_ADVICE}",
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


def folder_of_bundles(path: Path) -> str | None:
    """What to say when PATH is a folder that holds bundles (the recorder's ``out_dir``, an incident folder) but is
    not one itself, so that the user reads the bundles' names rather than only that ``manifest.json`` is missing."""
    if not path.is_dir() or (path / MANIFEST).exists():
        return None
    inner = sorted(p for p in path.iterdir() if p.is_dir() and (p / MANIFEST).is_file())
    if not inner:
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


def _is_incident_folder(folder: Path) -> bool:
    """An incident folder of a multi-rank run, told by the names the recorder gives: ``incident-...``, or
    bundles named ``...-rankNofM``."""
    return folder.name.startswith(INCIDENT_PREFIX) or any(
        RANK_SUFFIX.search(p.name) for p in folder.iterdir() if p.is_dir() and (p / MANIFEST).is_file())


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
        lines = "\n".join(one_line(f"  {p['file']}: {p['problem']}") for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise BundleError(
            f"{path} failed verification ({len(problems)} problem(s)); refusing to load it:\n{lines}{more}\n"
            + DAMAGED_BUNDLE_ADVICE,
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
