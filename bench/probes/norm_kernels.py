"""GPU time of ways to take the global L2 norm of GPT-2-124M's gradients (CUDA events, median of 30).

    PYTHONPATH=bench python bench/probes/norm_kernels.py [--json]

The host queues each way while the GPU is kept busy (``torch.cuda._sleep``), so the
events time the GPU work alone, not the launches; host time is printed beside it.
Gradients come from one real backward of the bench model (recorder_overhead.py). Each
way's result is compared with a float64 reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from recorder_overhead import build, cuda_bench_config, make_batch

from reprokit.detect import _norm_of_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = cuda_bench_config()
    state = build(cfg)
    g = torch.Generator(device="cuda").manual_seed(1)
    batch = make_batch(cfg, g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = state.model(batch["idx"])
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                      batch["targets"].reshape(-1)).backward()
    grads = [p.grad for p in state.model.parameters() if p.grad is not None]
    nbytes = sum(t.numel() * t.element_size() for t in grads)
    big = [t for t in grads if t.numel() >= 1 << 16]
    small = [t for t in grads if t.numel() < 1 << 16]

    def per_tensor64():
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in grads]))

    def hybrid64():
        parts = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in big]
        parts += list(torch._foreach_norm(small, 2, dtype=torch.float64))
        return torch.linalg.vector_norm(torch.stack(parts))

    def foreach32():
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def foreach_inf():
        return torch.stack(torch._foreach_norm(grads, float("inf"))).max()

    def per_tensor32():
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in grads]))

    found, one = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")

    def fused_check():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
        return found

    def sum_sq_per_tensor64():  # dot of each flattened grad with itself, float64 out
        return torch.stack([t.double().square().sum() if t.numel() < 1 << 16 else
                            torch.linalg.vector_norm(t, dtype=torch.float64).square() for t in grads]).sum().sqrt()

    ways = {"foreach64 (current)": lambda: _norm_of_groups([grads]), "foreach32": foreach32,
            "foreach_inf32": foreach_inf, "per_tensor64": per_tensor64, "per_tensor32": per_tensor32,
            "hybrid64 (big per tensor, small foreach)": hybrid64, "fused non-finite check": fused_check,
            "sum_sq_per_tensor64": sum_sq_per_tensor64}
    ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.double()) for t in grads])).item()
    out = {}
    for name, fn in ways.items():
        for _ in range(3):
            fn()
        ms, host = [], []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)  # keep the GPU busy while the host queues: events then time the GPU
            t0 = time.perf_counter()
            a.record()
            r = fn()
            b.record()
            host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            ms.append(a.elapsed_time(b))
        val = float(r.item()) if r.numel() == 1 else None
        gpu = statistics.median(ms)
        out[name] = {"gpu_ms": gpu, "host_ms": statistics.median(host) * 1e3, "TBps": nbytes / gpu / 1e9,
                     "value": val, "rel_err": None if val is None or "inf" in name or "fused" in name
                     else abs(val - ref) / ref}
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "grad_bytes": nbytes,
              "tensors": len(grads), "big": len(big), "ref": ref, "ways": out}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{report['device']} torch {report['torch']}: {len(grads)} grads ({len(big)} >= 64K elements), "
          f"{nbytes / 1e6:.0f} MB")
    for name, r in out.items():
        print(f"{name:<42} GPU {r['gpu_ms']:.3f} ms ({r['TBps']:.2f} TB/s)  host {r['host_ms']:.3f} ms  "
              f"rel err {r['rel_err']}")


if __name__ == "__main__":
    main()
