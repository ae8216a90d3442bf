"""Semantic fuzzing: schema-valid lies under re-signed checksums, answered by ``replay`` with documented exit codes only.

``test_fuzz.py`` breaks bytes and JSON; this one edits what a bundle *means*, the way a careless tool or a sender
could, and re-signs the manifest so that every edit reaches the readers: the window, the failure and the detector
settings made inconsistent (the failing step dropped, an empty window, a failure moved, its kind changed, its detector
switched off), tensor dtypes (state, batch, RNG), ``provenance`` shapes, and code-file shapes (too deep to parse,
a shadowing ``triton.py``, a syntax error, a module without ``build``, bytes that are not UTF-8, a ``.pyc``). The seed
is a real recorded bundle (the suite's shared one: rk_mlp, NaN loss at step 6, window 4..6). One to three edits per
input.

The property, for every input:

- ``verify`` exits 0 or 1 and ``replay --json`` with a documented code (docs/reference/exit-codes.md: 0, 1, 3, 125; 2 is a
  usage error, which no edit of a bundle is), printing one JSON object; never an internal error (70);
- a bundle whose failure cannot be checked (the failing step outside the window, an empty window, a ``loss_spike``
  without ``spike_factor``, a ``predicate`` without predicates) is an invalid bundle: ``verify`` lists it (1),
  ``replay`` exits 3, never 0 ("not reproduced": a regression test that can never fail would pass);
- switching detectors off hides nothing: with only such edits, the failure still reproduces (exit 1);
- ``replay`` exits 0 only where an edit could really fix the run (the NaN removed from the poisoned batch).

Derandomized, a few dozen inputs (about 15 s on a loaded 2-core box); the long run:

    REPROKIT_FUZZ_EXAMPLES=500 python -m pytest -q -s tests/integration/test_fuzz_semantic.py
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rk_testing import NAN_STEP, reseal

from reprokit import bundle as B
from reprokit.cli import main

LONG_RUN = int(os.environ.get("REPROKIT_FUZZ_EXAMPLES", "0"))
REPLAY_CODES = {0, 1, 3, 125}
FAILING_STEP, WINDOW = NAN_STEP, [4, 5, 6]  # the shared NaN bundle's (conftest.py)


@dataclass(frozen=True)
class Edit:
    name: str
    apply: Callable[[Path], object]
    effect: str = "any"
    """``invalid``: an invalid bundle, every one whose failure can no longer be checked among them (verify lists
    it, replay must exit 3); ``hides``: a setting that must not hide the failure (alone, replay still exits 1);
    ``fixes``: may really fix the run (replay may exit 0); ``any``: any documented code but 0."""


# --- editing a bundle's files (the manifest is re-signed once, after every edit of an input) ----------------------

def _json(rel: str, fn: Callable[[Any], object]) -> Callable[[Path], object]:
    def apply(bundle: Path) -> None:
        doc = json.loads((bundle / rel).read_text())
        fn(doc)
        (bundle / rel).write_text(json.dumps(doc))
    return apply


def _run(fn: Callable[[dict], object]) -> Callable[[Path], object]:
    return _json(B.RUN, fn)


def _failure(fn: Callable[[dict], object]) -> Callable[[Path], object]:
    return _json(B.FAILURE, fn)


def _window(steps: list[int]) -> Callable[[Path], object]:
    def edit(run: dict) -> None:
        run["window"]["steps"] = steps
        if steps:
            run["window"]["start"], run["window"]["end"] = steps[0], steps[-1]
    return _run(edit)


def _detect(key: str, value: Any) -> Callable[[Path], object]:
    return _run(lambda run: run["recorder"]["detect"].__setitem__(key, value))


def _tensor(rel: str, key: str, fn: Callable[[Any], Any]) -> Callable[[Path], object]:
    def apply(bundle: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(bundle / rel)
        tensors[key] = fn(tensors[key])
        save_file(tensors, bundle / rel)
    return apply


def _dtype(rel: str, key: str, dtype: str) -> Callable[[Path], object]:
    import torch

    return _tensor(rel, key, lambda t: t.to(getattr(torch, dtype)))


def _code(name: str, text: str | bytes | None = None, append: str = "") -> Callable[[Path], object]:
    """Write ``code/NAME`` (``text``, or the file as it is plus ``append``) and list it in the manifest."""
    def apply(bundle: Path) -> None:
        p = bundle / "code" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        data = text if text is not None else p.read_text() + append
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        m = json.loads((bundle / B.MANIFEST).read_text())
        m["files"].setdefault(f"code/{name}", {"sha256": "0" * 64, "size": 0})  # digest: reseal
        (bundle / B.MANIFEST).write_text(json.dumps(m))
    return apply


STEP = f"steps/{FAILING_STEP:08d}.safetensors"
EDITS = [
    # window / failure / detector consistency
    Edit("drop the failing step", _window([4, 5]), "invalid"),
    Edit("empty window", _window([]), "invalid"),
    Edit("window names a step it has no file for", _window([4, 5, 6, 7]), "invalid"),
    Edit("failure moved before the window", _failure(lambda f: f.__setitem__("step", 3)), "invalid"),
    Edit("failure moved past the window", _failure(lambda f: f.__setitem__("step", 9)), "invalid"),
    Edit("failure moved to the window's first step", _failure(lambda f: f.__setitem__("step", 4))),
    Edit("check_loss off", _detect("check_loss", False), "hides"),
    Edit("check_grads off", _detect("check_grads", False), "hides"),
    Edit("check_params on", _detect("check_params", True), "hides"),
    Edit("loss_from_mapping off", _detect("loss_from_mapping", False), "hides"),
    Edit("kind: nonfinite_grad", _failure(lambda f: (f.__setitem__("kind", "nonfinite_grad"),
                                                     f["signature"].__setitem__("kind", "nonfinite_grad")))),
    Edit("kind: nonfinite_param", _failure(lambda f: (f.__setitem__("kind", "nonfinite_param"),
                                                      f["signature"].__setitem__("kind", "nonfinite_param")))),
    Edit("kind: loss_spike without spike_factor", _failure(lambda f: (f.__setitem__("kind", "loss_spike"),
                                                                      f["signature"].__setitem__("kind", "loss_spike"))),
         "invalid"),
    Edit("kind: predicate without predicates", _failure(lambda f: (f.__setitem__("kind", "predicate"),
                                                                   f["signature"].__setitem__("kind", "predicate"))),
         "invalid"),
    Edit("kind: exception", _failure(lambda f: (f.update(kind="exception", exc_type="ValueError", message="boom"),
                                                f["signature"].update(kind="exception", exc_type="ValueError",
                                                                      message="boom")))),
    # dtypes
    *[Edit(f"parameter as {d}", _dtype(B.STATE_TENSORS, "model/0.weight", d)) for d in ("int32", "bool", "float64",
                                                                                        "float16", "bfloat16")],
    Edit("optimizer step as int64", _dtype(B.STATE_TENSORS, "optimizer/state/0/step", "int64")),
    Edit("optimizer moment as float16", _dtype(B.STATE_TENSORS, "optimizer/state/0/exp_avg", "float16")),
    Edit("torch RNG state as int64", _dtype(B.STATE_TENSORS, "rng/torch", "int64")),
    *[Edit(f"batch x as {d}", _dtype(STEP, "batch/x", d)) for d in ("float64", "int64", "bool", "float16")],
    Edit("batch y as int32", _dtype(STEP, "batch/y", "int32")),
    Edit("the NaN removed from the poisoned batch", _tensor(STEP, "batch/x", lambda t: t.nan_to_num(0.0)), "fixes"),
    # provenance shapes
    *[Edit(f"provenance {p!r}", _run(lambda run, p=p: run.__setitem__("provenance", p)))
      for p in ({}, {"seq_window": [0, 3]}, {"seq_window": [1]}, {"passes": {"rows": 5}}, [1, 2], "x",
                {"kept_rows": "0,1"}, {"kept_rows": [0, 1]}, None)],
    # code-file shapes
    Edit("code too deep to parse", _code("rk_mlp.py", append="x = " + "-" * 200_000 + "1\n"), "invalid"),
    Edit("code/triton.py", _code("triton.py", "raise SystemExit('ran code/triton.py')\n"), "invalid"),
    Edit("code/numpy.py", _code("numpy.py", "raise SystemExit('ran code/numpy.py')\n"), "invalid"),
    Edit("an unused module with a syntax error", _code("extra/broken.py", "def (:\n")),
    Edit("the step's module with a syntax error", _code("rk_mlp.py", append="\ndef (:\n")),
    Edit("the step's module without build", _code("rk_mlp.py", "import torch\n")),
    Edit("the step's module empty", _code("rk_mlp.py", "")),
    Edit("code that is not UTF-8", _code("rk_mlp.py", b"\xff\xfe\x00x = 1\n")),
    Edit("a .pyc in the snapshot", _code("__pycache__/rk_mlp.cpython-311.pyc", b"\x00" * 16), "invalid"),
]


def replay_json(bundle: Path) -> tuple[int, dict]:
    r = CliRunner().invoke(main, ["replay", str(bundle), "--json"])
    assert isinstance(r.exception, SystemExit) or r.exception is None, repr(r.exception)
    assert r.exit_code in REPLAY_CODES, (r.exit_code, r.output[-3000:])
    doc = json.loads(r.stdout)
    assert isinstance(doc, dict), r.stdout[:500]
    return r.exit_code, doc


def verify_code(bundle: Path) -> int:
    r = CliRunner().invoke(main, ["verify", str(bundle), "--json"])
    assert isinstance(r.exception, SystemExit) or r.exception is None, repr(r.exception)
    assert r.exit_code in (0, 1), (r.exit_code, r.output[-3000:])
    return r.exit_code


@pytest.fixture(scope="module")
def seed(shared_nan_bundle, tmp_path_factory, request):
    root = tmp_path_factory.mktemp("semantic")
    bundle = shared_nan_bundle
    run = json.loads((bundle / B.RUN).read_text())
    assert run["window"]["steps"] == WINDOW and json.loads((bundle / B.FAILURE).read_text())["step"] == FAILING_STEP
    assert replay_json(bundle)[0] == 1, "the seed reproduces"  # and warms up every import
    seen: dict[str, int] = {}
    yield {"root": root, "bundle": bundle, "seen": seen}
    line = "semantic fuzz: replay exits " + ", ".join(f"{k}: {v}" for k, v in sorted(seen.items()))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    print(line)
    if reporter is not None:
        reporter.write_line(line)


_counter = [0]


def _named(*names: str) -> list[Edit]:
    return [next(e for e in EDITS if e.name == n) for n in names]


@given(edits=st.lists(st.sampled_from(EDITS), min_size=1, max_size=3, unique_by=lambda e: e.name))
@settings(max_examples=LONG_RUN or 24, deadline=None, database=None, derandomize=not LONG_RUN, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@example(edits=_named("check_loss off", "check_grads off"))  # both checks off is no fix: still reproduces
@example(edits=_named("empty window", "check_loss off"))
@example(edits=_named("the NaN removed from the poisoned batch"))  # a real fix: the one edit that may say 0
@pytest.mark.slow
def test_semantic_lies_get_documented_answers_and_never_a_false_fixed(seed, edits):
    _counter[0] += 1
    bundle = Path(shutil.copytree(seed["bundle"], seed["root"] / f"case{_counter[0]}" / seed["bundle"].name))
    try:
        for e in edits:
            e.apply(bundle)
        reseal(bundle)
        effects = {e.effect for e in edits}
        verified = verify_code(bundle)
        code, doc = replay_json(bundle)
        seen = seed["seen"]
        seen[f"{code}"] = seen.get(f"{code}", 0) + 1
        names = [e.name for e in edits]
        if "invalid" in effects:
            assert verified == 1 and code == 3, (names, verified, code, doc)
        if effects == {"hides"}:
            assert verified == 0 and code == 1, (names, code, doc)
        if code == 0:
            assert "fixes" in effects, ("called fixed", names, doc)
    finally:
        shutil.rmtree(bundle.parent, ignore_errors=True)


@pytest.mark.slow
def test_every_edit_keeps_the_json_it_edits_parseable_and_the_manifest_valid(seed, tmp_path):
    """The edits are semantic, not byte damage: each one, alone and re-signed, leaves no checksum problem (so the
    property above tests the readers' judgement, not the checksums)."""
    for e in EDITS:
        bundle = Path(shutil.copytree(seed["bundle"], tmp_path / e.name.replace(" ", "_").replace("/", "_")
                                      / seed["bundle"].name))
        e.apply(bundle)
        reseal(bundle)
        problems = B.verify(bundle)
        assert not any("checksum" in p["problem"] or "size mismatch" in p["problem"] for p in problems), (e.name,
                                                                                                        problems)
