import statistics, tempfile, time, gc
import torch
from recorder_overhead import build, make_batch, train_step
import reprokit
from reprokit.detect import StepResult
cfg = {"layers": 12, "d": 768, "heads": 12, "vocab": 50304, "ctx": 1024, "batch": 8, "device": "cuda"}
state = build(cfg)
g = torch.Generator(device="cuda").manual_seed(1)
rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=tempfile.mkdtemp())
for _ in range(105): rec.step(make_batch(cfg, g)).item()
M = rec.monitor
res = {}
def add(k, v): res.setdefault(k, []).append(v)
def run(step_fn, batch, step, after=None):
    M._norms.clear()
    loss = step_fn(M.state, batch)
    after()
    t0 = time.perf_counter()
    loss_f, grad_norm, param_norm = M._read(loss)
    t1 = time.perf_counter(); add("read", t1 - t0)
    f = M._check(step, loss_f, grad_norm, param_norm)
    t2 = time.perf_counter(); add("check", t2 - t1)
    r = StepResult(loss_f, grad_norm, f, value=loss)
    add("stepresult", time.perf_counter() - t2)
    res["mark"] = time.perf_counter()
    return r
M.run = run
def step(batch):
    k = rec.step_index
    record = rec._record_step_start(k, batch)
    result = M.run(rec.train_step, batch, k, after=rec._after_step)
    t0 = time.perf_counter(); add("run return", t0 - res["mark"])
    rec.step_index += 1
    if rec._referenced:
        rec._check_referenced(k)
    t1 = time.perf_counter(); add("check_referenced", t1 - t0)
    if record is not None:
        record.loss, record.grad_norm = result.loss, result.grad_norm
    rec._history.append((k, result.loss, result.grad_norm))
    t2 = time.perf_counter(); add("history", t2 - t1)
    return result.value
for label in ("gc on", "gc off"):
    if label == "gc off": gc.disable()
    res.clear()
    for _ in range(200):
        b = make_batch(cfg, g); torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(b)
        add("return", time.perf_counter() - t0)
        loss.item()
    print(label)
    for k, v in res.items():
        if k != "mark": print(f"  {k:30}{statistics.median(v)*1e6:9.1f}{statistics.mean(v)*1e6:9.1f}")
