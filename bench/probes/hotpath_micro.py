"""Micro-timings of the recorder's hot-path pieces on a GPT-2-124M-shaped state (host microseconds).

    PYTHONPATH=bench python bench/probes/hotpath_micro.py          # needs CUDA
"""

from __future__ import annotations

import time

import torch
from recorder_overhead import build  # noqa: E402  (bench/ is the script's folder)

from reprokit.snapshot import SnapshotEngine
from reprokit.state import capture_rng, capture_state


def t(fn, n=50):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    total = (time.perf_counter() - t0) / n
    return host * 1e6, total * 1e6


def main():
    cfg = {"layers": 12, "d": 768, "heads": 12, "vocab": 50304, "ctx": 1024, "batch": 8, "device": "cuda"}
    st = build(cfg)
    idx = torch.randint(0, 50304, (8, 1025), device="cuda")
    from recorder_overhead import train_step
    train_step(st, {"idx": idx[:, :-1], "targets": idx[:, 1:]})
    loss = torch.nn.functional.cross_entropy(st.model(idx[:, :-1]).float().reshape(-1, 50304), idx[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in st.model.parameters() if p.grad is not None]
    print(f"{len(grads)} grads")
    rows = {
        "foreach_norm fp32": lambda: torch._foreach_norm(grads),
        "foreach_norm dtype=fp64": lambda: torch._foreach_norm(grads, 2, dtype=torch.float64),
        "foreach_norm fp32 + stack + norm": lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))),
        "capture_rng": capture_rng,
        "pinned empty + D2H copy x2 (64KB)": lambda: [torch.empty((8, 1024), dtype=torch.int64, pin_memory=True)
                                                      .copy_(idx[:, :-1], non_blocking=True) for _ in range(2)],
        "capture_state walk (no copies)": lambda: capture_state(st, copy=lambda x: x),
    }
    bufs = {}

    def d2h_all():
        _, ts = capture_state(st, copy=lambda x: x)
        for k, v in ts.items():
            if v.is_cuda:
                b = bufs.get(k)
                if b is None:
                    b = bufs[k] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                b.copy_(v, non_blocking=True)
    rows["walk + D2H copy_ of every state tensor"] = d2h_all
    eng = SnapshotEngine(st)
    rows["SnapshotEngine.take"] = lambda: (eng.take({}), eng.wait())
    for name, fn in rows.items():
        host, total = t(fn, 5 if "D2H copy_ of" in name or "take" in name else 50)
        print(f"{name:<45} host {host:10.1f} us   host+gpu {total:10.1f} us")


if __name__ == "__main__":
    main()
