"""Human and JSON descriptions of a bundle (``reprokit inspect``).

``inspect`` answers in well under a second whatever the state's size, without importing torch:
it reads the JSON files, the state files' safetensors headers (not their tensors), and
the failing step's batch through safetensors' numpy backend, after hashing that file.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from pathlib import Path
from typing import Any

from reprokit import pytree
from reprokit.bundle import REPLICATED, STEPS, Bundle, jsonable, reference, schema, state_files, step_name
from reprokit.bundle.hashing import open_regular
from reprokit.code import ref_label
from reprokit.diagnose import findings
from reprokit.errors import DAMAGED_BUNDLE_ADVICE, BundleError, ReprokitError
from reprokit.signature import summary_line
from reprokit.text import one_line

NUMPY_DTYPES = frozenset(schema.ITEMSIZE) - {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}
"""Safetensors dtypes numpy has (what ``safetensors.numpy`` loads)."""


def describe(bundle: Bundle) -> dict[str, Any]:
    """Everything ``inspect`` shows, as one JSON-able dict."""
    run, f = bundle.run, bundle.failure
    steps = bundle.steps
    failing = failing_step(bundle)
    batches = {s: step_batch(bundle, s) for s in {steps[-1] if steps else None, failing} if s is not None}
    return jsonable({
        "bundle": str(bundle.path),
        "format_version": bundle.manifest["version"],
        "failure": {**f.summary(), "signature": f.signature()},
        "window": {"start": run["window"]["start"], "end": run["window"]["end"], "steps": len(steps)},
        "batch": _batch_structure(batches[steps[-1]]) if steps else {},
        "state": _state_sizes(bundle),
        "state_reference": _state_reference(bundle),
        "sizes": bundle.sizes(),
        "refs": run["refs"],
        "rank": (run.get("distributed") or {}).get("rank"),
        "world_size": (run.get("distributed") or {}).get("world_size"),
        "local_rank": (run.get("distributed") or {}).get("local_rank"),
        "backend": (run.get("distributed") or {}).get("backend"),
        "restart": (run.get("distributed") or {}).get("restart"),
        "incident": (run.get("distributed") or {}).get("incident"),
        "env": {k: v for k, v in bundle.env.items() if k != "git"} | {"git": _git_summary(bundle.env.get("git"))},
        "losses": [{"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]} for h in run["history"]],
        "provenance": run.get("provenance"),
        "diagnosis": diagnosis(bundle, batches[failing] if failing is not None else None),
        "checked": CHECKED,
    })


CHECKED = ("JSON files and code hashed against the manifest; tensor files checked for size and header only, "
           "not hashed (`reprokit verify` hashes them; replay hashes each one as it loads it)")


def failing_step(bundle: Bundle) -> int | None:
    """The window's step the failure fired at (else its last step); None for an empty window."""
    steps = bundle.steps
    if not steps:
        return None
    return bundle.failure.step if bundle.failure.step in steps else steps[-1]


def diagnosis(bundle: Bundle, batch: Any = None) -> dict[str, Any]:
    """The failing step's batch checked for data faults (``reprokit.diagnose``), from tensors alone
    (``batch``: that step's batch when the caller has read it already)."""
    step = failing_step(bundle)
    if step is None:
        return {"step": None, "findings": [], "tables": None}
    batch = step_batch(bundle, step) if batch is None else batch
    tables = bundle.run.get("model")
    # inspect runs no code: whether the state fails on any data is what shrink tested (a shrunk bundle carries it)
    state_check = (bundle.run.get("provenance") or {}).get("state_check")
    return {"step": step, "findings": findings(batch, tables), "tables": tables,
            "state_check": state_check if isinstance(state_check, dict) else None}


