"""What does the per-step gradient-norm check cost, and is it host time or GPU time? (GPT-2-124M, CUDA)

    PYTHONPATH=bench python bench/probes/gradcheck_probe.py [--rounds 60] [--json]

Same model, step and protocol as recorder_overhead.py (10-step blocks, order rotated
every round, 95% intervals over per-round ratios; before each step only the training
stream is synchronised, so side-stream work that spills over counts), but no Recorder: each variant is
the bare step plus one way of taking the global L2 norm of the gradients, read in the
same transfer as the loss (as the recorder's Monitor does):

- ``read``: no norm; the loss read as the Monitor does it (float64 cat + one transfer).
- ``eager``: the Monitor's norm (``_foreach_norm`` in float64) in an optimizer pre-hook.
- ``graph``: the same norm replayed from a CUDA graph while the gradients sit at the
  captured addresses (host cost ~0, GPU cost the same).
- ``busy``: no norm; the pre-hook busy-waits for the eager hook's measured host time
  (host cost only, GPU cost 0).
- ``side``: the eager norm on a side stream (gradients ``record_stream``-ed), read one
  step late: its GPU time overlaps with what follows.
- ``side-join``: the eager norm on a side stream, the training stream waits for it in an
  optimizer post-hook (overlaps the optimizer step only), read in the same step.
- ``backward``: norms taken during backward in ~32 MB buckets on a side stream, from
  post-accumulate-grad hooks, so the memory-bound norm overlaps the compute-bound backward.

Also prints the eager norm's GPU time (CUDA events) and its pre-hook host time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from host_sensitivity import busy
from recorder_overhead import build, cuda_bench_config, make_batch, train_step

from reprokit.detect import _norm_of_groups, group_by_device_dtype


class GraphNorm:
    """The eager norm captured into a CUDA graph per address layout (last two layouts kept)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.recent: list[tuple[int, ...]] = []
        self.replays = self.eager = 0

    def __call__(self, groups: list[list[torch.Tensor]]) -> torch.Tensor:
        ptrs = tuple([g.data_ptr() for gs in groups for g in gs])
        hit = self.graphs.get(ptrs)
        if hit is None and ptrs in self.recent:
            main = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(main)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = _norm_of_groups(groups)
                finally:
                    graph.capture_end()
            main.wait_stream(side)
            hit = self.graphs[ptrs] = (graph, out)
            while len(self.graphs) > 2:
                del self.graphs[next(iter(self.graphs))]
        self.recent = (self.recent + [ptrs])[-2:]
        if hit is None:
            self.eager += 1
            return _norm_of_groups(groups)
        self.replays += 1
        hit[0].replay()
        return hit[1].clone()


