"""Replaying a bundle whose failure is a device error: the triage a person would do, done for them.

A sticky CUDA error (a device-side assert) says nothing about what broke, and it kills the process that hits it.
So a ``device_error`` bundle is replayed in three parts:

1. **On the CPU first**, with the bundle's state and batches loaded there: an out-of-range index is a clean
   exception on the CPU (``IndexError: index out of range in self``), the GPU face of which is the device-side
   assert. On a machine with a GPU this run is a child process that sees no GPU (``CUDA_VISIBLE_DEVICES=""``: code
   that picks ``cuda`` when it is available picks the CPU, and a Trainer runs there); on a CPU-only machine it runs
   in reprokit's own process (nothing there can poison a GPU).
2. **The culprit named**: during the failing step, :class:`reprokit.locate_index.IndexWatch` checks the indices of
   every indexing op before it runs, and :func:`reprokit.locate_index.locate` finds the offending value in the
   batch: ``step 31204, micro 0, input_ids row 13 (dataset index 777), position 7: id 1000 >= num_embeddings 1000
   of transformer.wte``. Without such an op, the batch checks of :mod:`reprokit.diagnose` still run.
3. **On the GPU**, where there is one: the recorded step replayed in a child process (:mod:`reprokit.isolation`)
   must die the same way.

:func:`reprokit.replayer.replay` runs the three parts for a ``device_error`` bundle. The verdict: on a GPU,
``reproduced`` means the same device error at the same step; without one (or with ``--device cpu``), the CPU face
of it at the same step (``IndexError``, or a ``RuntimeError`` saying an index is out of bounds:
:func:`reprokit.device_error.cpu_face`). ``triage.reproduced_as`` says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reprokit import diagnose
from reprokit.bundle import Bundle
from reprokit.device_error import cpu_face
from reprokit.errors import ReprokitError
from reprokit.isolation import IsolatedRunner
from reprokit.locate_index import IndexWatch, locate
from reprokit.outcome import RunOutcome
from reprokit.signature import summary_line

HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
"""The environment of the CPU triage's child process on a machine with GPUs."""


def watched_run(session: Any) -> tuple[RunOutcome, dict[str, Any]]:
    """One run of ``session``'s window (a :class:`reprokit.replayer.Session`) with the indexing ops watched during
    the recorded failing step; returns the run and ``{"culprit": ..., "batch_findings": [...]}`` (see the module
    docstring). Also what the isolation server runs for a triage request."""
    inputs = session.inputs()
    step = session.recorded.step
    watch = IndexWatch(session.state.model)
    entered: list[IndexWatch] = []
    before = session.on_step

    def on_step(what: str, k: int, loss: float | None) -> None:
        if k == step and what == "started" and not entered:
            entered.append(watch.__enter__())  # only the failing step pays for the watch
        elif k == step and what == "finished" and entered:
            watch.__exit__(None, None, None)
            entered.clear()
        if before is not None:
            before(what, k, loss)

    session.on_step = on_step
    try:
        out = session.run(inputs)
    finally:
        session.on_step = before
        if entered:
            watch.__exit__(None, None, None)
    batch = next((inp.batch for inp in inputs if inp.step == step), None)
    culprit = locate(watch.finding, batch, step) if batch is not None else None
    checks = diagnose.summary(diagnose.findings(batch, session.bundle.run.get("model")), limit=5) \
        if batch is not None else []
    return out, {"culprit": culprit, "batch_findings": checks}


NO_GPU_TEXTS = ("No CUDA GPUs are available", "Found no NVIDIA driver", "no CUDA-capable device",
                "Torch not compiled with CUDA", "CUDA driver initialization failed")
"""What a run's code raises when it asks for a GPU in a process that sees none (``build`` with ``device="cuda"``)."""


def cpu_in_child(bundle: Bundle, code: str | Path | None) -> dict[str, Any]:
    """The CPU part on a machine with GPUs: one watched run in a child process that sees none. Where the run's code
    cannot start without a GPU (its ``build`` puts the model on ``cuda``, as a config that names the device does),
    again in a child that sees them: the replay still moves the state and batches to the CPU (``device="cpu"``),
    and the result says so (``gpus_visible``)."""
    first = _cpu_attempt(bundle, code, HIDE_GPUS)
    error = first["cpu"]["error"] or ""
    if not any(text in error for text in NO_GPU_TEXTS):
        return first
    second = _cpu_attempt(bundle, code, {})
    if second["cpu"]["error"]:
        return first  # the retry did not start either: the first attempt's error says why
    second["cpu"]["gpus_visible"] = (f"the run's code needs a GPU to start ({error.splitlines()[0][:200]}), so the "
                                     "CPU replay ran in a child that sees the GPUs, with the state and batches on "
                                     "the CPU")
    return second


def _cpu_attempt(bundle: Bundle, code: str | Path | None, env: dict[str, str]) -> dict[str, Any]:
    try:
        with IsolatedRunner(env=env) as runner:
            attempt = runner.attempt(bundle.path, recorded=bundle.failure, device="cpu", code=code, triage=True)
    except ReprokitError as e:
        return {"cpu": {"verdict": "error", "failure": None, "cpu_face": False, "error": str(e)}, "culprit": None,
                "batch_findings": []}
    if attempt.outcome is None:
        return {"cpu": {"verdict": "error", "failure": None, "cpu_face": False, "error": "timed out"},
                "culprit": None, "batch_findings": []}
    found = attempt.triage or {}
    return {"cpu": cpu_summary(attempt.outcome), "culprit": found.get("culprit"),
            "batch_findings": found.get("batch_findings") or []}


def cpu_summary(out: RunOutcome) -> dict[str, Any]:
    return {"verdict": out.verdict, "failure": out.failure.summary() if out.failure else None,
            "cpu_face": cpu_face(out.failure), "error": None}


def triage_lines(t: dict[str, Any] | None, recorded_step: int | None) -> list[str]:
    """The lines ``reprokit replay`` prints about the triage of a device-error bundle (none for other bundles): what
    the verdict rests on, the CPU run (where the GPU gave the verdict), the culprit, and the GPU's part."""
    if not t:
        return []
    out = []
    gpu, cpu = t.get("gpu") or {}, t.get("cpu") or {}
    failure = cpu.get("failure")
    face = f"{failure['exception_type']} at step {failure['step']}" if failure else None
    how = t.get("reproduced_as")
    if how == "device_error":
        out.append("  reproduced as: the same device error on the GPU, at the same step")
    elif how == "cpu_face":
        out.append(f"  reproduced as: its CPU face ({face}, the exception a GPU kernel asserts on instead); "
                   + ("a GPU would confirm the device error itself" if not gpu.get("checked") else
                      "the GPU did not fail the same way"))
    if gpu.get("checked"):
        if cpu.get("verdict") == "error":
            out.append(f"  on the CPU first: could not replay ({cpu.get('error')})")
        elif failure:
            is_face = cpu.get("cpu_face") and failure.get("step") == recorded_step
            out.append(f"  on the CPU first: {summary_line(failure)}" + (" (its CPU face)" if is_face else ""))
        else:
            out.append("  on the CPU first: the window ran clean")
    elif gpu:
        out.append(f"  on the GPU: not checked ({gpu.get('why_not')})")
    culprit = t.get("culprit")
    if culprit:
        out.append(f"  culprit: {culprit['message']}")
    else:
        out += [f"  batch: {line}" for line in t.get("batch_findings") or []]
    return out


__all__ = ["HIDE_GPUS", "NO_GPU_TEXTS", "cpu_in_child", "cpu_summary", "triage_lines", "watched_run"]