def batch_dump(bundle: Bundle, rows: list[int] | None = None, width: int = 64) -> dict[str, Any]:
    """The failing step's batch itself (``inspect --batch``): each leaf, its rows as lists (``rows`` only)."""
    step = failing_step(bundle)
    if step is None:
        return {"step": None, "leaves": {}}
    batch = step_batch(bundle, step)
    leaves: dict[str, Any] = {}
    for path, leaf in pytree.leaves(batch):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            leaves[path] = {"value": leaf if isinstance(leaf, (int, float, str, bool)) or leaf is None else repr(leaf)}
            continue
        t = leaf.detach().cpu() if hasattr(leaf, "detach") else leaf  # a numpy array, or a torch tensor (bf16)
        entry: dict[str, Any] = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}
        if t.ndim == 0:
            entry["value"] = t.item()
        else:
            n = t.shape[0]
            picked = [r for r in (range(n) if rows is None else rows) if 0 <= r < n]
            entry["rows"] = {str(r): _row_values(t[r], width) for r in picked}
            if rows is not None and len(picked) < len(rows):
                entry["missing_rows"] = [r for r in rows if not 0 <= r < n]
        leaves[path] = entry
    return {"step": step, "leaves": leaves}


def _row_values(t: Any, width: int) -> dict[str, Any]:
    flat = t.reshape(-1)
    values = flat[:width].tolist()
    return {"shape": list(t.shape), "values": values, "truncated": len(flat) > width}


def parse_rows(text: str) -> list[int]:
    """``"5"``, ``"1,4"``, ``"2-6"`` (inclusive) as a sorted list of row numbers.

    Raises:
        ReprokitError: naming the part that is not a row number or range.
    """
    rows: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ReprokitError(f"--rows: {part!r} is not a row number or a range like 2-6; expected e.g. 5 or 1,4 "
                                "or 2-6")
        first, last = int(lo), int(hi if sep else lo)
        if last < first:
            raise ReprokitError(f"--rows: {part!r} runs backwards; write it {last}-{first}")
        if last - first + 1 + len(rows) > MAX_ROWS:
            raise ReprokitError(f"--rows: {text!r} asks for more than {MAX_ROWS} rows; name fewer (leave --rows out "
                                "for every row of the batch)")
        rows.update(range(first, last + 1))
    return sorted(rows)


MAX_ROWS = 100_000
"""The most rows ``--rows`` may name."""


def _spans(numbers: list[int]) -> str:
    """``[3, 4, 5, 9]`` as ``"3-5, 9"``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def format_batch(d: dict[str, Any]) -> str:
    """``batch_dump``'s dict as text: one block per leaf, one line per row."""
    lines = [f"batch of step {d['step']}"]
    for path, e in d["leaves"].items():
        if "rows" not in e:
            lines.append(f"{path}  {e.get('dtype', '')}{e.get('shape', '')} = {e['value']!r}".replace("  =", " ="))
            continue
        lines.append(f"{path}  {e['dtype']}{e['shape']}")
        for r, row in e["rows"].items():
            vals = ", ".join(_fmt(v) for v in row["values"])
            shape = f" {row['shape']}" if len(row["shape"]) > 1 else ""
            lines.append(f"  row {r}{shape}: [{vals}{', ...' if row['truncated'] else ''}]")
        if e.get("missing_rows"):
            lines.append(f"  (no row {_spans(e['missing_rows'])}: the leaf has {e['shape'][0]} rows)")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def step_batch(bundle: Bundle, step: int) -> Any:
    """The batch recorded for ``step``, its tensors as numpy arrays, read without importing torch.

    The step's tensor file is read once and hashed; its tensors are made (by ``safetensors.numpy``)
    from those same bytes only after the digest matched the manifest's.

    Raises:
        BundleError: the file is missing from the manifest, unreadable, or not what the manifest says.
    """
    rel = f"{STEPS}/{step_name(step)}"
    data = _verified_bytes(bundle, rel + ".safetensors")
    header, _ = schema.safetensors_header(io.BytesIO(data), len(data), rel + ".safetensors")
    dtypes = {info.get("dtype") for key, info in header.items() if key != "__metadata__" and isinstance(info, dict)}
    if not dtypes <= NUMPY_DTYPES:
        # bf16 and float8 have no numpy dtype: this one file goes through torch (Bundle.step, which
        # hashes it again); diagnose and batch_dump take torch tensors as well as arrays.
        return bundle.step(step)[0]
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        tensors = load(data)
    except (SafetensorError, ValueError, KeyError) as e:
        raise BundleError(f"{bundle.path}: {rel}.safetensors: {str(e)[:300]}; refusing to load it. {DAMAGED_BUNDLE_ADVICE}",
                          [{"file": f"{rel}.safetensors", "problem": str(e)[:300]}]) from None
    return pytree.decode(bundle._json(f"{rel}.json")["batch"], tensors)  # checked against the manifest, as its tensors


