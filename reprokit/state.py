"""Capture and restore everything a training step depends on.

A snapshot is ``(tree, tensors)`` as produced by :func:`reprokit.pytree.encode`:
model / optimizer / scheduler / scaler ``state_dict()``s plus RNG state. The
recorder keeps the latest one in memory; a bundle stores it in ``state/``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from reprokit import pytree, rng
from reprokit.errors import BundleError, CaptureError, StateMismatchError

MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
RNG = "rng"
EXTRA = "extra"
GRADS = "grads"
SHARDS = "shards"
"""Key of the state tree that describes sharded tensors (FSDP2's DTensors): ``{tensor key: layout}``."""
COMPONENTS = (MODEL, OPTIMIZER, SCHEDULER, SCALER)
MODES = "modes"
"""Key of the state tree: ``{module name: training}`` for the submodules whose train/eval mode is not the model's."""
BUFFERS = "buffers"
"""Key of the state tree: the model's non-persistent buffers, which a ``state_dict`` leaves out. The recorder does
not snapshot them (``build`` makes them); a replay session's own snapshots do (see :func:`volatile_buffers`)."""
FROZEN = "frozen"
"""Key of the state tree: the names of the parameters that do not require grad (a frozen backbone)."""
OUTSIDE_GRADS = "outside_grads"
"""Key of the state tree: ``{optimizer index: grad}`` of the optimizer's parameters that are not the model's (a
learnable temperature kept in ``extra``); present whenever there are such parameters, empty when none had a grad."""


@dataclass(kw_only=True)
class TrainState:
    """What ``build(config)`` returns and what the step function receives.

    Attributes:
        model: the ``nn.Module`` being trained.
        optimizer: its optimizer (any ``torch.optim.Optimizer``, or a wrapper of one such as accelerate's
            ``AcceleratedOptimizer``: your step keeps calling the wrapper, reprokit hooks the optimizer inside).
        scheduler: an LR scheduler (or accelerate's ``AcceleratedScheduler``), or ``None``.
        scaler: a ``torch.amp.GradScaler``, or ``None``.
        extra: free-form state your step needs (counters, EMA models' state
            dicts...): tensors, numbers, strings and containers of those. It is
            snapshotted and restored with the rest.

    Example:
        >>> m = torch.nn.Linear(2, 1)
        >>> st = TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    scaler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise CaptureError(f"TrainState.model must be a torch.nn.Module, got {type(self.model).__qualname__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise CaptureError(
                f"TrainState.optimizer must be a torch.optim.Optimizer, got {type(self.optimizer).__qualname__}"
            )
        _hook_through(self.optimizer)

    def scaler_enabled(self) -> bool:
        return self.scaler is not None and bool(getattr(self.scaler, "is_enabled", lambda: True)())


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The optimizer that really steps: ``opt`` itself, or the one a wrapper keeps in ``.optimizer``.

    accelerate's ``AcceleratedOptimizer`` subclasses ``Optimizer`` without running its ``__init__``, so it has no
    step-hook registry of its own; it delegates ``state``, ``param_groups``, ``state_dict`` and ``step`` to the
    optimizer it wraps.
    """
    inner = opt
    while not hasattr(inner, "_optimizer_step_pre_hooks") and isinstance(getattr(inner, "optimizer", None),
                                                                         torch.optim.Optimizer):
        inner = inner.optimizer
    return inner


def accumulation_phase(opt: Any) -> tuple[bool, bool, int]:
    """``(at_boundary, last_batch, steps)`` for a step about to start under accelerate's gradient accumulation.

    ``Accelerator.accumulate`` syncs (steps the optimizer) when its own counter, which no ``state_dict`` holds,
    reaches ``gradient_accumulation_steps``, or on a prepared dataloader's last batch. Replay's ``build`` makes a
    fresh ``Accelerator`` (counter 0), so a window must start right after a synced step (``at_boundary``: the
    last ``accumulate`` synced, or none ran yet), and must not run past a last batch (``last_batch``), whose early
    sync replay, fed from the bundle and not from the dataloader, would not make. ``steps``: the batches one update
    accumulates. ``(True, False, 1)`` for anything else (a plain optimizer, no accumulation).
    """
    grad_state = getattr(opt, "gradient_state", None)
    steps = int(getattr(grad_state, "num_steps", 1) or 1) if grad_state is not None else 1
    if steps <= 1 or type(opt).__module__.split(".")[0] != "accelerate":
        return True, False, 1
    last = bool(getattr(grad_state, "sync_with_dataloader", True) and getattr(grad_state, "end_of_dataloader", False))
    return bool(getattr(grad_state, "sync_gradients", True)), last, steps


def _hook_through(opt: torch.optim.Optimizer) -> None:
    """Step hooks registered on a wrapper land on the optimizer it wraps (the wrapper's ``step`` calls that one's).

    The wrapper itself stays what the step function calls, so what it adds around the step (accelerate's
    gradient-sync check and GradScaler) still runs, while recording and on replay.
    """
    inner = unwrap_optimizer(opt)
    if inner is not opt and hasattr(inner, "_optimizer_step_pre_hooks"):
        opt.register_step_pre_hook = inner.register_step_pre_hook  # type: ignore[method-assign]
        opt.register_step_post_hook = inner.register_step_post_hook  # type: ignore[method-assign]


# --- RNG (see reprokit.rng) -------------------------------------------------

def capture_rng(extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Every recorded generator's state now, in bundle form (see :mod:`reprokit.rng`)."""
    return rng.encode(rng.capture(extra))


def restore_rng(tree: dict[str, Any], tensors: dict[str, torch.Tensor], extra: dict[str, Any] | None = None) -> None:
    """Set every generator a snapshot or step recorded (``extra``: where the run's own generators live)."""
    rng.restore(tree, tensors, extra)


# --- training state --------------------------------------------------------

def capture_state(state: TrainState, copy: pytree.TensorCopy | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Snapshot model, optimizer, scheduler, scaler, live gradients and ``extra`` (not RNG).

    Gradients are part of the state: a snapshot taken between the micro-batches of a
    gradient-accumulation loop must carry what ``.grad`` holds, or replay starts the
    accumulation from nothing. A parameter whose ``.grad`` is None is left out (and restored
    as None); a loop that calls ``zero_grad(set_to_none=True)`` after its optimizer step has
    no gradients at step start and pays nothing for this. Generators in ``extra`` are stored
    as markers here; their states travel with the RNG (see :mod:`reprokit.rng`).

    Raises:
        CaptureError: naming the component and path that cannot be recorded.
    """
    tensors: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[str, Any]] = {}
    kw: dict[str, Any] = {"tensors": tensors, "shards": shards}
    if copy is not None:
        kw["copy"] = copy
    tree: dict[str, Any] = {"training": state.model.training, FROZEN: frozen_params(state.model)}
    modes = module_modes(state.model)
    if modes:
        tree[MODES] = modes
    grads = {name: p.grad for name, p in state.model.named_parameters() if p.grad is not None}
    parts = {
        MODEL: state.model.state_dict(),
        OPTIMIZER: state.optimizer.state_dict(),
        SCHEDULER: state.scheduler.state_dict() if state.scheduler is not None else None,
        SCALER: scaler_state(state.scaler) if state.scaler is not None else None,
        EXTRA: rng.marked(state.extra),
    }
    if grads:
        parts[GRADS] = grads
    outside = _outside_params(state)
    if outside is not None:
        parts[OUTSIDE_GRADS] = {i: p.grad for i, p in outside.items() if p.grad is not None}
    for name, sd in parts.items():
        try:
            tree[name], _ = pytree.encode(sd, name, skip_callables=(name == SCHEDULER), **kw)
        except CaptureError as e:
            raise CaptureError(f"cannot capture the {name} state: {e}") from None
    if shards:
        tree[SHARDS] = shards
    return tree, tensors


UNCLONED_BYTES = 1 << 30
"""Optimizer state from this size up is not cloned on the host before a GPU model's optimizer copies it to the device."""


def restore_state(state: TrainState, tree: dict, tensors: dict[str, torch.Tensor],
                  owned: Collection[str] = ()) -> None:
    """Load a snapshot made by :func:`capture_state` into ``state`` in place.

    ``owned`` names tensors of ``tensors`` that nothing else holds (copies made for this restore): the optimizer's
    are handed to it as they are, where any other tensor is cloned first so that the snapshot survives the restore;
    the model's are removed from ``tensors`` once loaded, so that their memory is free before the optimizer loads.

    Raises:
        StateMismatchError: when the snapshot does not fit what ``build`` made
            (missing/unexpected keys, shape mismatch), saying which.
    """
    device = _model_device(state.model)
    if tree.get(SHARDS):
        tensors = _as_shards(state, tree[SHARDS], tensors, device)
    model_sd = _ddp_prefix(pytree.decode(tree[MODEL], tensors), state.model.state_dict().keys())
    _adopt_dtypes(state.model, model_sd)
    try:
        state.model.load_state_dict({k: v.to(device) if isinstance(v, torch.Tensor) else v
                                     for k, v in model_sd.items()})
    except RuntimeError as e:
        raise StateMismatchError(f"the recorded model state does not fit the model that build() made: {e}") from None
    del model_sd
    for k in [k for k in owned if k.startswith(MODEL + "/")]:
        tensors.pop(k, None)
    _restore_modes(state.model, tree)
    # The snapshot must survive any number of restores, and optimizers keep the tensors they are given when
    # dtype and device match: they get clones. Except for a large optimizer state on the host for a model on
    # the GPU (1 GiB or more: a host clone of a 20 GB state would hold it twice in memory): its tensors are
    # handed over as they are, since the optimizer's own move to the parameter's device copies them; scalars
    # (Adam's CPU `step`, kept as given) are still cloned, and anything kept as given is copied below.
    opt = {k: v for k, v in tensors.items() if k.startswith(OPTIMIZER + "/")}
    large = device.type != "cpu" and sum(v.numel() * v.element_size() for v in opt.values()) >= UNCLONED_BYTES
    given = {k: v if k in owned or (large and v.device != device and v.numel() > 1) else v.clone()
             for k, v in opt.items()}
    shared = {v.data_ptr() for k, v in given.items() if k not in owned and v is tensors[k] and v.numel()}
    tensors = {k: v.clone() for k, v in tensors.items() if not k.startswith((MODEL + "/", OPTIMIZER + "/"))} | given
    opt_sd = pytree.decode(tree[OPTIMIZER], tensors)
    try:
        state.optimizer.load_state_dict(opt_sd)
    except (ValueError, KeyError, RuntimeError) as e:
        raise StateMismatchError(f"the recorded optimizer state does not fit the optimizer that build() made: {e}"
                                 f"{_groups_hint(opt_sd, state.optimizer)}") from None
    _keep_recorded_dtypes(state, opt_sd)
    del opt_sd
    if shared:  # a tensor the optimizer kept as given (a custom optimizer, nested state) gets a copy of its own
        kept: list[bool] = []

        def own(v: torch.Tensor) -> torch.Tensor:
            if v.numel() and v.data_ptr() in shared:
                kept.append(True)
                return v.clone()
            return v

        for st in state.optimizer.state.values():
            for name, value in list(st.items()):
                kept.clear()
                copied = pytree.map_tensors(value, own)
                if kept:  # replaced only where something was kept: containers stay as the optimizer made them
                    st[name] = copied
    for name, obj in ((SCHEDULER, state.scheduler), (SCALER, state.scaler)):
        recorded = tree.get(name)
        if (recorded is None) != (obj is None):
            have = "has" if obj is not None else "has no"
            raise StateMismatchError(
                f"the bundle {'has no' if recorded is None else 'has a'} {name} state but build() {have} {name}"
            )
        if obj is not None:
            decoded = pytree.decode(recorded, tensors)
            obj.load_state_dict(_scaler_numbers(decoded) if name == SCALER else decoded)
    _reset_scaler_step(state.scaler)
    grads = pytree.decode(tree.get(GRADS, {}), tensors)
    _restore_grads(state.model, _ddp_prefix(grads, dict(state.model.named_parameters()).keys(), some=True), device)
    _restore_outside_grads(state, tree, tensors)
    extra = rng.unmarked(pytree.decode(tree.get(EXTRA, {}), tensors), state.extra)
    merged = _into_live(extra, state.extra, device)
    if merged is not state.extra:  # not a dict subclass that took the update
        state.extra.clear()
        state.extra.update(merged)


def _into_live(recorded: Any, live: Any, device: torch.device) -> Any:
    """``recorded`` (a decoded ``extra``, its tensors copies of the snapshot's) put into the live objects where they
    fit: a tensor (or numpy array) of the same shape and dtype is copied into in place, a dict or list updated in place.

    The step may reach them by another way than ``state.extra``: a learnable scalar kept in ``extra`` is also in the
    optimizer's parameters, and a new tensor in its place (which no longer requires grad) would leave the optimizer
    stepping the old one. Anything else takes the recorded value (a tensor on the model's device).
    """
    if isinstance(recorded, torch.Tensor):
        if type(live) in (torch.Tensor, torch.nn.Parameter) and live.shape == recorded.shape \
                and live.dtype == recorded.dtype:
            try:
                with torch.no_grad():
                    live.copy_(recorded)
                return live
            except RuntimeError:  # an inference tensor, say: replaced instead
                pass
        return recorded.to(device)
    if isinstance(recorded, np.ndarray):
        if isinstance(live, np.ndarray) and live.shape == recorded.shape and live.dtype == recorded.dtype \
                and live.flags.writeable:
            live[...] = recorded
            return live
        return recorded.copy()
    if isinstance(recorded, dict):
        out = {k: _into_live(v, live.get(k) if isinstance(live, dict) else None, device) for k, v in recorded.items()}
        if isinstance(live, dict):
            live.clear()
            live.update(out)
            return live
        return out
    if isinstance(recorded, (list, tuple)):
        items = [_into_live(v, live[i] if isinstance(live, (list, tuple)) and i < len(live) else None, device)
                 for i, v in enumerate(recorded)]
        if isinstance(recorded, tuple):
            return tuple(items)
        if isinstance(live, list):
            live[:] = items
            return live
        return items
    return recorded


_SCALER_LAYOUT: dict[str, bool] = {}
"""Per device type: whether :func:`scaler_state`'s reads were checked against ``GradScaler.state_dict()`` on a
probe scaler of that device (:func:`check_scaler_layout`), and matched."""

_SCALER_NUMBERS = (("scale", float), ("_growth_tracker", int))
"""The two entries of a GradScaler's ``state_dict()`` it reads from the device (each an ``.item()``)."""

_SCALER_METHODS = ("state_dict", "get_scale", "_get_scale_async", "_get_growth_tracker")


def scaler_state(scaler: Any) -> dict[str, Any]:
    """A GradScaler's ``state_dict()``, with the scale and the growth tracker as the device tensors they live in.

    ``GradScaler.state_dict()`` reads both with ``.item()``: two host-device syncs per snapshot, which would make the
    host wait for every step it has queued. Here, for a scaler on a GPU, they are taken as 0-dim tensors, copied with
    the rest of the snapshot (no wait; the bundle holds them as tensors), and turned back into numbers on restore
    (:func:`_scaler_numbers`). That reads private attributes (``_scale``, ``_growth_tracker`` and the three factors),
    so it is used only where :func:`check_scaler_layout` has confirmed, on this torch and device type, that they are
    what ``state_dict()`` returns, and for a scaler whose ``state_dict`` and the methods it reads through are
    ``torch.amp.GradScaler``'s own; any other scaler gets its ``state_dict()``.
    """
    base = getattr(torch.amp, "GradScaler", None)
    if base is None or any(getattr(type(scaler), m, None) is not getattr(base, m, None) for m in _SCALER_METHODS) \
            or not bool(getattr(scaler, "is_enabled", lambda: False)()):
        return scaler.state_dict()
    fast = _scaler_reads(scaler)
    if fast is None or not _SCALER_LAYOUT.get(fast["scale"].device.type):
        return scaler.state_dict()  # on the CPU, before the first scaled step, or unchecked: no read to avoid
    return fast


def _scaler_reads(scaler: Any, cpu: bool = False) -> dict[str, Any] | None:
    """``state_dict()``'s entries read without a sync (scale and growth tracker as 0-dim device tensors), or None
    where they are not both one-element tensors off the CPU (``cpu``: or on it)."""
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if not isinstance(scale, torch.Tensor) or not isinstance(tracker, torch.Tensor) or \
            not all(t.numel() == 1 and (cpu or t.device.type != "cpu") for t in (scale, tracker)):
        return None
    return {"scale": scale.detach().reshape(()), "growth_factor": getattr(scaler, "_growth_factor", None),
            "backoff_factor": getattr(scaler, "_backoff_factor", None),
            "growth_interval": getattr(scaler, "_growth_interval", None),
            "_growth_tracker": tracker.detach().reshape(())}


def check_scaler_layout(device: torch.device | str) -> bool:
    """Whether :func:`scaler_state` may read a GradScaler on ``device``'s type without ``state_dict()``: a probe
    scaler on ``device`` (the model's: no context is made on another GPU), given known values through the public
    ``load_state_dict``, must read back through :func:`_scaler_reads` exactly as its ``state_dict()`` returns them.
    Done once per device type (it synchronizes: call it when a Recorder is set up, never in a step); any error
    counts as a mismatch."""
    device = torch.device(device)
    device_type = device.type
    if device_type not in _SCALER_LAYOUT:
        try:
            probe = torch.amp.GradScaler(device_type, init_scale=3.0, growth_factor=4.0, backoff_factor=0.25,
                                         growth_interval=7)
            probe.scale(torch.ones((), device=device))  # makes its device tensors, on that device
            probe.load_state_dict({"scale": 96.0, "growth_factor": 4.0, "backoff_factor": 0.25,
                                   "growth_interval": 7, "_growth_tracker": 5})
            fast, plain = _scaler_reads(probe, cpu=True), probe.state_dict()
            _SCALER_LAYOUT[device_type] = fast is not None and list(fast) == list(plain) and \
                _scaler_numbers(fast) == plain
        except Exception:
            _SCALER_LAYOUT[device_type] = False
    return _SCALER_LAYOUT[device_type]


def _scaler_numbers(sd: dict[str, Any]) -> dict[str, Any]:
    """A recorded GradScaler state as ``load_state_dict`` takes it: the scale and growth tracker as Python numbers
    (:func:`scaler_state` records them as tensors)."""
    out = dict(sd)
    for key, kind in _SCALER_NUMBERS:
        if isinstance(out.get(key), torch.Tensor):
            out[key] = kind(out[key].item())
    return out


def _reset_scaler_step(scaler: Any) -> None:
    """Forget what a GradScaler noted about the step in progress (``unscale_`` called, inf checks found).

    A snapshot is taken at a step start, where ``update()`` has cleared these; a replayed step that raised between
    ``unscale_`` and ``update`` leaves them set, and ``load_state_dict`` keeps them: the next replay's ``unscale_``
    would raise "already been called". GradScaler has no public reset; this is what its ``update()`` does.
    """
    per_optimizer = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(per_optimizer, dict):
        per_optimizer.clear()  # a defaultdict: each optimizer gets a fresh record on its next use


def _as_shards(state: TrainState, shards: dict[str, dict[str, Any]], tensors: dict[str, torch.Tensor],
               device: torch.device) -> dict[str, torch.Tensor]:
    """The recorded local shards as DTensors laid out like the live model's (FSDP2): each shard goes back onto the
    device mesh of the parameter or buffer it belongs to, after checking that the layout is the recorded one."""
    live_sd = state.model.state_dict()
    params = dict(state.model.named_parameters())
    by_index = _optimizer_params(state)
    out = dict(tensors)
    for key, spec in shards.items():
        part, _, rest = key.partition("/")
        live: Any = None
        if part == MODEL:
            live = live_sd.get(rest)
        elif part == GRADS:
            live = params.get(rest)
        elif part == OPTIMIZER and rest.startswith("state/"):
            live = by_index.get(rest.split("/")[1])
        if live is None or not pytree.is_dtensor(live) or key not in tensors:
            raise StateMismatchError(
                f"the bundle holds a shard of {key} (a sharded, FSDP2 state recorded on a mesh of "
                f"{spec.get('mesh_shape')} ranks) but the model that build() made has no sharded tensor there: replay "
                "the incident on as many ranks (`reprokit replay INCIDENT_DIR --nproc N`) with build() sharding the "
                "model as the run did")
        layout = pytree.shard_spec(live)
        if layout["placements"] != spec["placements"] or layout["shape"] != spec["shape"] \
                or layout["local_shape"] != list(tensors[key].shape):
            raise StateMismatchError(
                f"{key}: recorded as a shard {spec['local_shape']} of {spec['shape']} placed {spec['placements']} "
                f"on a mesh of {spec['mesh_shape']}, but build() made a shard {layout['local_shape']} of "
                f"{layout['shape']} placed {layout['placements']} on a mesh of {layout['mesh_shape']}: replay on "
                "as many ranks as the run had, sharded the same way")
        DTensor: Any = pytree.dtensor_class()  # live is one
        local = tensors[key].to(device=live.to_local().device)
        out[key] = DTensor.from_local(local, live.device_mesh, live.placements, run_check=False,
                                      shape=live.shape, stride=live.stride())
    return out


def _optimizer_params(state: TrainState) -> dict[str, torch.Tensor]:
    """The live parameter behind each index of the optimizer's state dict (``state/<index>/...``)."""
    live = [p for group in state.optimizer.param_groups for p in group["params"]]
    indices = [str(i) for i in range(len(live))]  # state_dict() numbers parameters in param_groups order
    return dict(zip(indices, live))


def _ddp_prefix(recorded: dict[str, Any], live: Any, some: bool = False) -> dict[str, Any]:
    """Recorded keys as the live model names them, when the two differ only by DDP's ``module.`` prefix (a bundle
    of a DistributedDataParallel model replayed in one process, where ``build`` made the bare model, or back).
    ``some``: the recorded keys name some of the live ones (gradients, modes, frozen parameters), not all."""
    live = set(live)
    fits = set.issubset if some else set.__eq__
    if fits(set(recorded), live):
        return recorded
    prefix = "module."
    if all(k.startswith(prefix) for k in recorded) and fits({k[len(prefix):] for k in recorded}, live):
        return {k[len(prefix):]: v for k, v in recorded.items()}
    if not any(k.startswith(prefix) for k in recorded) and fits({prefix + k for k in recorded}, live):
        return {prefix + k: v for k, v in recorded.items()}
    return recorded


def _keep_recorded_dtypes(state: TrainState, recorded: Any) -> None:
    """Optimizer state in the dtype it was recorded in. ``Optimizer.load_state_dict`` casts floating-point state to its
    parameter's dtype (meant for a checkpoint saved in another precision): an optimizer that keeps float32 moments for
    bfloat16 parameters (or float64 for float32) would replay with its state rounded."""
    saved = recorded.get("state") if isinstance(recorded, dict) else None
    if not isinstance(saved, dict):
        return
    params = _optimizer_params(state)
    for index, entries in saved.items():
        p = params.get(str(index))
        live = state.optimizer.state.get(p) if p is not None else None
        if not isinstance(entries, dict) or not isinstance(live, dict):
            continue
        for name, value in entries.items():
            now = live.get(name)
            if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and now.dtype != value.dtype \
                    and type(now) is torch.Tensor:
                live[name] = value.to(device=now.device, copy=True)


def _groups_hint(recorded: Any, optimizer: torch.optim.Optimizer) -> str:
    """Where the recorded parameter groups differ from the built ones: a group added or grown during the run."""
    groups = recorded.get("param_groups") if isinstance(recorded, dict) else None
    if not isinstance(groups, list):
        return ""
    had = [len(g.get("params", ())) for g in groups if isinstance(g, dict)]
    made = [len(g["params"]) for g in optimizer.param_groups]
    if had == made:
        return ""
    return (f" (parameters per group: recorded {had}, build() made {made}). Groups added with add_param_group (or "
            "grown) during the run are not replayed, since replay starts from build(): create every group in build(), "
            "as the run has them at the snapshot")


def _adopt_dtypes(model: torch.nn.Module, recorded: dict[str, Any]) -> None:
    """Parameters and buffers in the dtype the snapshot holds them in, where ``build`` made another one.

    ``load_state_dict`` copies values into the live tensors' dtype: a model that the loop cast after ``build`` (to
    float64, or bfloat16) would replay cast back, with other numbers. The live tensors keep their identity (the
    optimizer holds them); a step that casts the model itself casts it again, as it did when recording.
    """
    for key, value in recorded.items():
        if not isinstance(value, torch.Tensor):
            continue
        live: torch.Tensor
        try:
            live = model.get_parameter(key)
        except AttributeError:
            try:
                live = model.get_buffer(key)
            except AttributeError:
                continue  # extra state, or a name load_state_dict reports
        if live.dtype != value.dtype and type(live) in (torch.Tensor, torch.nn.Parameter):
            if live.requires_grad and not (value.is_floating_point() or value.is_complex()):
                # The recorder saw a parameter that takes gradients, so a floating one: this bundle was edited.
                raise BundleError(f"the state holds parameter {key!r} as {value.dtype}, but build() makes it a "
                                  f"{live.dtype} parameter that takes gradients, which must be floating point: the "
                                  "recorder never writes that, so the bundle was edited. Ask the sender for an intact "
                                  "copy.", [{"file": "state/state.json", "problem": f"parameter {key!r} is stored as "
                                                                                   f"{value.dtype}, not floating point"}])
            with torch.no_grad():
                live.grad = None  # restored after, in the new dtype
                live.data = live.data.to(value.dtype)


def _outside_params(state: TrainState) -> dict[str, torch.Tensor] | None:
    """The optimizer's parameters that are not the model's, by their index in its state dict (as a string); None when
    there are none, or when one is sharded (FSDP2: their gradients are left as they are)."""
    mine = {id(p) for p in state.model.parameters()}
    params = [p for group in state.optimizer.param_groups for p in group["params"]]  # state_dict()'s numbering
    outside = {str(i): p for i, p in enumerate(params) if id(p) not in mine}
    if not outside or any(type(p) not in (torch.Tensor, torch.nn.Parameter) for p in outside.values()):
        return None
    return outside


def _restore_outside_grads(state: TrainState, tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """``.grad`` of the optimizer's parameters outside the model as the snapshot had them (bundles that recorded them:
    a replay that raised after its backward left a gradient there, which the next replay's backward added to)."""
    recorded = tree.get(OUTSIDE_GRADS)
    outside = _outside_params(state)
    if recorded is None or outside is None:
        return
    grads = pytree.decode(recorded, tensors)
    unknown = sorted(set(grads) - set(outside))
    if unknown:
        raise StateMismatchError(f"the bundle holds gradients for optimizer parameters {', '.join(unknown[:5])} "
                                 "(by index), which the optimizer that build() made does not have outside the model")
    for i, p in outside.items():
        g = grads.get(i)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)  # a clone already


def _restore_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor], device: torch.device) -> None:
    """``.grad`` as the snapshot had it: the recorded tensor, or None for a parameter it has none for."""
    params = dict(model.named_parameters())
    unknown = sorted(set(grads) - set(params))
    if unknown:
        raise StateMismatchError(f"the bundle holds gradients for parameters the model that build() made lacks: "
                                 f"{', '.join(unknown[:5])}")
    for name, p in params.items():
        g = grads.get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)  # a clone already


