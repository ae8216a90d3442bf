"""Capture and restore everything a training step depends on.

A snapshot is ``(tree, tensors)`` as produced by :func:`reprokit.pytree.encode`:
model / optimizer / scheduler / scaler ``state_dict()``s plus RNG state. The
recorder keeps the latest one in memory; a bundle stores it in ``state/``.
"""

from __future__ import annotations

import ctypes
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from reprokit import pytree
from reprokit.errors import CaptureError, StateMismatchError

MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
SCALER = "scaler"
RNG = "rng"
EXTRA = "extra"
COMPONENTS = (MODEL, OPTIMIZER, SCHEDULER, SCALER)


@dataclass(kw_only=True)
class TrainState:
    """What ``build(config)`` returns and what the step function receives.

    Attributes:
        model: the ``nn.Module`` being trained.
        optimizer: its optimizer (any ``torch.optim.Optimizer``).
        scheduler: an LR scheduler, or ``None``.
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

    def scaler_enabled(self) -> bool:
        return self.scaler is not None and bool(getattr(self.scaler, "is_enabled", lambda: True)())


# --- RNG -------------------------------------------------------------------

def _words_address(owner: Any, addr: int, size: int, expected: Callable[[Any], bytes], *,
                   getstate: Callable[[], Any], setstate: Callable[[Any], Any], draw: Callable[[], Any]) -> int | None:
    """``addr`` if the ``size`` bytes there are a generator's words, else None.

    They must lie inside ``owner``, equal ``expected(getstate())`` before and after a
    draw, and move with the draw; the state is put back afterwards.
    """
    try:
        if addr < id(owner) or addr + size > id(owner) + type(owner).__basicsize__:
            return None  # not the layout we know: reading there could leave the object
        saved = getstate()
        before = ctypes.string_at(addr, size)
        try:
            ok = before == expected(saved)
            draw()
            after = ctypes.string_at(addr, size)
            ok = ok and after != before and after == expected(getstate())
        finally:
            setstate(saved)
        return addr if ok else None
    except Exception:
        return None


class _PythonGlobalRNG:
    """``random.getstate()`` for the module-level generator, plus its state as a tensor, cached.

    ``getstate()`` builds a 625-tuple (~10 us, several times that right after a training
    step); the object's own words (``int index; uint32_t state[624]`` after the object
    header in CPython's ``_random`` module) read in ~1 us. The layout is checked against
    ``getstate()`` once, and a draw must move it (then the state is put back); on any
    mismatch (another interpreter build) every call does the full read.
    ``gauss_next`` is a plain attribute and is read every time, so equal bytes mean an
    equal state whatever happened in between (unlike numpy, see :func:`capture_rng`).
    """

    _SIZE = 4 + 624 * 4

    def __init__(self) -> None:
        self._inst: Any = None
        self._addr: int | None = None
        self._raw: bytes | None = None
        self._internal: tuple | None = None
        self._tensor: torch.Tensor | None = None

    @classmethod
    def _validate(cls, inst: Any) -> int | None:
        return _words_address(  # PyObject_HEAD is 16 bytes on 64-bit builds; checked against getstate()
            inst, id(inst) + 16, cls._SIZE, lambda st: struct.pack("=i624I", st[1][-1], *st[1][:-1]),
            getstate=inst.getstate, setstate=inst.setstate, draw=inst.random)

    def get_state(self) -> tuple[int, torch.Tensor, Any]:
        """``(version, internal state as an int64 tensor, gauss_next)``; the tensor is reused while unchanged."""
        inst = getattr(random.getstate, "__self__", None)
        if inst is not self._inst:
            self._inst, self._addr, self._raw = inst, None if inst is None else self._validate(inst), None
        if self._addr is not None:
            raw = ctypes.string_at(self._addr, self._SIZE)
            if raw != self._raw or self._tensor is None:
                version, internal, gauss = random.getstate()
                self._raw = raw
                if internal != self._internal:
                    self._internal, self._tensor = internal, torch.tensor(internal, dtype=torch.int64)
                return version, self._tensor, gauss  # type: ignore[return-value]
            return random.Random.VERSION, self._tensor, inst.gauss_next  # type: ignore[union-attr]
        version, internal, gauss = random.getstate()
        if internal != self._internal or self._tensor is None:
            self._internal, self._tensor = internal, torch.tensor(internal, dtype=torch.int64)
        return version, self._tensor, gauss

    @property
    def fast(self) -> bool:
        self.get_state()
        return self._addr is not None


PYTHON_RNG = _PythonGlobalRNG()
_LAST_NP: list[Any] = [None, None]  # (key array, its int64 tensor): most steps draw no numpy randomness


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """RNG state of python, numpy, torch CPU and every initialised CUDA device.

    The big state vectors go to tensors (binary), the small scalars to JSON. A
    state equal to the previous call's reuses its tensor (they are never mutated).
    numpy's ``get_state()`` is read in full every time (30 us here, up to 600 us on a
    busy GPU host). A shortcut that skipped it when the Mersenne Twister words were
    unchanged was tried twice and removed: numpy's Gaussian cache lives outside those
    words, so a reseed followed by the same draws ends on the same words with a
    different cache, and the shortcut returned a stale state (tests/unit/test_rng.py).
    """
    version, py_tensor, gauss = PYTHON_RNG.get_state()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    assert isinstance(keys, np.ndarray)
    tree: dict[str, Any] = {
        "python": [version, gauss],
        "numpy": [name, int(pos), int(has_gauss), float(cached)],
    }
    if _LAST_NP[0] is not keys and (_LAST_NP[0] is None or not np.array_equal(_LAST_NP[0], keys)):
        _LAST_NP[:] = [keys, torch.from_numpy(keys.astype(np.int64))]
    tensors = {
        "rng/torch": torch.get_rng_state(),
        "rng/python": py_tensor,
        "rng/numpy": _LAST_NP[1],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # get_rng_state reads the generator's seed/offset on the host: no sync.
        for i in range(torch.cuda.device_count()):
            tensors[f"rng/cuda/{i}"] = torch.cuda.get_rng_state(i)
    return tree, tensors


def restore_rng(tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, gauss = tree["python"]
    random.setstate((version, tuple(tensors["rng/python"].tolist()), gauss))
    name, pos, has_gauss, cached = tree["numpy"]
    np.random.set_state((name, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["rng/torch"])
    if torch.cuda.is_available():
        for key, t in tensors.items():
            if key.startswith("rng/cuda/"):
                dev = int(key.rsplit("/", 1)[1])
                if dev < torch.cuda.device_count():
                    torch.cuda.set_rng_state(t, dev)


# --- training state --------------------------------------------------------

def capture_state(state: TrainState, copy: pytree.TensorCopy | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Snapshot model, optimizer, scheduler, scaler and ``extra`` (not RNG).

    Raises:
        CaptureError: naming the component and path that cannot be recorded.
    """
    tensors: dict[str, torch.Tensor] = {}
    kw: dict[str, Any] = {"tensors": tensors}
    if copy is not None:
        kw["copy"] = copy
    tree: dict[str, Any] = {"training": state.model.training}
    parts = {
        MODEL: state.model.state_dict(),
        OPTIMIZER: state.optimizer.state_dict(),
        SCHEDULER: state.scheduler.state_dict() if state.scheduler is not None else None,
        SCALER: state.scaler.state_dict() if state.scaler is not None else None,
        EXTRA: state.extra,
    }
    for name, sd in parts.items():
        try:
            tree[name], _ = pytree.encode(sd, name, skip_callables=(name == SCHEDULER), **kw)
        except CaptureError as e:
            raise CaptureError(f"cannot capture the {name} state: {e}") from None
    return tree, tensors


