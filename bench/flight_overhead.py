"""Host time of the durable flight log's per-step work, record by record, on the CPU.

    python bench/flight_overhead.py                 # the GPT-2 bench's batch: 8x1024 token ids and targets (int64)
    python bench/flight_overhead.py --batch 8x1024 --repeat 400 --json
    python bench/flight_overhead.py --quick         # smoke run

``Recorder(durable=True)`` adds, per step: on the training thread, the ``step`` record of a CPU batch (its batch
and RNG state, written before the step runs), or a small ``begn`` record for a CUDA batch; and an ``end`` record
once the step is over. For a CUDA batch the writer thread encodes and writes the ``step`` record once the batch's
copy has landed, which is Python work holding the GIL while the training thread wants it to launch the next step's
kernels: its encode time is the fourth figure, and the part of it left for after the copy has landed (the hash, which
releases the GIL) the fifth. Each is timed over ``--repeat`` calls into a real flight log on local
disk (median and 90th percentile, microseconds), with the sha256 rate of this machine for scale. Beside them, a
whole step of a tiny model with ``durable=True`` and without, interleaved (the model is tiny so that the
recorder's host time is visible, not to price a real step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from io_bench import _commit  # the checkout's commit, or $BENCH_COMMIT

import reprokit
from reprokit.flight import FlightLog
from reprokit.rng import capture as capture_rng


def _times(fn, repeat: int) -> dict[str, float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    out.sort()
    return {"median_us": statistics.median(out) * 1e6, "p90_us": out[int(len(out) * 0.9)] * 1e6}


def _sha256_rate(nbytes: int) -> float:
    import hashlib

    data = bytes(nbytes)
    t0 = time.perf_counter()
    for _ in range(20):
        hashlib.sha256(data).digest()
    return 20 * nbytes / (time.perf_counter() - t0)


def build(config):
    torch.manual_seed(0)
    model = torch.nn.Embedding(256, 16)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def train_step(state, batch):
    loss = state.model(batch["idx"][:, :4]).float().pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


def records(batch: dict[str, torch.Tensor], repeat: int, folder: Path) -> dict[str, dict[str, float]]:
    tree = {k: {"__rk_tensor__": f"batch/{k}"} for k in batch}
    tensors = {f"batch/{k}": v for k, v in batch.items()}
    rng = capture_rng({})
    log = FlightLog.start(folder, "run-bench", None, {"rank": None, "world_size": None}, {}, {}, [], print)
    assert log is not None
    log.new_window(0, {}, {}, None)
    k = iter(range(10**9))
    after: dict[str, dict[str, float]] = {}
    if hasattr(log, "_step_frame"):  # the writer frames the record before the copy lands, hashes and writes after
        from reprokit.flight import _seal

        frame = log._step_frame(0, tree, tensors, rng)
        after["  of which once the copy has landed (hash)"] = _times(lambda: _seal(frame), repeat)
    try:
        return {
            "step record (CPU batch, training thread)": _times(lambda: log.step(next(k), tree, tensors, rng), repeat),
            "end record (training thread)": _times(lambda: log.record(b"end ", {"step": next(k), "loss": 2.5,
                                                                              "grad_norm": 1.25, "failed": False}),
                                                   repeat),
            "begn record (CUDA batch, training thread)": _times(lambda: log.record(b"begn", {"step": next(k)}), repeat),
            "step record encode (CUDA batch, writer thread)": _times(
                lambda: log._step_record(next(k), tree, tensors, rng), repeat),
            **after,
        }
    finally:
        log.close(remove=True)


def steps(batch: dict[str, torch.Tensor], rounds: int, block: int, folder: Path) -> dict[str, float]:
    state = build({})
    recs = {name: reprokit.Recorder(state, train_step, build=build, config={}, out_dir=folder / name,
                                    durable=name == "durable", snapshot_every=100) for name in ("recorder", "durable")}
    for r in recs.values():
        r.detach()
    times: dict[str, list[float]] = {name: [] for name in recs}
    for i in range(rounds):
        for name in (list(recs) if i % 2 else list(reversed(recs))):
            rec = recs[name]
            rec.attach()
            t0 = time.perf_counter()
            for _ in range(block):
                rec.step(batch)
            times[name].append((time.perf_counter() - t0) / block)
            rec.detach()
    for r in recs.values():
        r.close()
    med = {name: statistics.median(v) * 1e6 for name, v in times.items()}
    return {"recorder_step_us": med["recorder"], "durable_step_us": med["durable"],
            "durable_extra_us": med["durable"] - med["recorder"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="8x1024", help="shape of each of the two int64 batch tensors (default 8x1024)")
    ap.add_argument("--repeat", type=int, default=None, help="calls timed per record kind (default 400, quick 20)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds of whole steps (default 30, quick 2)")
    ap.add_argument("--quick", action="store_true", help="a few calls (smoke run)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeat = args.repeat or (20 if args.quick else 400)
    rounds = args.rounds or (2 if args.quick else 30)
    shape = tuple(int(x) for x in args.batch.split("x"))
    g = torch.Generator().manual_seed(1)
    batch = {"idx": torch.randint(0, 256, shape, generator=g), "targets": torch.randint(0, 256, shape, generator=g)}
    nbytes = sum(v.numel() * v.element_size() for v in batch.values())
    with tempfile.TemporaryDirectory(prefix="reprokit-flight-bench-") as tmp:
        recs = records(batch, repeat, Path(tmp) / "records")
        whole = steps(batch, rounds, 10, Path(tmp) / "steps")
    result = {"bench": "flight_overhead", "commit": _commit(), "device": "cpu", "torch": torch.__version__,
              "batch_bytes": nbytes, "repeat": repeat, "sha256_bytes_per_s": _sha256_rate(max(nbytes, 1 << 16)),
              "records": recs, "steps": whole}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"batch: 2 x int64[{args.batch}] = {nbytes / 1024:.0f} KiB; sha256 here: "
          f"{result['sha256_bytes_per_s'] / 1e9:.2f} GB/s ({nbytes / result['sha256_bytes_per_s'] * 1e6:.0f} us for "
          "the batch)")
    for name, t in recs.items():
        print(f"{name:48s} median {t['median_us']:8.1f} us   p90 {t['p90_us']:8.1f} us")
    print(f"whole step (tiny model, median of {rounds} rounds): recorder {whole['recorder_step_us']:.0f} us, "
          f"durable {whole['durable_step_us']:.0f} us, durable adds {whole['durable_extra_us']:.0f} us")


if __name__ == "__main__":
    sys.exit(main())