def _unreadable(bundle: Bundle, rel: str, e: OSError) -> BundleError:
    return BundleError(f"{bundle.path}: {rel} cannot be read ({e.strerror or e}). {DAMAGED_BUNDLE_ADVICE}",
                       [{"file": rel, "problem": f"cannot be read: {e.strerror or e}"}])


def _verified_bytes(bundle: Bundle, rel: str) -> bytes:
    """The bytes of one listed file, refused unless their size and sha256 are the manifest's."""
    meta = bundle.manifest["files"].get(rel)
    if meta is None:
        raise BundleError(f"{bundle.path}: {rel} is not in the manifest; the bundle is incomplete. {DAMAGED_BUNDLE_ADVICE}",
                          [{"file": rel, "problem": "missing"}])
    schema.check_fits(meta["size"] + 1, str(bundle.path / rel), "read its batch")
    try:
        with open_regular(bundle.path / rel) as f:
            data = f.read(meta["size"] + 1)  # one byte more: a longer file shows as a size mismatch
    except OSError as e:
        raise _unreadable(bundle, rel, e) from None
    found = hashlib.sha256(data).hexdigest()
    if len(data) != meta["size"]:
        why = f"size mismatch: {len(data) if len(data) <= meta['size'] else 'more than ' + str(meta['size'])} " \
              f"bytes on disk, {meta['size']} in the manifest"
    elif found != meta["sha256"]:
        why = f"checksum mismatch: sha256 {found}, the manifest says {meta['sha256']}"
    else:
        return data
    raise BundleError(f"{bundle.path}: {rel}: {why}; refusing to load it. {DAMAGED_BUNDLE_ADVICE}",
                      [{"file": rel, "problem": why}])


