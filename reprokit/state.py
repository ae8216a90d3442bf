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


class _GlobalRNG:
    """A module-level generator's state, re-read in full only when its bytes have moved.

    Subclasses say where the generator's bytes live (located once per generator object
    and proven against the full read, see :func:`_words_address`) and how to read the
    state in full (``_full``: the generator's own ``getstate``, tens to hundreds of
    microseconds on a busy host). Each call compares those bytes, in place, with a copy
    taken at the last full read; equal bytes mean an equal state, so the last result is
    returned. The comparison allocates nothing: right after a training step the first
    allocation of a kilobyte or more can cost ~50 us (the C allocator tidies the many
    small blocks the step freed). A generator whose layout cannot be proven is read in
    full every time.
    """

    def __init__(self) -> None:
        self._owners_seen: tuple[Any, ...] = ()
        self._spans: list[tuple[memoryview, memoryview]] = []
        """(a view of the generator's own bytes, our copy of them at the last full read)."""
        self._extra_seen: Any = None
        self._value: Any = None

    def _owners(self) -> tuple[Any, ...]:
        """The objects the located addresses belong to (held, so their addresses cannot be reused)."""
        raise NotImplementedError

    def _locate(self, owners: tuple[Any, ...]) -> list[tuple[int, int]] | None:
        """``(address, size)`` of every byte of the state, or None when that cannot be proven."""
        raise NotImplementedError

    def _extra(self) -> Any:
        """State held outside those bytes, compared by identity (python's ``gauss_next`` float)."""
        return None

    def _full(self) -> Any:
        raise NotImplementedError

    def get_state(self) -> Any:
        owners = self._owners()
        if len(owners) != len(self._owners_seen) or any(a is not b for a, b in zip(owners, self._owners_seen)):
            self._owners_seen, self._value, self._spans = owners, None, []
            spans = None if None in owners else self._locate(owners)
            self._spans = [view for a, n in spans or () for view in _watch(a, n)]
        if not self._spans:
            return self._full()
        if self._value is not None and self._extra() is self._extra_seen and all(a == b for a, b in self._spans):
            return self._value
        for live, seen in self._spans:
            seen[:] = live
        extra = self._extra()
        value = self._full()
        # Cache only when nothing moved during the full read (another thread drawing, say).
        same = extra is self._extra() and all(a == b for a, b in self._spans)
        self._value, self._extra_seen = (value, extra) if same else (None, None)
        return value

    @property
    def fast(self) -> bool:
        self.get_state()
        return bool(self._spans)


def _watch(addr: int, size: int) -> list[tuple[memoryview, memoryview]]:
    """(live view, copy) pairs covering ``size`` bytes at ``addr``: 8-byte words, then the odd bytes.

    memoryview equality compares element by element: words make it ~6x faster (2.5 KB: 0.7 us).
    """
    out: list[tuple[memoryview, memoryview]] = []
    words = size // 8 * 8
    for start, end, fmt in ((0, words, "Q"), (words, size, "B")):
        if end > start:
            live = memoryview((ctypes.c_char * (end - start)).from_address(addr + start)).cast("B")
            copy = memoryview(bytearray(end - start))
            out.append((live.cast("Q"), copy.cast("Q")) if fmt == "Q" else (live, copy))
    return out


