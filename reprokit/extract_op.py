"""Run one aten op on the inputs ``reprokit extract`` saved, and show the non-finite value it makes.

Written next to ``op.json`` and ``op.safetensors`` by ``reprokit extract``; needs only torch and
safetensors. Exit 1 while the op's output holds a NaN or inf (the bug reproduces), 0 once it does not.
Usage: ``python op_repro.py`` (``--device cuda`` to run it on a GPU).
"""

from __future__ import annotations

import json
import sys
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


def main() -> int:
    here = Path(__file__).resolve().parent
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    spec = json.loads((here / "op.json").read_text())
    tensors = load_file(str(here / "op.safetensors"))
    args = _decode(spec["args"], tensors, device)
    kwargs = {k: _decode(v, tensors, device) for k, v in spec["kwargs"].items()}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            finite = bool(torch.isfinite(a).all()) if a.is_floating_point() else True
            print(f"input {i}: {a.dtype} {list(a.shape)}, all finite: {finite}")
    out = _op(spec["op"])(*args, **kwargs)
    outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
    bad = sum(int((~torch.isfinite(t)).sum()) for t in outs if t.is_floating_point())
    print(f"{spec['op']}: {bad} non-finite value(s) in its output")
    print("REPRODUCED" if bad else "NOT REPRODUCED")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
