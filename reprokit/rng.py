"""Random number generators: read at every step start through their public APIs, restored on replay.

Recorded at every step start and in every snapshot:

- python's ``random`` module (``random.getstate()``),
- numpy's legacy global generator (``np.random.get_state()``, Gaussian cache included),
- torch's default CPU generator (``torch.get_rng_state()``),
- the default generator of every CUDA device that has been initialised (its seed and Philox
  offset: ``initial_seed()`` / ``get_offset()``, host-side reads that never wait for the GPU),
- generators the run owns, kept anywhere inside ``TrainState.extra`` (dicts, lists, tuples):
  ``torch.Generator`` (CPU or CUDA), numpy ``Generator`` and ``RandomState``, ``random.Random``.

A generator kept anywhere else (a module attribute, a closure, a ``DataLoader``'s own) is not
recorded: replay runs with whatever state ``build`` gives it, and the replay report shows the
losses diverging. Put such a generator into ``state.extra`` to have it recorded.

Reads are kept as the APIs return them (a tuple, a dict, a 5 KB tensor: ~10-40 us per step for
all of them on a CPU host) and turned into bundle tensors only when a bundle is written, by
:func:`encode`. Nothing here reads memory behind an API.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from reprokit.errors import BundleError, CaptureError, StateMismatchError

KIND = "__rk_generator__"
"""Key of the marker that stands for an owned generator in the snapshot's ``extra`` tree."""

Path = tuple[Any, ...]  # keys (str) and indices (int) from ``extra`` down to a generator


@dataclass(slots=True)
class RNGState:
    """Every recorded generator's state, as its public API returned it."""

    python: tuple
    numpy: tuple
    torch_cpu: torch.Tensor
    cuda: tuple[tuple[int, int] | torch.Tensor, ...]
    """Per initialised device: (seed, offset), or the state tensor on a torch without ``get_offset``."""
    owned: tuple[tuple[Path, str, str, Any], ...] = ()
    """(path in ``extra``, kind, device, state) of every generator in ``TrainState.extra``."""


# --- generators the run owns ----------------------------------------------------------------

def kind_of(obj: Any) -> str | None:
    """``"torch"``, ``"numpy"``, ``"numpy_legacy"``, ``"python"`` for a generator we record, else None."""
    if isinstance(obj, torch.Generator):
        return "torch"
    if isinstance(obj, np.random.Generator):
        return "numpy"
    if isinstance(obj, np.random.RandomState):
        return "numpy_legacy"
    if isinstance(obj, random.Random):
        return "python"
    return None