class _PythonGlobalRNG(_GlobalRNG):
    """``random.getstate()`` for the module-level generator, as ``(version, int64 tensor, gauss_next)``.

    The words are CPython's ``_random.Random`` object's own (``int index; uint32_t
    state[624]`` right after the 16-byte object header), checked against ``getstate()``
    with a draw (then put back); ``gauss_next`` is a plain attribute, compared by identity.
    """

    _SIZE = 4 + 624 * 4

    def __init__(self) -> None:
        super().__init__()
        self._internal: tuple | None = None
        self._tensor: torch.Tensor | None = None

    def _owners(self) -> tuple[Any, ...]:
        return (getattr(random.getstate, "__self__", None),)

    @classmethod
    def _validate(cls, inst: Any) -> int | None:
        return _words_address(  # PyObject_HEAD is 16 bytes on 64-bit builds; checked against getstate()
            inst, id(inst) + 16, cls._SIZE, lambda st: struct.pack("=i624I", st[1][-1], *st[1][:-1]),
            getstate=inst.getstate, setstate=inst.setstate, draw=inst.random)

    def _locate(self, owners: tuple[Any, ...]) -> list[tuple[int, int]] | None:
        addr = self._validate(owners[0])
        return None if addr is None else [(addr, self._SIZE)]

    def _extra(self) -> Any:
        return self._owners_seen[0].gauss_next

    def _full(self) -> tuple[int, torch.Tensor, Any]:
        version, internal, gauss = random.getstate()
        if internal != self._internal or self._tensor is None:
            self._internal, self._tensor = internal, torch.tensor(internal, dtype=torch.int64)
        return version, self._tensor, gauss