def _batch_structure(batch: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, leaf in pytree.leaves(batch):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            out[path] = {"shape": list(leaf.shape), "dtype": str(leaf.dtype).replace("torch.", "")}
        else:
            out[path] = {"type": type(leaf).__name__, "value": leaf if isinstance(leaf, (int, float, str)) else None}
    return out


def _state_reference(bundle: Bundle) -> dict[str, Any] | None:
    """Where the state of a bundle that references rank 0's lives (replicated DDP state), else None."""
    return reference.describe(bundle)


def _state_sizes(bundle: Bundle) -> dict[str, int]:
    """Bytes of the state's tensors per top-level key (model, optimizer, ...), summed over every state
    file the manifest lists (or, for a bundle that references rank 0's state, every file the reference
    lists in that bundle), from their headers alone (checked against each file by ``open_bundle``)."""
    sizes: dict[str, int] = {}
    ref = _state_reference(bundle)
    if ref is None:
        root, rels = bundle.path, state_files(bundle.manifest["files"])
    elif ref["path"] is None:
        return sizes
    else:  # ref["path"] is the owner bundle's state/state.safetensors
        root, rels = Path(ref["path"]).parents[1], state_files(bundle._json(REPLICATED)["files"])
        if not all((root / rel).is_file() and not (root / rel).is_symlink() for rel in rels):
            return sizes  # a part is missing: `verify` lists it
        for rel in rels:  # another bundle's files: their headers were not checked with this one
            schema.check_safetensors(root / rel, rel)
    for rel in rels:
        path = root / rel
        try:
            with open_regular(path) as f:
                header, _ = schema.safetensors_header(f, os.fstat(f.fileno()).st_size, rel)
        except OSError as e:
            raise _unreadable(bundle, rel, e) from None
        for key, info in header.items():
            if key != "__metadata__":
                start, end = info["data_offsets"]
                top = key.split("/", 1)[0]
                sizes[top] = sizes.get(top, 0) + end - start
    return sizes


def _git_summary(git: dict[str, Any] | None) -> dict[str, Any] | None:
    if not git:
        return None
    return {"commit": git.get("commit"), "branch": git.get("branch"), "dirty": git.get("dirty")}


def format_describe(d: dict[str, Any]) -> str:
    f, w = d["failure"], d["window"]
    lines = [
        f"bundle   {d['bundle']}",
        f"failure  {f['kind']} at step {f['step']}" + (f": {f['exception_type']}: {f['message']}" if f["exception_type"]
                                                       else (f" ({f['message']})" if f["message"] else "")),
    ]
    if f["frame"]:
        lines.append(f"raised   in {f['frame']}")
    lines.append(f"window   steps {w['start']}..{w['end']} ({_n(w['steps'], 'step')}, replayed from the snapshot at "
                 f"step {w['start']})")
    lines.append("batch    " + ("; ".join(f"{k}: {v.get('dtype', v.get('type'))}{v.get('shape', '')}"
                                           for k, v in d["batch"].items()) or "(empty)"))
    lines.append("refs     " + _refs_line(d.get("refs")))
    ref = d.get("state_reference")
    lines.append("state    " + (f"referenced from rank {ref['rank']}'s bundle {ref['bundle']} (snapshot at step "
                                f"{ref['step']}{'; ' + ref['problem'] if ref['problem'] else ''}): " if ref else "")
                 + ", ".join(f"{k} {_mb(v)}" for k, v in d["state"].items()))
    lines.append("on disk  " + ", ".join(f"{k} {_mb(v)}" for k, v in d["sizes"].items()))
    e = d["env"]
    git = e.get("git") or {}
    lines.append(f"env      python {e['python']}, torch {e['torch']}, cuda {e['cuda']}, "
                 f"devices {e['devices'] or ['cpu']}" + (f", {_git_words(git)}" if git else ""))
    lines += _provenance_lines(d.get("provenance"))
    lines += _diagnosis_lines(d.get("diagnosis"))
    if d.get("checked"):
        lines.append(f"checked  {d['checked']}")
    lines += _loss_lines(d["losses"], w)
    return "\n".join(lines)


def _git_words(git: dict[str, Any]) -> str:
    """``git 1a2b3c4d5e (dirty)``; a repository without a commit yet has no commit to name."""
    commit = git.get("commit")
    what = f"git {str(commit)[:10]}" if commit else "a git repository with no commits yet"
    return what + (" (dirty)" if git.get("dirty") else "")


def _loss_lines(history: list[dict[str, Any]], window: dict[str, Any]) -> list[str]:
    """The last 12 recorded losses. The run's history reaches back before the window (a shrunk bundle keeps all of
    it for one step), so when it does, the header says how many steps the bundle holds and marks them."""
    losses = history[-12:]
    if not losses:
        return []
    held = [h for h in history if window["start"] <= h["step"] <= window["end"]]
    if len(held) == len(history):
        header = f"losses   (last {len(losses)} of {len(history)})"
    else:
        header = (f"losses   (last {len(losses)} of {len(history)} recorded; this bundle holds "
                  f"{_n(window['steps'], 'step')}, marked *)")
    mark = len(held) != len(history)
    return [header] + [f"{'*' if mark and h in held else ' '} step {h['step']:>8}  "
                       f"loss {h['loss'] if h['loss'] is not None else '-':<24}"
                       f"grad norm {h['grad_norm'] if h['grad_norm'] is not None else '-'}" for h in losses]


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _provenance_lines(p: Any) -> list[str]:
    """Where a shrunk bundle came from: source bundle, kept rows, dataset indices, sequence window, passes."""
    if not isinstance(p, dict):
        return []
    src = str(p.get("source_bundle"))
    digest = p.get("source_manifest_sha256")
    lines = [f"shrunk   from {src}" + (f" (manifest sha256 {str(digest)[:12]})" if digest else "")
             + (f" in {_n(p['replays'], 'replay')}" if isinstance(p.get("replays"), int) else "")]
    before = p.get("before")
    if isinstance(before, dict):
        order = ["steps", "rows", "seq", "tokens"]
        keys = [k for k in order if k in before] + sorted(k for k in before if k not in order)
        lines.append("  before " + ", ".join(f"{k} {before[k]}" for k in keys if before[k] is not None))
    lines += [f"  {line.strip()}" for line in _state_check_lines(p.get("state_check"))]
    if p.get("kept_rows") is not None:
        idx = p.get("dataset_indices")
        lines.append(f"  kept {kept_rows(p['kept_rows'])} of the failing batch" + (f" (dataset indices {idx})" if idx else ""))
    if p.get("seq_window"):
        lo, hi = p["seq_window"]
        lines.append(f"  sequence window {lo}:{hi}")
    passes = p.get("passes")
    if isinstance(passes, dict) and passes:
        lines.append("  passes " + ", ".join(f"{k} {v.get('accepted')}/{v.get('runs')} accepted, "
                                             f"{_n(v.get('replays', 0), 'replay')}" for k, v in passes.items()))
    return lines


def kept_rows(rows: list[Any]) -> str:
    """``rows [3, 5]``, or for micro-batches (``[k, r]`` pairs) ``micro-batch 1 row 4, ...``."""
    if rows and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in rows):
        return ", ".join(f"micro-batch {k} row {r}" for k, r in rows)
    return f"rows {rows}"