def module_modes(model: torch.nn.Module) -> dict[str, bool]:
    """``{name: training}`` of every submodule whose mode differs from ``model``'s (a backbone kept in eval mode)."""
    return {name: m.training for name, m in model.named_modules() if name and m.training != model.training}


def frozen_params(model: torch.nn.Module) -> list[str]:
    """The names of the parameters that do not require grad."""
    return [name for name, p in model.named_parameters() if not p.requires_grad]


def _restore_modes(model: torch.nn.Module, tree: dict[str, Any]) -> None:
    """Train/eval mode of every module and ``requires_grad`` of every parameter, as the snapshot had them.

    Neither is in a ``state_dict``, and both change how a step computes: a submodule in eval mode (BatchNorm,
    dropout) switched back to train by ``model.train()``, or a layer unfrozen during the run that ``build`` makes
    frozen, replays other numbers. Bundles written before these were recorded hold only the model's own mode.
    """
    model.train(tree.get("training", True))
    modules = dict(model.named_modules())
    for name, training in _ddp_prefix(tree.get(MODES) or {}, modules.keys(), some=True).items():
        # A name the model lacks is a module without state (load_state_dict refused any other): renamed by the code
        # replayed (`--code`, `bisect commits`), which then is not the recorded code anyway.
        if name in modules:
            modules[name].training = bool(training)  # this module only: its children have entries of their own
    frozen = tree.get(FROZEN)
    if frozen is None:
        return
    params = dict(model.named_parameters())
    recorded = _ddp_prefix(dict.fromkeys(frozen), params.keys(), some=True)
    unknown = sorted(set(recorded) - set(params))
    if unknown:
        raise StateMismatchError(f"the bundle records frozen parameters that the model build() made lacks: "
                                 f"{', '.join(unknown[:5])}")
    for name, p in params.items():
        p.requires_grad_(name not in recorded)


def volatile_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's non-persistent buffers (``register_buffer(..., persistent=False)``), by name.

    ``load_state_dict`` does not touch them, so a step that changes one (a counter, a cache) changes what the next
    replay from the same snapshot starts with, unless the replay puts them back itself (:func:`put_buffers`).
    """
    persistent = model.state_dict().keys()
    return {name: b for name, b in model.named_buffers() if name not in persistent}


def put_buffers(model: torch.nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Set the named buffers to copies of ``buffers`` (in place where the live one has the same shape and dtype)."""
    live = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in buffers.items():
            cur = live.get(name)
            if cur is not None and cur.shape == value.shape and cur.dtype == value.dtype:
                cur.copy_(value)
            else:  # replaced by the step (another shape), or set to None: a buffer again, as the snapshot had it
                owner, _, leaf = name.rpartition(".")
                device = cur.device if cur is not None else _model_device(model)
                setattr(model.get_submodule(owner), leaf, value.to(device, copy=True))


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
