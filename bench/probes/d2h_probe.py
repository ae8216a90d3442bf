"""How long does the host block when issuing device-to-host copies into pinned memory? (CUDA only)"""

import time

import torch

src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
print("pinned:", dst.is_pinned())
for _ in range(3):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"one 1 GiB copy: host {1e3 * (t1 - t0):.2f} ms, total {1e3 * (t2 - t0):.2f} ms")
parts_src = [torch.empty(2 << 20, dtype=torch.uint8, device="cuda") for _ in range(450)]
parts_dst = [torch.empty(2 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(450)]
side = torch.cuda.Stream()
for label, stream in (("default stream", None), ("side stream", side)):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream) if stream else torch.cuda.stream(torch.cuda.current_stream()):
        for d, s in zip(parts_dst, parts_src):
            d.copy_(s, non_blocking=True)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"450 x 2 MiB copies on {label}: host {1e3 * (t1 - t0):.2f} ms, total {1e3 * (t2 - t0):.2f} ms")
torch.cuda.synchronize()
t0 = time.perf_counter()
with torch.cuda.stream(side):
    torch._foreach_copy_(parts_dst, parts_src, non_blocking=True)
t1 = time.perf_counter()
torch.cuda.synchronize()
print(f"_foreach_copy_ 450 x 2 MiB: host {1e3 * (t1 - t0):.2f} ms, total {1e3 * (time.perf_counter() - t0):.2f} ms")
raw = torch.cuda.memory.caching_allocator_alloc if False else None
# cudaMemcpyAsync through the CUDA runtime directly, bypassing torch's copy path:
cudart = torch.cuda.cudart()
torch.cuda.synchronize()
t0 = time.perf_counter()
for d, s in zip(parts_dst, parts_src):
    cudart.cudaMemcpyAsync(d.data_ptr(), s.data_ptr(), s.numel(), 2, side.cuda_stream) if hasattr(
        cudart, "cudaMemcpyAsync") else d.copy_(s, non_blocking=True)
t1 = time.perf_counter()
torch.cuda.synchronize()
print(f"runtime cudaMemcpyAsync x450: host {1e3 * (t1 - t0):.2f} ms, total {1e3 * (time.perf_counter() - t0):.2f} ms"
      f" (direct={hasattr(cudart, 'cudaMemcpyAsync')})")
