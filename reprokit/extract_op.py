"""Run one aten op on the inputs ``reprokit extract`` saved, and show the non-finite value it makes (or the
exception it raises).

Written next to ``op.json`` and ``op.safetensors`` by ``reprokit extract``; needs only torch and
safetensors. Exit 1 while the bug reproduces: the op's output holds a NaN or inf, or, when ``op.json``
has ``raises``, the op raises that exception (same type, same first line); 0 once it does not.
Usage: ``python op_repro.py`` (``--device cuda`` to run it on a GPU).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def _op(name: str) -> Any:
    ns, op, overload = (name.split(".") + ["default"])[:3]
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def _decode(v: Any, tensors: dict[str, torch.Tensor], device: str) -> Any:
    if isinstance(v, list):
        return [_decode(x, tensors, device) for x in v]
    if isinstance(v, dict):
        if "tensor" in v:
            return tensors[v["tensor"]].to(device)
        if "float" in v:
            return float(v["float"])
        if "dtype" in v:
            return getattr(torch, v["dtype"])
        if "device" in v:
            return torch.device(device)
    return v


def run(spec: dict[str, Any], tensors: dict[str, torch.Tensor], device: str = "cpu",
        say: Callable[[str], Any] = print) -> bool:
    """Run the op of ``spec`` (``op.json``) on ``tensors``; True when it shows the bug. ``say`` gets each line."""
    args = _decode(spec["args"], tensors, device)
    kwargs = {k: _decode(v, tensors, device) for k, v in spec["kwargs"].items()}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            finite = bool(torch.isfinite(a).all()) if a.is_floating_point() else True
            say(f"input {i}: {a.dtype} {list(a.shape)}, all finite: {finite}")
    if "raises" in spec:
        return _raises(spec, args, kwargs, say)
    out = _op(spec["op"])(*args, **kwargs)
    outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
    bad = sum(int((~torch.isfinite(t)).sum()) for t in outs if t.is_floating_point())
    say(f"{spec['op']}: {bad} non-finite value(s) in its output")
    say("REPRODUCED" if bad else "NOT REPRODUCED")
    return bad > 0


def _raises(spec: dict[str, Any], args: list[Any], kwargs: dict[str, Any], say: Callable[[str], Any]) -> bool:
    want = spec["raises"]
    say(f"expected: {want['type']}: {want['message']}")
    try:
        _op(spec["op"])(*args, **kwargs)
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
    return 1 if run(spec, load_file(str(here / "op.safetensors")), device) else 0


if __name__ == "__main__":
    sys.exit(main())
