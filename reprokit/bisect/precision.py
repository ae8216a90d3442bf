"""``reprokit bisect precision``: replay the window under precision and kernel variants.

How variants reach user code (and the limits of that):

- ``fp32`` / ``bf16`` / ``fp16``: the step runs inside ``torch.autocast`` of the
  replay device (disabled for fp32), and ``torch.autocast`` / ``torch.amp.autocast``
  / ``torch.cuda.amp.autocast`` / ``torch.cpu.amp.autocast`` are replaced for the
  duration of the replay by a subclass that forces that dtype (or disables it), so
  autocast regions inside the user's step follow. For fp32, floating parameters and
  their optimizer state are upcast after every restore (restore puts the recorded
  dtypes back: a model trained with ``model.half()`` would otherwise replay in float16
  under the name fp32), and floating batch tensors too. Limits: code that bound
  ``autocast`` under another name before the replay started (``from torch import
  autocast``) is not patched; explicit ``.half()`` / ``.to(torch.float16)`` calls
  inside the step are not undone; fp16 uses the GradScaler only if ``build`` made one.

  Each of the three proves it ran as named: the parameter dtypes at each step's start,
  the loss dtype and the floating dtypes the model's modules returned are in
  ``dtypes``; fp32 must see only float32 parameters and loss, bf16 / fp16 their
  dtype among the parameters or module outputs. Otherwise the result is ``not_applied``
  (a float64 model under a bf16 autocast still computes in float64: autocast leaves
  float64 alone), never a pass or fail that a precision did not earn.
- ``tf32_on`` / ``tf32_off``: ``torch.backends.cuda.matmul.allow_tf32`` and
  ``torch.backends.cudnn.allow_tf32``; CUDA only (n/a on CPU).
- ``sdpa_*``: ``torch.nn.attention.sdpa_kernel`` restricted to one backend. n/a when
  the backend cannot run on this device (probed with a tiny attention call), when it
  cannot run this model's attention (the step raised "No available kernel"), or when
  the replay never called ``scaled_dot_product_attention`` (a model without
  attention: the backend choice changes nothing). Calls are counted with a
  ``TorchFunctionMode`` plus a wrapper of ``torch.nn.functional.scaled_dot_product_attention``
  (which ``nn.MultiheadAttention`` calls); attention computed without SDPA (explicit
  matmul + softmax, or inside a compiled graph) is not seen, and is not affected by
  these variants either, except in a compiled graph.
- ``deterministic``: ``torch.use_deterministic_algorithms(True)``; an op without a
  deterministic kernel then raises, which shows as ``different_failure``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from reprokit import pytree
from reprokit.bisect import registry
from reprokit.bundle import Bundle
from reprokit.env import apply_determinism_flags, determinism_flags
from reprokit.registry import bind
from reprokit.replayer import Session
from reprokit.signature import Failure

Variant = Callable[[Session], contextlib.AbstractContextManager[Any]]


@contextlib.contextmanager
def _autocast(s: Session, dtype: torch.dtype | None) -> Iterator[None]:
    """Force every autocast region to ``dtype`` (None: disabled), and wrap the step in one."""
    real = torch.amp.autocast_mode.autocast
    device = s.device.type

    class Forced(real):  # type: ignore[misc, valid-type]
        def __init__(self, device_type: str = device, dtype_: Any = None, enabled: bool = True,
                     cache_enabled: Any = None, **kw: Any) -> None:
            super().__init__(device, dtype=dtype or torch.float32, enabled=dtype is not None,
                             cache_enabled=cache_enabled)

    targets = [(torch, "autocast"), (torch.amp, "autocast")]
    for mod in (getattr(torch.cuda, "amp", None), getattr(torch.cpu, "amp", None)):
        if mod is not None and hasattr(mod, "autocast"):
            targets.append((mod, "autocast"))
    saved = [(m, n, getattr(m, n)) for m, n in targets]
    step_fn = s.step_fn

    def wrapped(state: Any, batch: Any) -> Any:
        with Forced(device):
            return step_fn(state, batch)

    try:
        for m, n, _ in saved:
            setattr(m, n, Forced)
        s.step_fn = wrapped
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # autocast warns about dtypes a device lacks; the result says it
            yield
    finally:
        s.step_fn = step_fn
        for m, n, v in saved:
            setattr(m, n, v)


def _upcast(state: Any) -> None:
    """The model in float32, and its optimizer state with it, as ``Optimizer.load_state_dict`` casts state to
    its parameter's dtype (all but ``step``): Adam's float16 moments beside float32 parameters would not run."""
    state.model.float()  # in place: the optimizer's parameters are these same tensors (their gradients follow)
    for group in state.optimizer.param_groups:
        for p in group["params"]:
            entries = state.optimizer.state.get(p)
            if not isinstance(entries, dict) or not p.is_floating_point():
                continue
            for k, v in entries.items():
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != p.dtype:
                    entries[k] = v.to(p.dtype)


@contextlib.contextmanager
def _fp32(s: Session) -> Iterator[None]:
    # After every restore, not once now: restore casts the parameters back to the dtypes the snapshot holds.
    s.after_restore.append(_upcast)
    try:
        with _autocast(s, None):
            yield
    finally:
        s.after_restore.remove(_upcast)


PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The variants that name a dtype, and it: each checks that the replay ran in it (see :func:`_not_as_named`)."""