class _NumpyGlobalRNG(_GlobalRNG):
    """numpy's legacy global generator (``np.random.rand`` and friends), as ``(json part, int64 tensor)``.

    Its whole state is the Mersenne Twister's ``uint32 key[624]; int pos`` (inside the
    MT19937 object, at ``bit_generator.ctypes.state_address``) plus the RandomState's
    Gaussian cache ``int has_gauss; double gauss`` (inside the RandomState object, just
    after the pointer it keeps to its own copy of the bit generator's struct). Both
    places are found and proven on a private RandomState (states set with known caches,
    a draw must move the words) and then checked on the global one against
    ``get_state()``, without drawing from it.
    """

    _SIZE = 624 * 4 + 4

    def __init__(self) -> None:
        super().__init__()
        self._keys: np.ndarray | None = None
        self._tensor: torch.Tensor | None = None

    def _owners(self) -> tuple[Any, ...]:
        inst = getattr(np.random.get_state, "__self__", None)
        return inst, getattr(inst, "_bit_generator", None)

    @classmethod
    def _expected_words(cls, st: Any) -> bytes:
        return np.asarray(st[1], dtype="=u4").tobytes() + struct.pack("=i", st[2])

    @classmethod
    def _cache_offset(cls, inst: Any) -> int | None:
        """Offset of ``has_gauss`` in a RandomState: 8 bytes after a word pointing inside the object at the
        bit generator's state pointer."""
        size = type(inst).__basicsize__
        words = struct.unpack(f"={size // 8}Q", ctypes.string_at(id(inst), size // 8 * 8))
        state_at = [i for i, w in enumerate(words) if w == inst._bit_generator.ctypes.state_address]
        back = [i for i, w in enumerate(words) for j in state_at if w == id(inst) + 8 * j]
        if len(back) != 1 or 8 * back[0] + 24 > size:
            return None
        return 8 * back[0] + 8

    @classmethod
    def _prove_on_probe(cls) -> int | None:
        """The Gaussian cache's offset, proven on a private RandomState (the global one is not touched)."""
        try:
            probe = np.random.RandomState(0)
            off = cls._cache_offset(probe)
            if off is None:
                return None
            bg = probe._bit_generator
            if _words_address(bg, bg.ctypes.state_address, cls._SIZE, cls._expected_words,
                              getstate=lambda: probe.get_state(legacy=True), setstate=probe.set_state,
                              draw=probe.random_sample) is None:
                return None
            name, keys, pos = probe.get_state(legacy=True)[:3]  # type: ignore[misc,index]
            for has, value in ((1, 1.25), (0, 0.0), (1, -3.5e-300)):
                probe.set_state((name, keys, pos, has, value))
                if ctypes.string_at(id(probe) + off, 4) != struct.pack("=i", has) or \
                        ctypes.string_at(id(probe) + off + 8, 8) != struct.pack("=d", value):
                    return None
            return off
        except Exception:
            return None

    def _locate(self, owners: tuple[Any, ...]) -> list[tuple[int, int]] | None:
        inst, bg = owners
        off = self._prove_on_probe() if type(inst) is np.random.RandomState else None
        try:
            if off is None or self._cache_offset(inst) != off:
                return None
            words = bg.ctypes.state_address
            if not id(bg) <= words <= id(bg) + type(bg).__basicsize__ - self._SIZE:
                return None
            st = inst.get_state(legacy=True)
            cache = id(inst) + off
            if (ctypes.string_at(words, self._SIZE), ctypes.string_at(cache, 4), ctypes.string_at(cache + 8, 8)) != (
                    self._expected_words(st), struct.pack("=i", st[3]), struct.pack("=d", st[4])):
                return None
            return [(words, self._SIZE), (cache, 4), (cache + 8, 8)]  # the padding between the two is skipped
        except Exception:
            return None

    def _full(self) -> tuple[list[Any], torch.Tensor]:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
        assert isinstance(keys, np.ndarray)
        if self._keys is None or self._tensor is None or not np.array_equal(self._keys, keys):
            self._keys, self._tensor = keys, torch.from_numpy(keys.astype(np.int64))
        return [name, int(pos), int(has_gauss), float(cached)], self._tensor


class _TorchCPURNG(_GlobalRNG):
    """``torch.get_rng_state()`` (the default CPU generator), re-read only when its bytes moved.

    Reading it allocates a 5 KB tensor, and right after a training step the first host
    allocation of that size costs ~0.1 ms on a GPU host. The generator's C++ object
    (pointed to by the Python object's first field) holds ``mt19937``'s ``uint64 seed;
    int left; bool seeded; uint32 next; uint32 state[624]`` followed by the two cached
    normal samples (``optional<float>``, ``optional<double>``). On a private generator
    the words are found by content, the fields before them must equal the serialized
    state, a draw must move them, and setting states that differ only in a cached normal
    sample must change the watched bytes; the global generator must then show the same
    layout and its own serialized state, without being touched.
    """

    _LEAD = 20  # seed, left, seeded, next: the bytes before the words
    _SPAN = 2544  # the engine (2520 bytes) and the two optional normal samples after it
    _WINDOW = 256  # where the words may start, from the object's start

    def __init__(self) -> None:
        super().__init__()
        self._offset: int | None = None
        self._proven = False

    def _owners(self) -> tuple[Any, ...]:
        return (torch.default_generator,)

    @staticmethod
    def _fields(blob: bytes) -> tuple[bytes, bytes]:
        """(the 20 bytes before the words, the words) as the C++ object holds them, from a serialized state."""
        seed, left, seeded, nxt = struct.unpack_from("=QiiQ", blob, 0)
        words = np.frombuffer(blob, dtype=np.uint64, count=624, offset=24).astype("=u4").tobytes()
        return struct.pack("=Qi?3xI", seed, left, bool(seeded), nxt & 0xFFFFFFFF), words

    @classmethod
    def _find(cls, gen: Any) -> tuple[int, int] | None:
        """(object address, offset of the words) when the object holds ``gen``'s serialized state, else None."""
        # The Python object is PyObject_HEAD then the C++ generator's pointer. Refuse before following it unless the
        # header is the 16-byte one (type pointer where expected) and the field looks like a heap pointer. The words
        # are then searched for within 256 bytes of the object's start (it is ~2.6 KB, so the read may pass its end
        # by ~100 bytes of the same heap).
        _, typ, impl = struct.unpack("=qQQ", ctypes.string_at(id(gen), 24))
        if typ != id(type(gen)) or type(gen).__basicsize__ < 24 or not impl or impl % 16:
            return None
        lead, words = cls._fields(gen.get_state().numpy().tobytes())
        at = ctypes.string_at(impl, cls._WINDOW + len(words)).find(words)
        if at < cls._LEAD or at > cls._WINDOW:
            return None
        got = ctypes.string_at(impl + at - cls._LEAD, cls._LEAD)
        if got[:13] != lead[:13] or got[16:] != lead[16:]:  # bytes 13-15 are padding
            return None
        return impl, at

    @classmethod
    def _prove_on_probe(cls) -> int | None:
        try:
            probe = torch.Generator()
            probe.manual_seed(20261126)
            found = cls._find(probe)
            if found is None:
                return None
            impl, at = found
            span = lambda: ctypes.string_at(impl + at - cls._LEAD, cls._SPAN)  # noqa: E731
            before = span()
            torch.rand(3, generator=probe)
            if span() == before or cls._find(probe) != found:
                return None
            blob = bytearray(probe.get_state().numpy().tobytes())
            struct.pack_into("=i", blob, 5040, 0)  # no cached double sample
            struct.pack_into("=?", blob, 5052, False)  # no cached float sample
            seen = []
            for double, flt in ((None, None), (1.5, None), (-2.5, None), (None, 0.75), (None, 0.5)):
                b = bytearray(blob)
                if double is not None:  # normal_x, normal_y, normal_rho (torch versions derive the sample differently)
                    struct.pack_into("=ddd", b, 5016, 0.125, double, abs(double))
                    struct.pack_into("=i", b, 5040, 1)
                if flt is not None:
                    struct.pack_into("=f", b, 5048, flt)
                    struct.pack_into("=?", b, 5052, True)
                probe.set_state(torch.frombuffer(b, dtype=torch.uint8).clone())
                seen.append(span())
            return at if len(set(seen)) == len(seen) else None  # every cached sample lives in the span
        except Exception:
            return None

    def _locate(self, owners: tuple[Any, ...]) -> list[tuple[int, int]] | None:
        if not self._proven:
            self._proven, self._offset = True, self._prove_on_probe()
        try:
            found = None if self._offset is None else self._find(owners[0])
        except Exception:
            found = None
        if found is None or found[1] != self._offset:
            return None
        return [(found[0] + found[1] - self._LEAD, self._SPAN)]

    def _full(self) -> torch.Tensor:
        return torch.get_rng_state()


PYTHON_RNG = _PythonGlobalRNG()
NUMPY_RNG = _NumpyGlobalRNG()
TORCH_RNG = _TorchCPURNG()
_CUDA_RNG: dict[int, tuple[int, int, torch.Tensor]] = {}


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """RNG state of python, numpy, torch CPU and every initialised CUDA device.

    The big state vectors go to tensors (binary), the small scalars to JSON. python's
    and numpy's global generators are re-read in full only when their bytes moved (see
    :class:`_GlobalRNG`); an unchanged state reuses its tensor (they are never mutated).
    """
    version, py_tensor, gauss = PYTHON_RNG.get_state()
    np_tree, np_tensor = NUMPY_RNG.get_state()
    tree: dict[str, Any] = {"python": [version, gauss], "numpy": list(np_tree)}
    tensors = {"rng/torch": TORCH_RNG.get_state(), "rng/python": py_tensor, "rng/numpy": np_tensor}
    if torch.cuda.is_initialized():  # implies available; is_available() alone costs ~10 us
        for i, gen in enumerate(torch.cuda.default_generators):
            tensors[f"rng/cuda/{i}"] = _cuda_state(i, gen)
    return tree, tensors


def _cuda_state(i: int, gen: torch.Generator) -> torch.Tensor:
    """``torch.cuda.get_rng_state(i)``: the generator's seed and Philox offset (read on the host, no sync), as the
    16-byte tensor ``get_state()`` returns; the last one is reused while seed and offset are unchanged."""
    try:
        key = (gen.initial_seed(), gen.get_offset())
    except Exception:  # a torch without Generator.get_offset
        return gen.get_state()
    cached = _CUDA_RNG.get(i)
    if cached is not None and cached[:2] == key:
        return cached[2]
    state = gen.get_state()
    _CUDA_RNG[i] = (*key, state)
    return state


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