def _state_check_lines(check: Any) -> list[str]:
    """Shrink's test of the state before blaming data: a verdict of ``state`` says no sample is to blame."""
    if not isinstance(check, dict) or check.get("verdict") != "state":
        return []
    return ["  no data culprit: " + str(check.get("message"))]


def _diagnosis_lines(diag: Any) -> list[str]:
    """The batch diagnosis: each finding, or a line saying the batch looks clean."""
    from reprokit.diagnose import summary

    if not isinstance(diag, dict) or diag.get("step") is None:
        return []
    found = summary(diag.get("findings") or [])
    tables = diag.get("tables")
    checked = "" if tables else " (no embedding table sizes recorded: ids not checked)"
    state = diag.get("state_check")
    if isinstance(state, dict) and state.get("verdict") == "state":
        return [f"data     the batch of step {diag['step']} is not the cause: {state.get('message')}"] + \
            [f"  {line}" for line in found]
    if not found:
        return [f"data     the batch of step {diag['step']} shows no data fault{checked}"]
    return [f"data     the batch of step {diag['step']}{checked}:"] + [f"  {line}" for line in found]


def _refs_line(refs: Any) -> str:
    """What replay would import, as ``build MODULE:QUALNAME, step ..., predicates ...`` (shown as recorded)."""
    if not isinstance(refs, dict):
        return repr(refs)[:300]
    preds = refs.get("predicates") or []
    parts = [f"build {ref_label(refs.get('build'))}", f"step {ref_label(refs.get('step'))}"]
    if preds:
        parts.append("predicates " + ", ".join(ref_label(p) if p is not None else "(not importable)"
                                               for p in (preds if isinstance(preds, list) else [preds])))
    return ", ".join(parts)


def _mb(n: int) -> str:
    """A byte count as people read it: ``1.23 MB``, ``4.5 kB``, ``48 B`` (a tiny model's state is not "0.0 kB")."""
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n} B"