class _Dtypes:
    """What a replay ran in: floating parameter dtypes at each step's start, the loss dtype, and the floating
    dtypes the modules' forwards returned (after autocast chose them). Module outputs, not every op: reprokit's
    own checks inside the step (the gradient norms, in float64) are no part of the model's compute."""

    def __init__(self) -> None:
        self.params: set[torch.dtype] = set()
        self.loss: set[torch.dtype] = set()
        self.outputs: set[torch.dtype] = set()

    def hook(self, module: Any, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            if out.is_floating_point():
                self.outputs.add(out.dtype)
        elif isinstance(out, (tuple, list, dict)):  # a ModelOutput is a dict
            for v in out.values() if isinstance(out, dict) else out:
                self.hook(module, args, v)

    def to_json(self) -> dict[str, list[str]]:
        return {k: _names(getattr(self, k)) for k in ("params", "loss", "outputs")}


def _names(dtypes: set[torch.dtype]) -> list[str]:
    return sorted(str(d).removeprefix("torch.") for d in dtypes)


@contextlib.contextmanager
def _watching_dtypes(s: Session) -> Iterator[_Dtypes]:
    """Wrap the step: parameter dtypes as it starts, the loss dtype as it returns, module outputs while it runs."""
    seen = _Dtypes()
    step_fn = s.step_fn

    def watched(state: Any, batch: Any) -> Any:
        seen.params |= {p.dtype for p in state.model.parameters() if p.is_floating_point()}
        handle = torch.nn.modules.module.register_module_forward_hook(seen.hook)
        try:
            loss = step_fn(state, batch)
        finally:
            handle.remove()
        value = loss.get("loss") if isinstance(loss, dict) else loss
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            seen.loss.add(value.dtype)
        return loss

    s.step_fn = watched
    try:
        yield seen
    finally:
        s.step_fn = step_fn


def _not_as_named(name: str, seen: _Dtypes) -> str | None:
    """Why variant ``name`` did not run in the dtype it names (None: it did)."""
    want = PRECISIONS[name]
    ran = _ran_in(seen)
    if not seen.params and not seen.outputs:
        return None  # no step ran (the replay failed before one did): nothing ran in any dtype
    if name == "fp32":
        if (seen.params | seen.loss) - {torch.float32}:
            return f"ran with {ran}, not float32"
        return None
    if want not in seen.params | seen.outputs:
        why = " (autocast leaves float64 alone)" if torch.float64 in seen.params | seen.outputs else ""
        return f"nothing ran in {_names({want})[0]}: {ran}{why}"
    return None


def _ran_in(seen: _Dtypes) -> str:
    parts = [f"{'+'.join(_names(seen.params)) or 'no floating'} parameters"]
    if seen.loss:
        parts.append(f"a {'+'.join(_names(seen.loss))} loss")
    if seen.outputs:
        parts.append(f"modules returning {'+'.join(_names(seen.outputs))}")
    return ", ".join(parts)


@contextlib.contextmanager
def _flags(**flags: bool) -> Iterator[None]:
    before = determinism_flags()  # every switch as it was, read without the legacy getters torch may refuse
    try:
        if "tf32" in flags:
            torch.backends.cuda.matmul.allow_tf32 = flags["tf32"]
            torch.backends.cudnn.allow_tf32 = flags["tf32"]
        if "deterministic" in flags:
            torch.use_deterministic_algorithms(flags["deterministic"])
        yield
    finally:
        apply_determinism_flags(before)


def _sdpa(name: str) -> Variant:
    @contextlib.contextmanager
    def variant(s: Session) -> Iterator[None]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, name)), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Flash attention kernel not used because ...": the result says it
            yield
    return variant