class BackwardNorm:
    """Sum of squares of each gradient bucket, taken on a side stream as backward produces them."""

    def __init__(self, params: list[torch.Tensor], bucket_bytes: int = 32 << 20) -> None:
        self.params = params
        self.bucket_bytes = bucket_bytes
        self.side = torch.cuda.Stream()
        self.pending: list[torch.Tensor] = []
        self.pending_bytes = 0
        self.parts: list[torch.Tensor] = []
        self.handles: list = []

    def attach(self) -> None:
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _hook(self, p: torch.Tensor) -> None:
        g = p.grad
        self.pending.append(g)
        self.pending_bytes += g.numel() * g.element_size()
        if self.pending_bytes >= self.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side), torch.no_grad():
            sq = torch.stack(torch._foreach_norm(self.pending, 2, dtype=torch.float64)).square().sum()
        for g in self.pending:
            g.record_stream(self.side)
        self.parts.append(sq)
        self.pending, self.pending_bytes = [], 0

    def finish(self) -> torch.Tensor:
        self.flush()
        with torch.cuda.stream(self.side):
            total = torch.stack(self.parts).sum().sqrt()
        torch.cuda.current_stream().wait_stream(self.side)
        self.parts = []
        return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--only", default=None, help="comma-separated variants (default: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cfg = cuda_bench_config()
    state = build(cfg)
    opt = state.optimizer
    params = [p for grp in opt.param_groups for p in grp["params"]]
    groups_p = group_by_device_dtype(params)
    g = torch.Generator(device="cuda").manual_seed(1)
    graph_norm = GraphNorm()
    bwd = BackwardNorm(params)
    side = torch.cuda.Stream()
    box: dict[str, object] = {"norm": None, "prev": None, "host": []}
    busy_s = [0.0]

    def grads() -> list[list[torch.Tensor]]:
        return [[p.grad for p in ps if p.grad is not None] for ps in groups_p]

    def hook_eager(*_):
        t0 = time.perf_counter()
        box["norm"] = _norm_of_groups(grads())
        box["host"].append(time.perf_counter() - t0)  # type: ignore[union-attr]

    def hook_graph(*_):
        box["norm"] = graph_norm(grads())

    def hook_busy(*_):
        busy(busy_s[0])

    def hook_side(*_):
        gs = grads()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            n = _norm_of_groups(gs)
        for grp in gs:
            for t in grp:
                t.record_stream(side)
        ev = torch.cuda.Event()
        ev.record(side)
        box["norm"] = (n, ev)

    def hook_side_join(*_):
        gs = grads()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            box["norm"] = _norm_of_groups(gs)
        for grp in gs:
            for t in grp:
                t.record_stream(side)

    def post_join(*_):
        torch.cuda.current_stream().wait_stream(side)

    def hook_bwd(*_):
        box["norm"] = bwd.finish()

    hooks = {"eager": hook_eager, "graph": hook_graph, "busy": hook_busy, "side": hook_side, "side-join": hook_side_join,
             "backward": hook_bwd}
    norms_seen: dict[str, list[float]] = {}

    def read(name: str, loss: torch.Tensor) -> None:
        parts = [loss.detach().reshape(1).double()]
        n = box["norm"]
        if name == "side":
            n, box["prev"] = box["prev"], n
            if n is not None:
                torch.cuda.current_stream().wait_event(n[1])  # type: ignore[index]
                n = n[0]  # type: ignore[index]
        if isinstance(n, torch.Tensor):
            parts.append(n.reshape(1))
        got = torch.cat(parts).tolist()
        if len(got) > 1:
            norms_seen.setdefault(name, []).append(got[1])
        box["norm"] = None

    def run_block(name: str, n: int) -> list[float]:
        h = opt.register_step_pre_hook(hooks[name]) if name in hooks else None
        post = opt.register_step_post_hook(post_join) if name == "side-join" else None
        if name == "backward":
            bwd.attach()
        box["prev"] = None
        times = []
        try:
            for _ in range(n):
                batch = make_batch(cfg, g)
                torch.cuda.current_stream().synchronize()  # not the side streams: their work may spill over
                t0 = time.perf_counter()
                loss = train_step(state, batch)
                if name.startswith("bare"):
                    loss.item()
                else:
                    read(name, loss)
                times.append(time.perf_counter() - t0)
        finally:
            if h:
                h.remove()
            if post:
                post.remove()
            bwd.detach()
        return times

    # GPU time of the eager norm alone, on gradients left by a real backward.
    run_block("bare", 5)
    batch = make_batch(cfg, g)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = state.model(batch["idx"])
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                      batch["targets"].reshape(-1)).backward()
    gpu_ms = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        _norm_of_groups(grads())
        b.record()
        torch.cuda.synchronize()
        gpu_ms.append(a.elapsed_time(b))
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    opt.zero_grad(set_to_none=True)

    variants = ["bare", "read", "eager", "graph", "busy", "side", "side-join", "backward", "bare (A/A)"]
    if args.only:
        variants = ["bare"] + [v for v in args.only.split(",") if v in variants and v != "bare"]
    if "busy" in variants and "eager" not in variants:
        variants.insert(1, "eager")  # busy waits for eager's measured host time
    for v in variants:
        run_block("bare" if v == "bare (A/A)" else v, 20)
    busy_s[0] = statistics.median(box["host"]) if box["host"] else 0.0  # type: ignore[arg-type]
    box["host"] = []
    blocks: dict[str, list[float]] = {v: [] for v in variants}
    steps: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args.rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            t = run_block("bare" if v == "bare (A/A)" else v, args.block)
            blocks[v].append(statistics.mean(t))
            steps[v] += t
    table = {}
    bare = statistics.mean(steps["bare"])
    for v in variants:
        r = [m / b for m, b in zip(blocks[v], blocks["bare"])]
        half = 1.96 * statistics.stdev(r) / math.sqrt(len(r))
        table[v] = {"mean_ms": statistics.mean(steps[v]) * 1e3, "median_ms": statistics.median(steps[v]) * 1e3,
                    "ratio": statistics.mean(steps[v]) / bare,
                    "ratio_ci95": [statistics.mean(r) - half, statistics.mean(r) + half],
                    "extra_ms": (statistics.mean(steps[v]) - bare) * 1e3}
    agree = {}
    for v, ns in norms_seen.items():
        agree[v] = {"n": len(ns), "finite": all(math.isfinite(x) for x in ns), "last": ns[-1]}
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "grad_bytes": grad_bytes, "eager_norm_gpu_ms": statistics.median(gpu_ms),
              "eager_hook_host_ms": statistics.median(box["host"]) * 1e3 if box["host"] else None,  # type: ignore
              "busy_ms": busy_s[0] * 1e3, "graph_replays": graph_norm.replays, "graph_eager": graph_norm.eager,
              "variants": table, "norms": agree}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"device {report['device']}, torch {report['torch']}; grads {grad_bytes / 1e6:.0f} MB; eager norm GPU "
          f"{report['eager_norm_gpu_ms']:.3f} ms, eager hook host {report['eager_hook_host_ms']} ms; graph "
          f"replays {graph_norm.replays}, eager {graph_norm.eager}")
    print(f"{'variant':<14}{'mean ms':>9}{'median ms':>11}{'x bare':>8}{'extra ms':>10}{'95% CI':>18}")
    for v, r in table.items():
        print(f"{v:<14}{r['mean_ms']:>9.2f}{r['median_ms']:>11.2f}{r['ratio']:>8.3f}{r['extra_ms']:>10.3f}"
              "{:>18}".format("[{:.3f}, {:.3f}]".format(*r["ratio_ci95"])))
    print("norms:", agree)


if __name__ == "__main__":
    main()