def plot_history(bundle: Bundle, out: Path) -> Path:
    """Loss, grad norm, LR and loss scale over the recorded history, window shaded, failure marked, as a PNG.

    The LR and loss-scale panels appear when the recorder stored them; the title names the
    failure and, for a shrunk bundle, the rows it kept. A log axis is used only over a range of
    at least a decade; narrower ranges get a linear axis with plain tick labels.

    Raises:
        ReprokitError: when matplotlib is not installed, saying how to get it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import ScalarFormatter
    except ImportError:
        raise ReprokitError("--plot needs matplotlib, which is not installed: pip install matplotlib (in a checkout "
                            "of reprokit: pip install -e '.[plot]'), then run the command again") from None
    hist = bundle.run.get("history", [])
    steps = [h["step"] for h in hist]
    panels = plot_panels(hist)
    fig, axes = plt.subplots(len(panels), 1, sharex=True, figsize=(9, 2.2 + 1.6 * len(panels)), squeeze=False)
    for ax, (key, label) in zip(axes[:, 0], panels):
        ys = [_finite_or_none(h.get(key)) for h in hist]
        ax.plot(steps, [y if y is not None else float("nan") for y in ys], lw=1.2, color="C0")
        bad = [s for s, h in zip(steps, hist) if h.get(key) is not None and _finite_or_none(h[key]) is None]
        for s in bad:
            ax.axvline(s, color="red", lw=0.8, ls=":")
        ax.set_ylabel(label)
        ax.axvspan(bundle.run["window"]["start"], bundle.run["window"]["end"], color="0.9", label="replay window")
        ax.axvline(bundle.failure.step, color="red", lw=1.5, label=f"failure: {bundle.failure.kind}")
        if log_axis(ys):
            ax.set_yscale("log")
        else:  # a narrow range: plain numbers, no offset or "x 10^0" (7.78..7.90 reads as such)
            fmt = ScalarFormatter(useOffset=False)
            fmt.set_scientific(False)
            ax.yaxis.set_major_formatter(fmt)
    axes[0, 0].legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(plot_title(bundle), fontsize=9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_panels(hist: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(history key, label)`` of each panel: loss and grad norm, then LR and loss scale where recorded."""
    return [("loss", "loss"), ("grad_norm", "grad norm")] + [
        (key, label) for key, label in (("lr", "learning rate"), ("loss_scale", "loss scale"))
        if any(_finite_or_none(h.get(key)) is not None for h in hist)]


def log_axis(ys: list[float | None]) -> bool:
    """A log axis only for positive values spanning at least a decade."""
    known = [y for y in ys if y is not None]
    return bool(known) and min(known) > 0 and max(known) >= 10 * min(known)


def plot_title(bundle: Bundle) -> str:
    """The failure, and for a shrunk bundle where its rows came from (kept rows, dataset indices)."""
    title = bundle.failure.describe()[:100]
    p = bundle.run.get("provenance")
    if isinstance(p, dict) and p.get("kept_rows") is not None:
        idx = p.get("dataset_indices")
        title += f"\nshrunk: kept {kept_rows(p['kept_rows'])} of the failing batch" + (
            f" (dataset indices {idx})" if idx else "")
    return title