def _sdpa_available(name: str, device: torch.device) -> bool:
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return False
    if not hasattr(SDPBackend, name):
        return False
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 2, 8, 16, device=device, dtype=dtype)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with sdpa_kernel(getattr(SDPBackend, name)):
                torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return True
    except RuntimeError:
        return False


class _CountSDPA(torch.overrides.TorchFunctionMode):
    """Counts calls of ``scaled_dot_product_attention`` while active (however the user's code reached it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self._sdpa = torch.nn.functional.scaled_dot_product_attention

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is self._sdpa:
            self.calls += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _counting_sdpa() -> Iterator[_CountSDPA]:
    """``nn.MultiheadAttention`` reaches SDPA from inside ``multi_head_attention_forward``, which a
    function mode hands over with itself switched off: the module attribute is wrapped too."""
    F = torch.nn.functional
    real = F.scaled_dot_product_attention
    mode = _CountSDPA()

    def counted(*args: Any, **kwargs: Any) -> Any:
        mode.calls += 1
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = counted
    try:
        with mode:
            yield mode
    finally:
        F.scaled_dot_product_attention = real


_NO_KERNEL = ("No available kernel", "No viable backend")


def _no_kernel(failure: Failure | None) -> bool:
    """The step raised because the forced SDPA backend cannot run these inputs (dtype, shape, mask, device)."""
    return failure is not None and failure.exc_type == "RuntimeError" and any(m in failure.message for m in _NO_KERNEL)


def _available(name: str, device: torch.device) -> bool:
    if name in ("tf32_on", "tf32_off"):
        return device.type == "cuda"
    if name == "bf16":
        return device.type == "cpu" or torch.cuda.is_bf16_supported()
    if name.startswith("sdpa_"):
        return _sdpa_available(SDPA[name], device)
    return True


SDPA = {"sdpa_math": "MATH", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
        "sdpa_cudnn": "CUDNN_ATTENTION"}

VARIANTS: dict[str, Variant] = bind(registry.VARIANTS, {
    "recorded": lambda s: contextlib.nullcontext(),
    "tf32_off": lambda s: _flags(tf32=False),
    "tf32_on": lambda s: _flags(tf32=True),
    **{name: _sdpa(backend) for name, backend in SDPA.items()},
    "deterministic": lambda s: _flags(deterministic=True),
    "bf16": lambda s: _autocast(s, torch.bfloat16),
    "fp16": lambda s: _autocast(s, torch.float16),
    "fp32": _fp32,
}, "precision variants")
"""The context each variant of :data:`reprokit.bisect.registry.VARIANTS` (the one list, in its order) replays in."""


def bisect_precision(bundle: Bundle, *, device: str | None = None, code: Any = None,
                     variants: list[str] | None = None, progress: Callable[[str, str], None] | None = None
                     ) -> dict[str, Any]:
    """Replay the window under each variant: ``variants`` maps name to pass | fail | n/a | different_failure |
    not_applied (a precision variant that did not run in its dtype: ``details`` says what it ran in).
    ``dtypes`` holds, for fp32 / bf16 / fp16, the parameter, loss and op-result dtypes each replay saw."""
    names = variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        from reprokit.errors import ReprokitError

        raise ReprokitError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    results: dict[str, str] = {}
    details: dict[str, Any] = {}
    dtypes: dict[str, Any] = {}
    sdpa_calls: int | None = None  # during the recorded variant, once run
    for name in names:
        results[name], details[name], calls = _run_variant(bundle, name, device, code, sdpa_calls, dtypes)
        if name == "recorded":
            sdpa_calls = calls
        if progress:
            progress(name, results[name])
    fixes = [n for n in names if results[n] == "pass" and n != "recorded"]
    fix = fixes[0] if results.get("recorded") == "fail" and fixes else None
    out: dict[str, Any] = {"variants": results, "details": details, "dtypes": dtypes,
                           "reproduced": results["recorded"] == "fail" if "recorded" in results else None,
                           "smallest_fix": fix}
    if fix is not None:
        # Each variant ran once: a failure that does not recur on every replay would make a lucky pass a "fix".
        again = {n: _run_variant(bundle, n, device, code, sdpa_calls)[0] for n in ("recorded", fix)}
        if again != {"recorded": "fail", fix: "pass"}:
            out["smallest_fix"] = None
            out["note"] = (f"flaky: replayed once more, recorded gave {again['recorded']} and {fix} gave {again[fix]}, "
                           f"so no variant can be called a fix. Check `reprokit replay BUNDLE --times 5`; a flaky "
                           "verdict usually means a random generator outside state.extra, state kept outside "
                           "train_step, or a nondeterministic kernel")
    return out


def _run_variant(bundle: Bundle, name: str, device: str | None, code: Any, sdpa_calls: int | None,
                 dtypes: dict[str, Any] | None = None) -> tuple[str, str, int | None]:
    """Replay the window once under variant ``name``: (pass | fail | n/a | different_failure | not_applied, detail,
    SDPA calls). A precision variant puts what it ran in under ``dtypes[name]``."""
    sdpa = name.startswith("sdpa_")
    no_attention = ("n/a", "the replay never called scaled_dot_product_attention (no SDPA attention in this model), "
                           "so the SDPA backend changes nothing", None)
    with Session(bundle, device=device, code=code) as s:
        if sdpa and sdpa_calls == 0:
            return no_attention
        if not _available(name, s.device):
            return "n/a", f"not available on {s.device.type}", None
        inputs = s.inputs()
        if name == "fp32":
            inputs = [type(i)(i.step, pytree.map_tensors(i.batch, lambda t: t.float() if t.is_floating_point()
                                                         else t), i.rng, i.rng_tensors) for i in inputs]
        with VARIANTS[name](s), (_counting_sdpa() if sdpa or name == "recorded"
                                 else contextlib.nullcontext()) as counter, \
                (_watching_dtypes(s) if name in PRECISIONS else contextlib.nullcontext()) as seen:
            out = s.run(inputs)
        calls = counter.calls if counter is not None else None
        if sdpa and calls == 0:
            return no_attention
        if sdpa and _no_kernel(out.failure):
            assert out.failure is not None
            return "n/a", (f"the {SDPA[name]} backend cannot run this model's attention on "
                           f"{s.device.type}: {out.failure.message.splitlines()[0][:160]}"), calls
        steps = len(out.losses)
        result = "fail" if out.same else "different_failure" if out.failure else "pass"
        detail = out.failure.describe() if out.failure else f"passed {steps} step{'' if steps == 1 else 's'}"
        if seen is not None:
            if dtypes is not None:
                dtypes[name] = seen.to_json()
            wrong = _not_as_named(name, seen)
            if wrong is not None:  # its pass or fail says nothing about this precision
                return "not_applied", f"{wrong}; its replay: {detail}", calls
            detail += f" ({_ran_in(seen)})"
        return result, detail, calls


def format_precision(d: dict[str, Any]) -> str:
    lines = [f"  {n:<16}{v:<19}{d['details'][n]}" for n, v in d["variants"].items()]
    fix = d["smallest_fix"]
    if d.get("reproduced") is False:
        return "\n".join(lines)  # the caller says why no variant can be called a fix
    if d.get("note"):
        return "\n".join([*lines, f"note: {d['note']}"])
    lines.append(f"smallest change that makes the failure go away: {fix}" if fix else
                 "no single variant makes the failure go away")
    return "\n".join(lines)
