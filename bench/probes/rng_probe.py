"""Does reading RNG state block while the GPU is busy? (CUDA)"""

import random
import time

import numpy as np
import torch

a = torch.randn(8192, 8192, device="cuda")
gen = torch.cuda.default_generators[0]
calls = {
    "torch.cuda.get_rng_state()": lambda: torch.cuda.get_rng_state(0),
    "default_generators[0].get_state()": gen.get_state,
    "default_generators[0].get_offset()": getattr(gen, "get_offset", lambda: None),
    "default_generators[0].initial_seed()": gen.initial_seed,
    "torch.get_rng_state()": torch.get_rng_state,
    "random.getstate()": random.getstate,
    "np.random.get_state()": lambda: np.random.get_state(legacy=True),
    "np.random.get_state() again": lambda: np.random.get_state(legacy=True),
    "_rand._bit_generator.state": lambda: np.random.mtrand._rand._bit_generator.state,
    "RandomState.get_state (direct)": lambda: np.random.mtrand._rand.get_state(legacy=True),
}
print("numpy", np.__version__)
for name, fn in calls.items():
    for busy in (False, True):
        torch.cuda.synchronize()
        total = 0.0
        for _ in range(20):
            if busy:
                a @ a  # ~1 ms of GPU work queued
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
        print(f"{name:<40} {'busy' if busy else 'idle'} {total / 20 * 1e6:9.1f} us")