def find_generators(obj: Any, path: Path = ()) -> Iterator[tuple[Path, str, Any]]:
    """``(path, kind, generator)`` for every generator inside dicts, lists and tuples of ``obj``."""
    kind = kind_of(obj)
    if kind is not None:
        yield path, kind, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from find_generators(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from find_generators(v, (*path, i))


def check_generators(extra: dict[str, Any]) -> None:
    """Refuse, at attach time, generators whose state cannot be read (``random.SystemRandom``) or that sit under
    keys a bundle cannot name."""
    for path, kind, gen in find_generators(extra):
        where = "state.extra" + "".join(f"[{p!r}]" for p in path)
        if any(not isinstance(p, (str, int)) or isinstance(p, bool) for p in path):
            raise CaptureError(f"{where}: a generator under a key that is not a string cannot be recorded; "
                               "use string keys on the way to it")
        try:
            _read(kind, gen)
        except NotImplementedError:
            raise CaptureError(f"{where}: {type(gen).__qualname__} has no state to record (it draws from the OS); "
                               "use a seeded random.Random instead") from None


def _device(kind: str, gen: Any) -> str:
    """Where a generator lives: the torch device, or for numpy the bit generator's class (``numpy:PCG64``), which
    decides which states it accepts."""
    if kind == "torch":
        return str(gen.device)
    if kind == "numpy":
        return f"numpy:{type(gen.bit_generator).__name__}"
    if kind == "numpy_legacy":
        return f"numpy:{type(gen._bit_generator).__name__}"
    return "cpu"


def _read(kind: str, gen: Any) -> Any:
    if kind == "torch":
        if gen.device.type == "cuda" and hasattr(gen, "get_offset"):
            return gen.initial_seed(), gen.get_offset()
        return gen.get_state()
    if kind == "numpy":
        return gen.bit_generator.state
    if kind == "numpy_legacy":
        return gen.get_state(legacy=False)
    return gen.getstate()


def _write(kind: str, gen: Any, state: Any) -> None:
    if kind == "torch":
        if isinstance(state, torch.Tensor):
            gen.set_state(state)
        else:
            gen.manual_seed(state[0])
            gen.set_offset(state[1])
    elif kind == "numpy":
        gen.bit_generator.state = state
    elif kind == "numpy_legacy":
        gen.set_state(state)
    else:
        gen.setstate(state)


def new_generator(kind: str, device: str) -> Any:
    """A fresh generator of ``kind`` on ``device`` (see :func:`_device`), for a bundle whose ``build`` did not make
    one where the snapshot has it."""
    if kind == "torch":
        return torch.Generator(device=device)
    if kind in ("numpy", "numpy_legacy"):
        name = device.removeprefix("numpy:") if device.startswith("numpy:") else "MT19937"
        bitgen = getattr(np.random, name, None)
        if not (isinstance(bitgen, type) and issubclass(bitgen, np.random.BitGenerator)):
            raise StateMismatchError(f"the bundle names an unknown numpy bit generator {name!r}")
        return np.random.Generator(bitgen()) if kind == "numpy" else np.random.RandomState(bitgen())
    return random.Random()


def marked(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` with every generator replaced by a marker naming its kind (its state travels with the RNG)."""
    def walk(obj: Any) -> Any:
        kind = kind_of(obj)
        if kind is not None:
            return {KIND: kind, "device": _device(kind, obj)}
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(extra) if next(find_generators(extra), None) is not None else extra


def unmarked(decoded: Any, live: Any) -> Any:
    """Replace markers in a decoded ``extra`` by generators: the live one at the same place when it is of the
    same kind and device (so that references the step holds stay valid), else a new one. States are set by
    :func:`restore`."""
    if isinstance(decoded, dict) and isinstance(decoded.get(KIND), str) and set(decoded) == {KIND, "device"}:
        kind, device = decoded[KIND], str(decoded["device"])
        if kind_of(live) == kind and _device(kind, live) == device:
            return live
        return new_generator(kind, device)
    if isinstance(decoded, dict):
        return {k: unmarked(v, live.get(k) if isinstance(live, dict) else None) for k, v in decoded.items()}
    if isinstance(decoded, (list, tuple)):
        items = [unmarked(v, live[i] if isinstance(live, (list, tuple)) and i < len(live) else None)
                 for i, v in enumerate(decoded)]
        return tuple(items) if isinstance(decoded, tuple) else items
    return decoded


# --- capture --------------------------------------------------------------------------------

def capture(extra: dict[str, Any] | None = None) -> RNGState:
    """Read every recorded generator now (see the module docstring). Cheap: no tensor conversion."""
    cuda: tuple[tuple[int, int] | torch.Tensor, ...] = ()
    if torch.cuda.is_initialized():  # implies available; is_available() alone costs ~10 us
        cuda = tuple(_cuda_read(g) for g in torch.cuda.default_generators)
    owned: tuple[tuple[Path, str, str, Any], ...] = ()
    if extra:
        owned = tuple((path, kind, _device(kind, gen), _read(kind, gen)) for path, kind, gen in find_generators(extra))
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)
    return RNGState(random.getstate(), numpy_state, torch.get_rng_state(), cuda, owned)


def _cuda_read(gen: torch.Generator) -> tuple[int, int] | torch.Tensor:
    if hasattr(gen, "get_offset"):
        return gen.initial_seed(), gen.get_offset()
    return gen.get_state()


def encode(rs: RNGState, host_only: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The bundle form: small scalars in a JSON tree, state vectors as tensors (``rng/...``).

    ``host_only``: make the CUDA generators' state tensors on the host alone (see :func:`cuda_state_on_host`), for
    a bundle written after a sticky device error, when no CUDA call may run."""
    version, internal, gauss = rs.python
    name, keys, pos, has_gauss, cached = rs.numpy
    tree: dict[str, Any] = {"python": [version, gauss], "numpy": [name, int(pos), int(has_gauss), float(cached)]}
    tensors = {"rng/python": torch.from_numpy(np.array(internal, dtype=np.int64)),  # torch.tensor(tuple): 10x slower
               "rng/numpy": torch.from_numpy(np.asarray(keys).astype(np.int64)),
               "rng/torch": rs.torch_cpu}
    for i, st in enumerate(rs.cuda):
        tensors[f"rng/cuda/{i}"] = st if isinstance(st, torch.Tensor) else \
            cuda_state_on_host(st) if host_only else _cuda_state_tensor(i, st)
    owned = []
    for n, (path, kind, device, st) in enumerate(rs.owned):
        entry: dict[str, Any] = {"path": list(path), "kind": kind, "device": device}
        if isinstance(st, torch.Tensor):
            entry["tensor"] = key = f"rng/owned/{n}"
            tensors[key] = st
        else:
            entry["state"] = _json_state(st)
        owned.append(entry)
    if owned:
        tree["owned"] = owned
    return tree, tensors


def cuda_state_on_host(seed_offset: tuple[int, int]) -> torch.Tensor:
    """``torch.cuda.get_rng_state()`` for a generator at (seed, offset), made without a CUDA call: the 16 bytes
    torch's CUDA generator writes (the seed as uint64, then the Philox offset as int64, native byte order).
    The recorder checks once, while the device works, that this is the format of the torch it runs
    (:func:`host_format_matches`)."""
    seed, offset = seed_offset
    raw = np.array([seed], dtype=np.uint64).tobytes() + np.array([offset], dtype=np.int64).tobytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def host_format_matches(device: int = 0) -> bool:
    """Is :func:`cuda_state_on_host` what this torch's CUDA generator says? (Asks the device: call while it works.)"""
    try:
        return torch.equal(cuda_state_on_host((12345, 64)), _cuda_state_tensor(device, (12345, 64)))
    except Exception:
        return False


def _cuda_state_tensor(device: int, seed_offset: tuple[int, int]) -> torch.Tensor:
    """``torch.cuda.get_rng_state(device)`` as it was when (seed, offset) was read, made by a scratch generator
    through the public API (the format bundles have always stored)."""
    g = torch.Generator(device=f"cuda:{device}")
    g.manual_seed(seed_offset[0])
    g.set_offset(seed_offset[1])
    return g.get_state()


_ARRAY = "__rk_array__"


def _json_state(obj: Any) -> Any:
    """numpy / python generator state as strict JSON (arrays as dtype + values)."""
    if isinstance(obj, np.ndarray):
        return {_ARRAY: [obj.dtype.str, obj.tolist()]}
    if isinstance(obj, dict):
        return {str(k): _json_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_state(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _from_json_state(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_ARRAY}:
            dtype, values = obj[_ARRAY]
            return np.asarray(values, dtype=np.dtype(dtype))
        return {k: _from_json_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json_state(v) for v in obj]
    return obj


# --- restore --------------------------------------------------------------------------------

UNRECORDED_CUDA_SEED = 67280421310721
"""torch's default seed of a CUDA generator (``default_rng_seed_val``): what a fresh process starts from."""


def restore(tree: dict[str, Any], tensors: dict[str, torch.Tensor], extra: dict[str, Any] | None = None) -> None:
    """Set every generator a bundle recorded (global ones, and those in ``extra`` by path).

    Raises:
        StateMismatchError: a generator the bundle recorded in ``extra`` is not where it was.
    """
    with _settable("the global generators"):
        version, gauss = tree["python"]
        random.setstate((version, tuple(tensors["rng/python"].tolist()), gauss))
        name, pos, has_gauss, cached = tree["numpy"]
        np.random.set_state((name, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(tensors["rng/torch"])
        if torch.cuda.is_available():
            recorded = set()
            for key, t in tensors.items():
                if key.startswith("rng/cuda/"):
                    dev = int(key.rsplit("/", 1)[1])
                    if dev < torch.cuda.device_count():
                        torch.cuda.set_rng_state(t, dev)
                        recorded.add(dev)
            # A device the bundle has no state for (recorded on the CPU, replayed on a GPU): the seed a fresh process
            # starts from, at every restore, so that each --times run and each shrink candidate draws the same. Only
            # once CUDA is in use (a replay on the CPU must not start it); until then its generators are fresh anyway.
            if torch.cuda.is_initialized():
                for dev, gen in enumerate(torch.cuda.default_generators):
                    if dev not in recorded:
                        gen.manual_seed(UNRECORDED_CUDA_SEED)
    for entry in tree.get("owned", []):
        gen = _at(extra, entry["path"])
        kind = entry["kind"]
        where = "state.extra" + "".join(f"[{p!r}]" for p in entry["path"])
        if kind_of(gen) != kind or _device(kind, gen) != entry["device"]:
            have = f"{type(gen).__qualname__} ({_device(kind, gen)})" if kind_of(gen) else type(gen).__qualname__
            raise StateMismatchError(f"the bundle recorded a {kind} generator ({entry['device']}) at {where}, but "
                                     f"build() put {have} there")
        if "tensor" in entry:
            state: Any = tensors[entry["tensor"]]
        else:
            state = _from_json_state(entry["state"])
            if kind == "python":
                state = (state[0], tuple(state[1]), state[2])
            elif kind == "torch":
                state = tuple(state)
        with _settable(where):
            _write(kind, gen, state)


@contextlib.contextmanager
def _settable(what: str) -> Iterator[None]:
    """A recorded state the generator refuses (a bundle's schema-valid but wrong-sized or wrong-typed RNG state)
    is an invalid bundle, not an internal error."""
    try:
        yield
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise BundleError(f"the bundle's recorded state of {what} cannot be set ({type(e).__name__}: "
                          f"{str(e)[:200]}): the bundle is damaged or crafted, or was recorded by an incompatible "
                          "torch/numpy. Re-record it, or get an intact copy from whoever made it.") from None


def _at(extra: Any, path: list[Any]) -> Any:
    obj = extra
    for p in path:
        try:
            obj = obj[p]
        except (KeyError, IndexError, TypeError):
            return None
    return obj