def _finite_or_none(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def format_incident(d: dict[str, Any]) -> str:
    """The human summary of an N-rank incident replay (``IncidentReport.to_json()``)."""
    from reprokit.replayer import verdict_phrase

    inc = d.get("incident") or {}
    failing: dict[str, Any] = next((r for r in d["ranks"] if r.get("rank") == d["failing_rank"]), {})
    lines = [f"incident {inc.get('incident', d['folder'])}: rank {d['failing_rank']} failed in training "
             f"({d.get('failing_what') or inc.get('what', 'see its bundle')}); replayed on {d['world_size']} ranks: "
             f"{verdict_phrase(d['verdict'], failing.get('runs'))}"]
    for r in d["ranks"]:
        if r.get("error"):
            what = f"error: {r['error']}"
        elif r.get("blocked"):
            what = f"blocked: {r.get('note', '')}"
        else:
            f = r.get("failure") or {}
            got = f"{f.get('kind')} at step {f.get('step')}" if f else "no failure"
            if f.get("kind") == "crash":  # how the process died, not just that it did
                got = f"crash ({summary_line(f)})"
            recorded = (r.get("recorded_failure") or {}).get("kind")
            what = f"{verdict_phrase(str(r.get('verdict')), r.get('runs'), None)} (recorded {recorded}, replayed {got})"
        lines.append(f"  rank {r.get('rank')}: {what}")
    return "\n".join(lines)


def format_describe_incident(d: dict[str, Any]) -> str:
    """``reprokit inspect INCIDENT_DIR``'s text (``describe_incident()``): who failed first, then every rank."""
    inc = d.get("incident") or {}
    origin = d["failing_rank"]
    first = f"rank {origin} failed first" if origin is not None else "no rank failed at the incident's step"
    died = d.get("died") if isinstance(d.get("died"), dict) else None
    declared = f"declared by rank {d.get('declared_by')}" + (
        f", which found rank {died.get('rank')}'s process dead: {died.get('how')}" if died else "")
    lines = [f"incident {inc.get('incident', d['folder'])}: {_n(d['world_size'], 'rank')}, {first} "
             f"(step {d.get('step')}; {declared})"]
    for r in d["ranks"]:
        mark = "  <- failed first" if r["rank"] == origin else ""
        lines.append(f"  rank {r['rank']}: {r['what']}{mark}")
        lines.append(f"    bundle {r['bundle']} (steps {r['window']['start']}-{r['window']['end']})")
    lines.append(f"replay all ranks: reprokit replay {d['folder']}; one rank's details: reprokit inspect BUNDLE")
    return "\n".join(lines)


def format_skips(d: dict[str, Any]) -> str:
    """``reprokit inspect OUT_DIR``'s text for a run that skipped samples (``reprokit.skip_journal.describe_skips()``): each
    skip with its step, rows, dataset indices, evidence and bundle, then the indices to filter on a resume."""
    n = d["count"]
    if not n:
        return f"no skips in {one_line(d['journal'])}"
    lines = [f"{_n(n, 'skip')} in {one_line(d['journal'])} ({d['seconds_lost']:.1f} s of replays lost)"]
    for e in d["skips"]:
        indices = e.get("dataset_indices")
        named = f"dataset indices {indices}" if indices is not None else "no dataset index (the batch carries none)"
        rank = f" on rank {e['rank']}" if e.get("rank") is not None else ""
        failure = e.get("failure") or {}
        lines.append(one_line(f"  step {e['step']}{rank}: skipped rows {e.get('rows')}, {named}; "
                              f"{summary_line(failure, step=False)}; {float(e.get('seconds_lost') or 0):.1f} s"))
        ev = e.get("evidence") or {}
        window = ev.get("window") or {}
        bit_exact = window.get("replayed_bit_exact")
        exact = "" if bit_exact is None else ", bit-exact" if bit_exact else ", not bit-exact"
        only = ev.get("only_culprits") or {}
        lines.append(one_line(f"    evidence: steps {window.get('from_step')}-{window.get('to_step')} replayed{exact}; "
                              f"{ev.get('reproduced', '')}; without the rows: "
                              f"{(ev.get('without_culprits') or {}).get('verdict')}; with only them "
                              f"({only.get('background')}): {only.get('verdict')}"))
        if e.get("bundle"):
            lines.append(one_line(f"    bundle {e['bundle']}"))
    lines.append(f"dataset indices to keep out of a resumed run (reprokit.skip_list): {d['dataset_indices']}")
    return "\n".join(lines)


def format_verify(d: dict[str, Any]) -> str:
    """``reprokit verify``'s text: every problem, or ok (and the archive digest it matched); the origin note."""
    # Every name and problem is a bundle's (or an archive's) text: printed as one line each, so that a file named
    # "x\nBUNDLE: ok, every file matches the manifest" cannot print a line of its own.
    bundle = one_line(str(d["bundle"]))
    if d["problems"]:
        lines = [f"{bundle}: {len(d['problems'])} problem(s)"]
        # Many unexpected files under one folder (a bundle or an output written into this one) read as one line.
        strays: dict[str, list[str]] = {}
        for p in d["problems"]:
            if p["problem"] == "unexpected file" and "/" in p["file"]:
                strays.setdefault(p["file"].split("/", 1)[0], []).append(p["file"])
        said: set[str] = set()
        for p in d["problems"]:
            top = p["file"].split("/", 1)[0]
            if p["problem"] == "unexpected file" and len(strays.get(top, [])) > 3 and "/" in p["file"]:
                if top not in said:
                    said.add(top)
                    lines.append(f"  {one_line(top)}/: {len(strays[top])} unexpected files "
                                 f"({one_line(strays[top][0])}, ...; --json lists each)")
                continue
            extra = "".join(f", {k} {p[k]}" for k in ("expected", "found") if k in p)
            lines.append(one_line(f"  {one_line(str(p['file']))}: {p['problem']}{extra}"))
    else:
        lines = [f"{bundle}: ok, every file matches the manifest"
                 + (f"; archive sha256 matches {d['origin']}" if d.get("origin") else "")]
    lines += [one_line(f"  referenced {x['file']}: {x['status']}") for x in d.get("referenced") or []]
    lines += [one_line(f"  accepted (--accept-generated) {one_line(str(x['file']))}: {x['problem']}")
              for x in d.get("accepted") or []]
    if d.get("note"):
        lines.append(f"note: {d['note']}")
    return "\n".join(lines)


def format_shrink(d: dict[str, Any]) -> str:
    """``reprokit shrink``'s text: sizes before and after, kept rows and window, passes, the failure kept."""
    rows = [(k, d[f"{k}_before"], d[f"{k}_after"]) for k in ("steps", "rows", "seq", "tokens")]
    lines = [f"shrunk in {d['replays']} replays ({d['seconds']:.1f}s)"
             + (" - budget exhausted, result may not be minimal" if d["budget_exhausted"] else ""),
             f"  {'':<8}{'before':>10}{'after':>10}"]
    lines += [f"  {k:<8}{b if b is not None else '-':>10}{a if a is not None else '-':>10}" for k, b, a in rows]
    grew = ""
    if isinstance(d.get("bytes_before"), int) and isinstance(d.get("bytes_after"), int):
        lines.append(f"  {'on disk':<8}{_mb(d['bytes_before']):>10}{_mb(d['bytes_after']):>10}")
        if d["bytes_after"] > d["bytes_before"]:
            grew = "  larger on disk: "
            if d.get("state_referenced_before"):
                grew += ("the source's state was another rank's files (replicated DDP state, written once), and the "
                         "result carries that state itself, so it replays alone.")
            elif d.get("state_bytes_after", 0) > d.get("state_bytes_before", 0):
                grew += ("it starts from a later state, which holds what the first snapshot did not have yet (an "
                         "optimizer's moments, say); it replays fewer steps. `--passes micro,rows,sequence,tokens` keeps "
                         "the original start.")
            else:
                grew += "its state is no larger than the source's; other files are (`reprokit inspect` lists them)."
    lines += _state_check_lines(d.get("state_check"))
    if d.get("rows_ambiguous"):
        lines.append(f"  rows not cut: {d['rows_ambiguous']}")
    if d["kept_rows"] is not None:
        lines.append(f"  kept {kept_rows(d['kept_rows'])} of the failing batch"
                     + (f" (dataset indices {d['dataset_indices']})" if d["dataset_indices"] else ""))
    if d["seq_window"]:
        lines.append(f"  sequence window {d['seq_window'][0]}:{d['seq_window'][1]}")
    lines.append("  passes: " + ", ".join(f"{k} {v['accepted']}/{v['runs']} accepted, {v['replays']} "
                                          f"replay{'' if v['replays'] == 1 else 's'}"
                                          for k, v in d["passes"].items()))
    lines.append(f"  still fails: {summary_line(d['failure'])}")
    iso = d.get("isolation")
    if iso:
        lines.append(f"  isolation: each candidate in a process of its own ({iso['child_deaths']} of {iso['attempts']} "
                     f"died), forked by a server that imported torch once ({iso['startup_seconds']:.1f}s)")
    if grew:
        lines.append(grew)
    if d.get("code"):
        c = d["code"]
        commit = f" at git {c['git_commit'][:12]}{' (dirty)' if c.get('git_dirty') else ''}" if c.get("git_commit") else ""
        lines.append(f"  code: shrunk against --code {c['shrunk_against']}{commit}; the result carries the files of it "
                     "that ran, so it replays as shrink confirmed (without --code)")
    lines.append(f"wrote {d['output']}")
    return "\n".join(lines)


def format_pack(r: dict[str, Any], archive_name: str) -> str:
    """``reprokit pack``'s text: what was written and the receiver's one command."""
    import shlex

    flags = "xzf" if archive_name.endswith((".tar.gz", ".tgz")) else "xf"
    return "\n".join([
        f"wrote {r['output']} ({r['bytes'] / 1e6:.2f} MB), sha256 {r['sha256']}",
        "  contents: " + ", ".join(f"{k} {_mb(v)}" for k, v in r["breakdown"].items()),
        f"  receiver: tar {flags} {shlex.quote(archive_name)} && python {r['folder']}/repro.py"])
