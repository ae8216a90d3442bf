"""Run one aten op on the inputs ``reprokit extract`` saved, and show the non-finite value it makes (or the
exception it raises).

Written next to ``op.json`` and ``op.safetensors`` by ``reprokit extract``; needs only torch and
safetensors. Exit 1 while the bug reproduces: the op's output holds a NaN or inf, or, when ``op.json``
has ``raises``, the op raises that exception (same type, same first line); 0 once it does not; 2 when
``op.json`` names an op that is not a pure tensor op (see :func:`refusal`), which is never run.
Usage: ``python op_repro.py`` (``--device cuda`` to run it on a GPU).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

_PLAIN_TYPES = frozenset({"Tensor", "int", "bool", "float", "number", "complex", "Device"})
"""Argument types of a pure tensor op (after ``Optional[...]``/``List[...]``): tensors, numbers, dtypes, layouts
and memory formats (schemas spell those ``int``), devices. Never a Generator, Storage, Stream or any object."""
_MODE_STRINGS = frozenset({"approximate", "rounding_mode", "equation", "mode", "norm", "reduce", "padding",
                           "indexing", "interpolation", "side", "pad_mode", "UPLO", "driver", "ord", "padding_side"})
"""The string arguments a pure tensor op takes: modes (``gelu``'s ``approximate``, ``einsum``'s ``equation``), never a
file name (``from_file``'s ``filename``) or a message."""


def _base(t: str) -> str:
    while (m := re.fullmatch(r"(?:Optional|List)\[(.*)\]", t)) is not None:
        t = m.group(1)
    return t


def refusal(func: Any) -> str | None:
    """Why one-op repros will not run the aten op ``func`` (an ``OpOverload``), or None when they will.

    Only pure tensor ops run: of the ``aten`` namespace, writing to none of their arguments, returning a tensor,
    and taking only tensors, numbers, dtypes, layouts, memory formats, devices and mode strings (an allowlist by
    schema: no file name, no generator, no storage, no stream, no object). So an ``op.json`` (or an extract's
    ``run.json``) that names ``aten.from_file`` or a setter of global state is refused before the op runs.
    """
    schema = getattr(func, "_schema", None)
    if not isinstance(func, torch._ops.OpOverload) or schema is None or not schema.name.startswith("aten::"):
        return "it is not an aten op"
    if schema.is_mutable:
        return "it writes to its arguments"
    if not any(_base(str(r.type)) == "Tensor" for r in schema.returns):
        return "it returns no tensor"
    for a in schema.arguments:
        base = _base(str(a.type))
        if not (base in _PLAIN_TYPES or (base == "str" and a.name in _MODE_STRINGS)):
            return f"its argument {a.name} is a {a.type}, not a tensor, number, dtype, device or mode"
    return None


def op_overload(name: Any) -> Any:
    """The aten op ``name`` (``aten.OP.OVERLOAD``) names, checked by :func:`refusal`.

    Raises:
        ValueError: ``name`` is malformed, names no op, or an op that :func:`refusal` refuses.
    """
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) == 2:
        parts.append("default")
    if len(parts) != 3 or parts[0] != "aten" or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        raise ValueError(f"{name!r} does not name an aten op (aten.OP.OVERLOAD); a one-op repro runs aten ops only")
    try:
        func = getattr(getattr(torch.ops.aten, parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        raise ValueError(f"{name} is not an op of this torch ({torch.__version__})") from None
    why = refusal(func)
    if why is not None:
        raise ValueError(f"{name} is not a pure tensor op ({why}); a one-op repro runs only those, so it was not run")
    return func


def dtype_of(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _decode(v: Any, tensors: dict[str, torch.Tensor], device: str) -> Any:
    if isinstance(v, list):
        return [_decode(x, tensors, device) for x in v]
    if isinstance(v, dict):
        if "tensor" in v:
            return tensors[v["tensor"]].to(device)
        if "float" in v:
            return float(v["float"])
        if "dtype" in v:
            return dtype_of(v["dtype"])
        if "device" in v:
            return torch.device(device)
    return v


def run(spec: dict[str, Any], tensors: dict[str, torch.Tensor], device: str = "cpu",
        say: Callable[[str], Any] = print) -> bool:
    """Run the op of ``spec`` (``op.json``) on ``tensors``; True when it shows the bug. ``say`` gets each line."""
    fn = op_overload(spec["op"])  # before anything else: op.json never chooses a file or a process to touch
    args = _decode(spec["args"], tensors, device)
    kwargs = {k: _decode(v, tensors, device) for k, v in spec["kwargs"].items()}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            finite = bool(torch.isfinite(a).all()) if a.is_floating_point() else True
            say(f"input {i}: {a.dtype} {list(a.shape)}, all finite: {finite}")
    if "raises" in spec:
        return _raises(spec, fn, args, kwargs, say)
    out = fn(*args, **kwargs)
    outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
    bad = sum(int((~torch.isfinite(t)).sum()) for t in outs if t.is_floating_point())
    say(f"{spec['op']}: {bad} non-finite value(s) in its output")
    say("REPRODUCED" if bad else "NOT REPRODUCED")
    return bad > 0


def _raises(spec: dict[str, Any], fn: Any, args: list[Any], kwargs: dict[str, Any],
            say: Callable[[str], Any]) -> bool:
    want = spec["raises"]
    say(f"expected: {want['type']}: {want['message']}")
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the op's own error is what this script shows
        first = str(e).splitlines()[0] if str(e) else ""
        say(f"{spec['op']}: raised {type(e).__qualname__}: {first}")
        same = type(e).__qualname__ == want["type"] and first[:500] == want["message"]
        say("REPRODUCED" if same else "NOT REPRODUCED (another exception)")
        return same
    say(f"{spec['op']}: raised nothing")
    say("NOT REPRODUCED")
    return False


def main() -> int:
    here = Path(__file__).resolve().parent
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    spec = json.loads((here / "op.json").read_text())
    try:
        op_overload(spec.get("op") if isinstance(spec, dict) else None)
    except ValueError as e:
        print(f"op.json: {e}. Nothing was run; get the repro again from whoever made it.", file=sys.stderr)
        return 2
    return 1 if run(spec, load_file(str(here / "op.safetensors")), device) else 0


if __name__ == "__main__":
    sys.exit(main())
