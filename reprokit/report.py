"""Human and JSON descriptions of a bundle (``reprokit inspect``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from safetensors import safe_open

from reprokit import pytree
from reprokit.bundle import STATE_TENSORS, Bundle, jsonable
from reprokit.code import ref_label
from reprokit.errors import ReprokitError


def describe(bundle: Bundle) -> dict[str, Any]:
    """Everything ``inspect`` shows, as one JSON-able dict."""
    run, f = bundle.run, bundle.failure
    steps = bundle.steps
    return jsonable({
        "bundle": str(bundle.path),
        "format_version": bundle.manifest["version"],
        "failure": {"kind": f.kind, "step": f.step, "exception_type": f.exc_type, "message": f.message,
                    "frame": f.frame, "signature": f.signature()},
        "window": {"start": run["window"]["start"], "end": run["window"]["end"], "steps": len(steps)},
        "batch": _batch_structure(bundle, steps[-1]) if steps else {},
        "state": _state_sizes(bundle),
        "sizes": bundle.sizes(),
        "refs": run["refs"],
        "rank": (run.get("distributed") or {}).get("rank"),
        "world_size": (run.get("distributed") or {}).get("world_size"),
        "incident": (run.get("distributed") or {}).get("incident"),
        "env": {k: v for k, v in bundle.env.items() if k != "git"} | {"git": _git_summary(bundle.env.get("git"))},
        "losses": [{"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]} for h in run["history"]],
        "provenance": run.get("provenance"),
        "checked": CHECKED,
    })


CHECKED = ("JSON files and code hashed against the manifest; tensor files checked for size and header only, "
           "not hashed (`reprokit verify` hashes them; replay hashes each one as it loads it)")


def _batch_structure(bundle: Bundle, step: int) -> dict[str, Any]:
    doc, tensors = bundle.step_doc(step)
    batch = pytree.decode(doc["batch"], tensors)
    out: dict[str, Any] = {}
    for path, leaf in pytree.leaves(batch):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            out[path] = {"shape": list(leaf.shape), "dtype": str(leaf.dtype).replace("torch.", "")}
        else:
            out[path] = {"type": type(leaf).__name__, "value": leaf if isinstance(leaf, (int, float, str)) else None}
    return out


def _state_sizes(bundle: Bundle) -> dict[str, int]:
    sizes: dict[str, int] = {}
    with safe_open(str(bundle.path / STATE_TENSORS), framework="pt") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            n = 1
            for d in sl.get_shape():
                n *= d
            top = key.split("/", 1)[0]
            sizes[top] = sizes.get(top, 0) + n * _itemsize(sl.get_dtype())
    return sizes


# Bytes per element of each safetensors dtype code (parsing digits out of "F8_E4M3" gave 105).
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]


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
    lines.append("state    " + ", ".join(f"{k} {_mb(v)}" for k, v in d["state"].items()))
    lines.append("on disk  " + ", ".join(f"{k} {_mb(v)}" for k, v in d["sizes"].items()))
    e = d["env"]
    git = e.get("git") or {}
    lines.append(f"env      python {e['python']}, torch {e['torch']}, cuda {e['cuda']}, "
                 f"devices {e['devices'] or ['cpu']}" + (f", git {str(git.get('commit'))[:10]}"
                                                        f"{' (dirty)' if git.get('dirty') else ''}" if git else ""))
    lines += _provenance_lines(d.get("provenance"))
    if d.get("checked"):
        lines.append(f"checked  {d['checked']}")
    losses = d["losses"][-12:]
    if losses:
        lines.append(f"losses   (last {len(losses)} of {len(d['losses'])})")
        lines += [f"  step {h['step']:>8}  loss {h['loss'] if h['loss'] is not None else '-':<24}"
                  f"grad norm {h['grad_norm'] if h['grad_norm'] is not None else '-'}" for h in losses]
    return "\n".join(lines)


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
    if p.get("kept_rows") is not None:
        idx = p.get("dataset_indices")
        lines.append(f"  kept rows {p['kept_rows']} of the failing batch" + (f" (dataset indices {idx})" if idx else ""))
    if p.get("seq_window"):
        lo, hi = p["seq_window"]
        lines.append(f"  sequence window {lo}:{hi}")
    passes = p.get("passes")
    if isinstance(passes, dict) and passes:
        lines.append("  passes " + ", ".join(f"{k} {v.get('accepted')}/{v.get('runs')} accepted, "
                                             f"{_n(v.get('replays', 0), 'replay')}" for k, v in passes.items()))
    return lines


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
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"



def plot_history(bundle: Bundle, out: Path) -> Path:
    """Loss and grad norm over the recorded history, window shaded, failure marked, as a PNG.

    Raises:
        ReprokitError: when matplotlib is not installed, saying how to get it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ReprokitError("--plot needs matplotlib: pip install 'reprokit[plot]'") from None
    hist = bundle.run.get("history", [])
    steps = [h["step"] for h in hist]
    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    for ax, key, label in ((ax1, "loss", "loss"), (ax2, "grad_norm", "grad norm")):
        ys = [_finite_or_none(h.get(key)) for h in hist]
        ax.plot(steps, [y if y is not None else float("nan") for y in ys], lw=1.2, color="C0")
        bad = [s for s, h in zip(steps, hist) if h.get(key) is not None and _finite_or_none(h[key]) is None]
        for s in bad:
            ax.axvline(s, color="red", lw=0.8, ls=":")
        ax.set_ylabel(label)
        ax.axvspan(bundle.run["window"]["start"], bundle.run["window"]["end"], color="0.9", label="replay window")
        ax.axvline(bundle.failure.step, color="red", lw=1.5, label=f"failure: {bundle.failure.kind}")
        if any(y is not None and y > 0 for y in ys):
            ax.set_yscale("log")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.set_xlabel("step")
    fig.suptitle(f"{bundle.failure.describe()}"[:100], fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _finite_or_none(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def format_incident(d: dict[str, Any]) -> str:
    """The human summary of an N-rank incident replay (``IncidentReport.to_json()``)."""
    inc = d.get("incident") or {}
    lines = [f"incident {inc.get('incident', d['folder'])}: rank {d['failing_rank']} failed in training "
             f"({inc.get('what', 'see its bundle')}); replayed on {d['world_size']} ranks: {d['verdict']}"]
    for r in d["ranks"]:
        if r.get("error"):
            what = f"error: {r['error']}"
        elif r.get("blocked"):
            what = f"blocked: {r.get('note', '')}"
        else:
            f = r.get("failure") or {}
            got = f"{f.get('kind')} at step {f.get('step')}" if f else "no failure"
            recorded = (r.get("recorded_failure") or {}).get("kind")
            what = f"{r.get('verdict')} (recorded {recorded}, replayed {got})"
        lines.append(f"  rank {r.get('rank')}: {what}")
    return "\n".join(lines)