def restore_state(state: TrainState, tree: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Load a snapshot made by :func:`capture_state` into ``state`` in place.

    Raises:
        StateMismatchError: when the snapshot does not fit what ``build`` made
            (missing/unexpected keys, shape mismatch), saying which.
    """
    device = _model_device(state.model)
    model_sd = pytree.decode(tree[MODEL], tensors)
    try:
        state.model.load_state_dict({k: v.to(device) if isinstance(v, torch.Tensor) else v
                                     for k, v in model_sd.items()})
    except RuntimeError as e:
        raise StateMismatchError(f"the recorded model state does not fit the model that build() made: {e}") from None
    state.model.train(tree.get("training", True))
    # Optimizers keep the tensors they are given (no copy when dtype and device match),
    # so hand them clones: the snapshot must survive any number of restores.
    tensors = {k: v.clone() for k, v in tensors.items() if not k.startswith(MODEL + "/")}
    try:
        state.optimizer.load_state_dict(pytree.decode(tree[OPTIMIZER], tensors))
    except (ValueError, KeyError, RuntimeError) as e:
        raise StateMismatchError(f"the recorded optimizer state does not fit the optimizer that build() made: {e}") from None
    for name, obj in ((SCHEDULER, state.scheduler), (SCALER, state.scaler)):
        recorded = tree.get(name)
        if (recorded is None) != (obj is None):
            have = "has" if obj is not None else "has no"
            raise StateMismatchError(
                f"the bundle {'has no' if recorded is None else 'has a'} {name} state but build() {have} {name}"
            )
        if obj is not None:
            obj.load_state_dict(pytree.decode(recorded, tensors))
    extra = pytree.decode(tree.get(EXTRA, {}), tensors)
    state.extra.clear()
    state.extra.update(pytree.map_tensors(extra, lambda t: t.to(device)))


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
