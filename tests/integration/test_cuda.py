"""CUDA paths: CUDA RNG capture, pinned async batch copies, fp16 AMP with GradScaler.

CI has no GPU, so these skip there; they are run on the GPU machine
(`python -m pytest -m cuda`) before any change touching CUDA paths is merged.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from rk_testing import record

import reprokit
from reprokit import pytree
from reprokit.bundle import open_bundle

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")]


@pytest.mark.parametrize("amp", [False, True])
def test_cuda_run_records_and_replays_bit_exact_on_gpu(projects, tmp_path, amp):
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda", "amp": amp}
    rec, exc = record(gpu, cfg, gpu.batches(40, 33, "cuda"), tmp_path, snapshot_every=10)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 33
    b = open_bundle(exc.bundle)
    assert b.run["device"].startswith("cuda")
    _, _, rng = b.step(b.steps[0])  # the snapshot due at 30 may wait for earlier checks (lagged): a step or more
    assert "rng/cuda/0" in rng, "CUDA generator state is recorded per step"
    if amp:
        tree, tensors = b.state()
        scaler = pytree.decode(tree["state"]["scaler"], tensors)  # on a GPU: the scale as recorded, a 0-dim tensor
        assert float(scaler["scale"]) > 0 and set(scaler) == {"scale", "growth_factor", "backoff_factor",
                                                              "growth_interval", "_growth_tracker"}, scaler
    report = reprokit.replay(b, times=3)
    assert report.device == "cuda"
    assert report.verdict == "deterministic"
    # Dropout draws from the CUDA generator: bit-exact losses prove it was restored per step.
    assert report.fidelity["bit_exact"], report.fidelity


def test_cuda_state_spilled_in_parts_through_one_staging_buffer_replays_bit_exact(projects, tmp_path, monkeypatch):
    """Several part files written at once from the GPU, each through its own slice of the pinned staging buffer."""
    from reprokit import bundle as B
    from reprokit.bundle import tensorfile

    monkeypatch.setattr(tensorfile, "SHARD_BYTES", 4096)
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda", "amp": True}
    rec, exc = record(gpu, cfg, gpu.batches(40, 33, "cuda"), tmp_path / "out", snapshot_every=10,
                      spill_dir=tmp_path / "spill")
    b = open_bundle(exc.bundle)
    assert len(B.state_files(b.manifest["files"])) > 2, b.manifest["files"].keys()
    report = reprokit.replay(b, times=2)
    assert report.verdict == "deterministic" and report.fidelity["bit_exact"], report.fidelity


def test_cuda_batches_are_copied_to_pinned_memory(projects, tmp_path):
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path)
    batches = list(gpu.batches(3, None, "cuda"))
    for b in batches:
        rec.step(b)
    ring = rec._ring
    assert len(ring) == 3 and all(r.tensors["batch/x"].is_pinned() for r in ring)
    torch.cuda.synchronize()
    for r, b in zip(ring, batches):  # copied at step start, before its kernels
        assert torch.equal(r.tensors["batch/x"], b["x"].cpu()) and torch.equal(r.tensors["batch/y"], b["y"].cpu())
    assert rec._snapshot is not None and rec._snapshot.tensors["model/0.weight"].is_pinned()


def test_gpu_batch_edited_in_place_by_its_step_is_recorded_as_received(projects, tmp_path):
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    batches = list(gpu.batches(9, 7, "cuda"))
    originals = [b["x"].cpu() for b in batches]
    rec, exc = record(gpu, cfg, batches, tmp_path, snapshot_every=4, step=gpu.scribbling_step)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 7 and exc.bundle is not None
    b = open_bundle(exc.bundle)
    # The snapshot due at 4 waits while earlier steps' checks are on their way (postponed a step at a time, up to
    # max_lag): a host that runs ahead of the device can reach step 7 with the window still starting at 0.
    assert b.steps[-1] == 7 and b.steps == list(range(b.steps[0], 8)) and b.steps[0] in (0, 4, 5, 6, 7), b.steps
    for k in b.steps:
        torch.testing.assert_close(b.step(k)[0]["x"], originals[k], rtol=0, atol=0, equal_nan=True)
    assert reprokit.replay(b).reproduced


def test_gpu_bundle_replays_on_cpu(projects, tmp_path):
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    _, exc = record(gpu, cfg, gpu.batches(40, 33, "cuda"), tmp_path, snapshot_every=10)
    report = reprokit.replay(exc.bundle, device="cpu")
    assert report.device == "cpu" and report.reproduced
    # CPU kernels and the CPU dropout stream differ from CUDA's: reproduced, not bit-exact.
    assert report.fidelity["steps_compared"] == len(open_bundle(exc.bundle).steps)


def _syncs(fn) -> int:
    """How many synchronizing CUDA calls ``fn`` makes (torch's sync debug mode, counted)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


@pytest.mark.parametrize("amp", [False, True])
def test_recorder_adds_no_sync_in_100_steps(projects, tmp_path, amp):
    """The recorder never makes the host wait for the device: over 100 recorded steps (4 snapshots among them) torch's
    sync debug mode counts exactly the bare loop's synchronizing calls (the GradScaler's own, under amp). The one
    bounded wait (on a check's event, which the debug mode does not see) is counted by the recorder: at most one
    per snapshot (a postponed snapshot waits for the earlier steps' checks) plus one per check that reached max_lag,
    which a loop whose device keeps up with its host never does."""
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda", "amp": amp}
    batches = list(gpu.batches(110, None, "cuda"))
    bare_state = gpu.build(cfg)
    for b in batches[:5]:
        gpu.train_step(bare_state, b)
    bare = _syncs(lambda: [gpu.train_step(bare_state, b) for b in batches[10:]])
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path, snapshot_every=25)
    for b in batches[:10]:  # the first snapshot and the optimizer state's pinned buffers
        rec.step(b)
    torch.cuda.synchronize()
    before = rec.stats()["lag_waits"], rec.snapshot_stats["snapshots"]
    watched = _syncs(lambda: [rec.step(b) for b in batches[10:]])
    stats = rec.stats()
    waits, snapshots = stats["lag_waits"] - before[0], rec.snapshot_stats["snapshots"] - before[1]
    rec.close()
    assert watched == bare, (bare, watched)
    assert snapshots >= 3 and waits <= snapshots, (waits, snapshots, stats)
    assert stats["lag_max"] <= stats["max_lag"], stats


def test_a_nan_on_the_gpu_is_attributed_to_its_step_while_the_host_runs_ahead(projects, tmp_path):
    """The host queues steps ahead of a GPU held back by a sleep: step 6's NaN is seen later, and still attributed to
    step 6, with the window ending there; replay reproduces it bit for bit."""
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path, snapshot_every=4)
    exc = None
    for k, b in enumerate(gpu.batches(30, 6, "cuda")):
        if k == 6:
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of step 6: its check lands steps later
        try:
            rec.step(b)
        except reprokit.TrainingFailure as e:
            exc = e
            break
    assert exc is not None and exc.failure.step == 6, exc
    assert 0 < exc.detected_lag <= 8 and open_bundle(exc.bundle).steps[-1] == 6
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.step == 6 and report.fidelity["bit_exact"]


def test_async_snapshot_matches_a_synchronous_copy(projects, tmp_path):
    """Copies on the side stream land intact although training runs on right after the snapshot."""
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda", "amp": True}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path, snapshot_every=4,
                            max_lag=0)  # snapshots exactly every 4 steps
    batches = list(gpu.batches(9, None, "cuda"))
    for b in batches[:4]:
        rec.step(b)
    expected = {k: v.detach().cpu().clone() for k, v in state.model.state_dict().items()}
    exp_opt = {i: {k: v.detach().cpu().clone() for k, v in s.items()} for i, s in
               enumerate(state.optimizer.state_dict()["state"].values())}
    for b in batches[4:8]:  # step 4 snapshots, then three more steps overwrite params in place (no new snapshot)
        rec.step(b)
    rec._engine.wait()
    tensors = rec._snapshot.tensors
    for k, v in expected.items():
        assert torch.equal(tensors[f"model/{k}"], v), k
    for i, s in exp_opt.items():
        for k, v in s.items():
            assert torch.equal(tensors[f"optimizer/state/{i}/{k}"], v), (i, k)


@pytest.mark.parametrize("stage", [True, False])
def test_snapshot_longer_than_the_step_is_exact(projects, tmp_path, stage):
    """A ~0.8 GB state whose copy (~15 ms) outlasts a sub-millisecond forward and backward: the optimizer
    step comes while most copies are not issued. Staged: the rest is cloned on the device first. Not staged:
    the optimizer waits for the copy. Either way the snapshot is the state before that optimizer step."""
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda", "hidden": 1 << 21}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path, snapshot_every=3,
                            max_lag=0)  # snapshots exactly every 3 steps (checks judged at each step's end)
    rec._engine.stage_on_device = stage
    rec._engine.chunk_bytes, rec._engine.chunks_in_flight = 8 << 20, 1
    torch.empty(4 << 30, dtype=torch.uint8, device="cuda")  # freed at once: the cache holds it, as activations do
    batches = list(gpu.batches(6, None, "cuda"))
    for b in batches[:3]:
        rec.step(b)
    rec._engine.wait()
    expected = {k: v.detach().cpu().clone() for k, v in state.model.state_dict().items()}
    exp_opt = {i: {k: v.detach().cpu().clone() for k, v in s.items()} for i, s in
               enumerate(state.optimizer.state_dict()["state"].values())}
    for b in batches[3:6]:  # step 3 snapshots; its own optimizer step overwrites the params right after
        rec.step(b)
    rec._engine.wait()
    stats = rec.snapshot_stats
    if stage:
        assert stats["staged_bytes"] > 0 and not stats["waited_for_copy"], stats
    else:
        assert stats["staged_bytes"] == 0 and stats["waited_for_copy"], stats
    tensors = rec._snapshot.tensors
    assert rec._snapshot.step == 3 and not rec._engine.broken
    for k, v in expected.items():
        assert torch.equal(tensors[f"model/{k}"], v), k
    for i, s in exp_opt.items():
        for k, v in s.items():
            assert torch.equal(tensors[f"optimizer/state/{i}/{k}"], v), (i, k)


def test_snapshot_walk_is_prepared_during_the_previous_step(projects, tmp_path):
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path, snapshot_every=3,
                            max_lag=0)  # snapshots exactly every 3 steps (checks judged at each step's end)
    batches = list(gpu.batches(7, None, "cuda"))
    for b in batches[:4]:  # step 3 snapshots; its walk ran at the end of step 2
        rec.step(b)
    assert rec._snapshot.step == 3 and rec.snapshot_stats["prepared"]
    for b in batches[4:6]:
        rec.step(b)
    state.optimizer.param_groups[0]["lr"] = 0.5  # a loop that edits the state between steps
    rec.step(batches[6])
    assert rec._snapshot.step == 6 and not rec.snapshot_stats["prepared"], "the stale walk is redone"
    assert rec._snapshot.tree["state"]["optimizer"]["param_groups"][0]["lr"] == 0.5


@pytest.mark.parametrize("edit", ["unfreeze", "eval", "new_data"])
def test_a_loop_that_unfreezes_switches_mode_or_swaps_data_right_before_a_snapshot_gets_it_in_the_snapshot(
        projects, tmp_path, edit):
    """Schedules fire at round steps, which are snapshot steps: the walk prepared at the end of the step before must
    not be used for a model whose frozen parameters, modes or parameter data (a cast, a rescale) changed since."""
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    if edit == "unfreeze":
        state.model[0].requires_grad_(False)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path, snapshot_every=3,
                            max_lag=0)  # snapshots exactly every 3 steps (checks judged at each step's end)
    batches = list(gpu.batches(4, None, "cuda"))
    for b in batches[:3]:
        rec.step(b)
    if edit == "unfreeze":
        state.model[0].requires_grad_(True)
    elif edit == "eval":
        state.model[1].eval()
    else:
        w = state.model[3].weight
        w.data = w.data * 2  # new data for the same Parameter object
        doubled = w.detach().cpu().clone()
    rec.step(batches[3])  # step 3 takes the snapshot
    tree = rec._snapshot.tree["state"]
    assert rec._snapshot.step == 3 and not rec.snapshot_stats["prepared"], "the stale walk is redone"
    if edit == "unfreeze":
        assert tree["frozen"] == [], tree["frozen"]
    elif edit == "eval":
        assert tree["modes"] == {"1": False}, tree.get("modes")
    else:
        assert torch.equal(rec._snapshot.tensors["model/3.weight"], doubled)


def test_snapshot_buffers_are_pinned_when_the_recorder_is_made(projects, tmp_path):
    """Step 0's snapshot finds its pinned buffers ready: the CUDA driver's pinning is not on the first window."""
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path, snapshot_every=4)
    params = sum(p.numel() * p.element_size() for p in state.model.parameters())
    buffers = dict(rec._engine._buffers)
    assert rec._engine.held_bytes >= params and all(b.is_pinned() for b in buffers.values()), rec._engine.held_bytes
    rec.step(next(iter(gpu.batches(1, None, "cuda"))))
    assert rec._snapshot.step == 0
    assert all(rec._engine.last_buffers[k] is b for k, b in buffers.items()), "step 0 reused the buffers pinned ahead"
    other = rec._engine._buffers  # the next snapshot's set, pinned ahead too (the last one stays intact through it)
    assert other is not rec._engine.last_buffers and set(other) >= set(buffers)
    assert all(b.is_pinned() for b in other.values())
    rec.close()


def test_making_the_recorder_warms_the_checks_up_without_touching_the_run(projects, tmp_path):
    """Making the Recorder runs the norm kernels once (so step 0 does not load them): parameters, gradients and the
    CUDA generator are left exactly as they were."""
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    before = [p.detach().clone() for p in state.model.parameters()]
    offset = torch.cuda.default_generators[0].get_offset()
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] > allocations, "the norm ran on the device"
    assert all(torch.equal(a, p) for a, p in zip(before, state.model.parameters()))
    assert all(p.grad is None for p in state.model.parameters())
    assert torch.cuda.default_generators[0].get_offset() == offset
    rec.close()


def test_state_that_appears_later_is_pinned_aside_before_its_snapshot(projects, tmp_path):
    """AdamW's moments appear after step 0: a helper thread pins their buffers; the snapshot at step 3 uses them."""
    state, rec, batches = poisoned_gpu_run(projects("rk_gpu"), tmp_path / "out", snapshot_every=3, max_lag=0)
    params = sum(p.numel() * p.element_size() for p in state.model.parameters())
    rec.step(next(batches))
    assert rec._engine._pinning is not None, "step 0 made the moments: their buffers are pinned aside"
    # What the thread pins counts against the budget from its start: parameters + two moments per parameter, in both
    # sets of snapshot buffers (the last snapshot stays intact while the next one copies).
    assert rec._engine.held_bytes >= 6 * params and rec.stats()["peak_pinned_bytes"] >= 6 * params, rec.stats()
    rec._engine._pinning.join()
    for _ in range(3):
        rec.step(next(batches))
    # The moments live on the GPU and get pinned buffers; AdamW's `step` counters are CPU tensors (pageable copies).
    moments = {k: b for k, b in rec._engine.last_buffers.items()
               if k.startswith("optimizer/state/") and k.endswith(("/exp_avg", "/exp_avg_sq"))}
    assert len(moments) == 2 * len(list(state.model.parameters())), sorted(rec._engine.last_buffers)
    assert all(b.is_pinned() for b in moments.values()) and rec._snapshot.step == 3
    assert all(rec._snapshot.tensors[k] is b for k, b in moments.items()), "the snapshot copied into them"
    fails_and_replays_bit_exact(rec, batches)


def test_a_snapshot_that_comes_while_buffers_are_pinned_aside_waits_for_them(projects, tmp_path):
    """snapshot_every=1: the snapshot after step 0 needs the moments' buffers while the thread may still pin them."""
    _, rec, batches = poisoned_gpu_run(projects("rk_gpu"), tmp_path / "out", snapshot_every=1, max_lag=0)
    rec.step(next(batches))
    rec.step(next(batches))  # its snapshot joins the thread and copies into the buffers it pinned
    assert rec._engine._pinning is None and rec._engine._reserved == 0
    moments = [k for k in rec._snapshot.tensors if k.endswith(("/exp_avg", "/exp_avg_sq"))]
    assert moments and all(rec._snapshot.tensors[k].is_pinned() for k in moments)
    fails_and_replays_bit_exact(rec, batches)


def poisoned_gpu_run(gpu, out_dir, **recorder):
    """rk_gpu's model on the GPU under a fresh Recorder, and an iterator over 40 batches (step 9 carries a NaN)."""
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=out_dir, **recorder)
    return state, rec, iter(gpu.batches(40, 9, "cuda"))


def fails_and_replays_bit_exact(rec: reprokit.Recorder, batches) -> None:
    """Run ``batches`` into the failure they carry; its bundle replays twice, deterministic and bit-exact."""
    with pytest.raises(reprokit.TrainingFailure) as info:
        for b in batches:
            rec.step(b)
    report = reprokit.replay(info.value.bundle, times=2)
    assert report.verdict == "deterministic" and report.fidelity["bit_exact"], report.fidelity


def test_precision_matrix_on_the_gpu(projects, tmp_path):
    from reprokit.bisect import bisect_precision

    attn = projects("rk_gpu_attn")
    _, exc = record(attn, {}, attn.batches(12, 7), tmp_path, snapshot_every=5)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 7
    d = bisect_precision(open_bundle(exc.bundle))
    v = d["variants"]
    print("precision matrix on", torch.cuda.get_device_name(0), v, d["details"])
    assert v["recorded"] == "fail" and v["fp16"] == "fail"
    assert v["fp32"] == "pass" and v["bf16"] == "pass"
    for name in ("tf32_on", "tf32_off", "sdpa_math", "sdpa_flash", "sdpa_efficient"):
        assert v[name] != "n/a", name  # all of these run on an H100/H200
        assert v[name] == "fail", (name, d["details"][name])  # a kernel switch does not fix an fp16 overflow
    assert d["smallest_fix"] == "bf16"


def test_global_norm_on_the_gpu_matches_a_float64_reference():
    from reprokit.detect import global_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    ts = [torch.randn(n, device="cuda", generator=g) for n in (3, 1000, 7, 65536)] * 40  # 160 tensors
    ts.append(torch.full((4,), 2.0**100, device="cuda"))  # squares overflow float32
    want = torch.cat([t.double().flatten() for t in ts]).norm().item()
    assert abs(global_norm(ts).item() - want) <= 1e-12 * want
    ts[5][3] = float("nan")
    assert global_norm(ts).isnan().item()


def test_cuda_rng_state_read_as_seed_and_offset_matches_get_rng_state():
    from reprokit.state import capture_rng, restore_rng

    torch.cuda.manual_seed(3)
    torch.rand(4, device="cuda")
    for change in (lambda: torch.rand(4, device="cuda"), lambda: torch.cuda.manual_seed(4),
                   lambda: torch.randn(3, device="cuda"), lambda: torch.nn.functional.dropout(
                       torch.ones(1000, device="cuda"), 0.5)):
        change()
        tree, tensors = capture_rng()
        assert torch.equal(tensors["rng/cuda/0"], torch.cuda.get_rng_state())
        want = torch.rand(5, device="cuda")
        restore_rng(tree, tensors)
        assert torch.equal(torch.rand(5, device="cuda"), want)
    g = torch.Generator(device="cuda").manual_seed(9)
    tree, tensors = capture_rng({"g": g})
    want = torch.rand(5, device="cuda", generator=g)
    restore_rng(tree, tensors, {"g": g})
    assert torch.equal(torch.rand(5, device="cuda", generator=g), want)


def test_grad_check_catches_infinite_gradients_under_a_finite_loss_on_the_gpu(projects, tmp_path):
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    rec, exc = record(gpu, cfg, gpu.batches(20, None, "cuda", inf_grad_step=15), tmp_path, snapshot_every=10)
    assert isinstance(exc, reprokit.TrainingFailure), exc
    assert exc.failure.kind == "nonfinite_grad" and exc.failure.step == 15, exc.failure
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.verdict == "deterministic"


def _linear_state(seed: int = 0) -> reprokit.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).cuda()
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))


def _step_zeroing_in_place(state, batch):
    loss = state.model(batch).square().mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=False)  # writes the gradients right after the step
    return loss


def test_grad_norm_taken_aside_equals_the_inline_norm_and_the_step_waits_for_it():
    """The norm runs on a side stream; the training stream waits for it before writing the gradients.

    The side stream is held back by a 50 ms GPU sleep queued on it first: without the wait in
    the optimizer post-hook, ``zero_grad(set_to_none=False)`` would zero the gradients before
    the norm reads them, and the check would read 0.
    """
    from reprokit.detect import DetectSettings, Monitor, global_norm

    batch = torch.randn(64, 256, device="cuda")
    # The reference: the same step on an identical state, norm taken in line before the step.
    ref_state = _linear_state()
    ref_state.model(batch).square().mean().backward()
    want = global_norm([p.grad for p in ref_state.model.parameters()]).item()

    state = _linear_state()
    monitor = Monitor(state, DetectSettings())
    side = monitor._side[torch.device("cuda", torch.cuda.current_device())] = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
    result = monitor.run(_step_zeroing_in_place, batch, 0)
    monitor.close()
    assert result.failure is None
    assert result.grad_norm == want, (result.grad_norm, want)  # same kernels, other stream: bit for bit
    assert all(p.grad is not None and not p.grad.any() for p in state.model.parameters())


def test_gradients_an_optimizer_frees_in_its_step_are_not_reused_under_the_norm_aside():
    """An optimizer that frees the gradients inside its own step, after which the training stream allocates the same
    sizes and fills them with NaN (correct code on one stream). The norm aside is held back by a GPU sleep, so it
    runs after that fill, and the training stream waits for it only in the post-hook: the memory it reads must not
    have been handed out again (the monitor holds the gradients until the training stream waits for the norm)."""
    from reprokit.detect import DetectSettings, Monitor, global_norm

    junk: list[torch.Tensor] = []

    reused: list[int] = []

    class FreesItsGradients(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            params = [p for g in self.param_groups for p in g["params"]]
            freed = {p.grad.data_ptr() for p in params}
            for p in params:
                p.grad = None
            # Same-size blocks, kept, until the allocator hands out a freed gradient's memory (or 64 per size).
            for p in params:
                for _ in range(64):
                    junk.append(torch.full_like(p, float("nan")))
                    if junk[-1].data_ptr() in freed:
                        reused.append(junk[-1].data_ptr())
                        break

    batch = torch.randn(64, 256, device="cuda")
    ref_state = _linear_state()
    ref_state.model(batch).square().mean().backward()
    want = global_norm([p.grad for p in ref_state.model.parameters()]).item()

    def step(state, batch):
        loss = state.model(batch).square().mean()
        loss.backward()
        state.optimizer.step()
        return loss

    warm = _linear_state()  # every kernel of the step loaded before the timed one (loading stalls the host)
    warm.optimizer = FreesItsGradients(warm.model.parameters(), lr=1e-3)
    step(warm, batch)
    junk.clear()
    reused.clear()
    torch.cuda.synchronize()

    state = _linear_state()
    state.optimizer = FreesItsGradients(state.model.parameters(), lr=1e-3)
    monitor = Monitor(state, DetectSettings())
    side = monitor._side[torch.device("cuda", torch.cuda.current_device())] = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the whole step is queued and run on the training stream first
    result = monitor.run(step, batch, 0)
    monitor.close()
    torch.cuda.synchronize()
    assert junk and all(j.isnan().all() for j in junk)
    print(f"freed gradient blocks handed out again during the step: {len(reused)}")
    assert result.failure is None and result.grad_norm == want, (result.failure, result.grad_norm, want, reused)


def test_grad_check_aside_still_sees_a_nan_gradient():
    from reprokit.detect import DetectSettings, Monitor

    state = _linear_state()
    monitor = Monitor(state, DetectSettings(check_loss=False))

    def nan_grad_step(state, batch):
        loss = state.model(batch).square().mean()
        loss.backward()
        state.model[0].weight.grad[3, 7] = float("nan")
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        return loss

    result = monitor.run(nan_grad_step, torch.randn(8, 256, device="cuda"), 5)
    monitor.close()
    assert monitor._side, "the norm was taken on the side stream"
    assert result.failure is not None and result.failure.kind == "nonfinite_grad" and result.failure.step == 5


def test_gpu_batch_copies_land_before_a_loader_refills_its_buffer(projects, tmp_path):
    """Batch copies are queued on the training stream at step start: a refill queued before the next step
    (held back behind a 100 ms GPU sleep) runs after them."""
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path, snapshot_every=100)
    batches = list(gpu.batches(4, None, "cuda"))
    buf = {"x": torch.empty_like(batches[0]["x"]), "y": torch.empty_like(batches[0]["y"])}
    for b in batches:
        torch.cuda._sleep(100_000_000)
        buf["x"].copy_(b["x"])  # the loader's in-place refill, on the training stream
        buf["y"].copy_(b["y"])
        rec.step(buf)
    torch.cuda.synchronize()
    assert len(rec._ring) == 4
    for r, b in zip(rec._ring, batches):
        assert torch.equal(r.tensors["batch/x"], b["x"].cpu()) and torch.equal(r.tensors["batch/y"], b["y"].cpu())


def test_a_weight_renormalised_in_forward_during_the_snapshot_copy_is_never_torn(projects, tmp_path):
    """nn.Embedding(max_norm=...) writes its weight in forward while the asynchronous snapshot copy may still be
    reading it. The copy stream is held back (a GPU sleep queued on it before the copies), so without the
    version check the snapshot would hold the renormalised weight; with it, the snapshot is retaken one step later
    with the embedding cloned in stream order, and the bundle replays exactly."""
    trust = projects("rk_trust")
    cfg = {"max_norm": 0.5, "device": "cuda", "dim": 256}
    state = trust.build(cfg)
    rec = reprokit.Recorder(state, trust.train_step, build=trust.build, config=cfg, out_dir=tmp_path,
                            snapshot_every=6, max_lag=0)  # snapshot steps exact: checks judged at each step's end
    engine = rec._engine
    engine._stream = torch.cuda.Stream()
    real_issue = engine._issue

    def held_back(plan, ready, done, device):
        with torch.cuda.stream(engine._stream):
            torch.cuda._sleep(200_000_000)
        return real_issue(plan, ready, done, device)

    engine._issue = held_back
    exc = None
    with pytest.warns(reprokit.RecorderWarning, match="written outside optimizer.step"):
        for b in trust.batches(20, blow_up_step=15, device="cuda", d=256):
            try:
                rec.step(b)
            except reprokit.TrainingFailure as e:
                exc = e
                break
    assert exc is not None and exc.bundle is not None and exc.failure.step == 15
    assert "model/emb.weight" in engine._volatile
    b = open_bundle(exc.bundle)
    assert b.steps == [13, 14, 15], b.steps  # step 0's snapshot was torn, retaken at 1, then 7 and 13
    report = reprokit.replay(b, times=2)
    assert report.reproduced and report.fidelity["bit_exact"], report.fidelity


@pytest.mark.parametrize("unscale_first", [False, True])
def test_grad_check_with_grad_scaler_and_fused_adamw_on_the_gpu(unscale_first):
    """Fused AdamW unscales the gradients inside its step (in line here); after ``unscale_`` they
    are not written (side stream). Either way a skipped overflow is no failure, norms are unscaled.

    The side stream is held back by a GPU sleep before every step: the overflow mask must be
    applied there, not on the training stream before it waits for the norm."""
    from reprokit.detect import DetectSettings, Monitor, global_norm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)).cuda()
    state = reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
                                scaler=torch.amp.GradScaler("cuda", init_scale=2.0**16))
    unscaled: list[float] = []
    state.optimizer.register_step_post_hook(
        lambda *_: unscaled.append(global_norm([p.grad for p in model.parameters()]).item()))

    def step(state, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = state.model(batch["x"]).float().square().mean()
        state.scaler.scale(loss * batch["mult"]).backward()
        if unscale_first:
            state.scaler.unscale_(state.optimizer)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.optimizer.zero_grad(set_to_none=True)
        return loss

    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [{"x": torch.randn(32, 64, device="cuda", generator=g), "mult": 1e36 if k == 2 else 1.0}
               for k in range(5)]
    monitor = Monitor(state, DetectSettings())
    side = monitor._side[torch.device("cuda", torch.cuda.current_device())] = torch.cuda.Stream()
    aside: list[int] = []
    norm_aside = monitor._norm_aside
    monitor._norm_aside = lambda *a: (aside.append(1), norm_aside(*a))[1]  # type: ignore[method-assign]
    results = [monitor.run(step, b, k) for k, b in enumerate(batches)]
    monitor.close()
    assert [r.failure for r in results] == [None] * 5
    assert results[2].grad_norm is None
    assert len(aside) == (5 if unscale_first else 0), "side stream only when the step does not write the gradients"
    for k in (0, 1, 3, 4):
        assert results[k].grad_norm == unscaled[k], (k, results[k].grad_norm, unscaled[k])


@pytest.mark.parametrize("fused", [False, True])
def test_the_state_copied_to_the_gpu_while_read_restores_exactly_as_the_host_copy(projects, tmp_path, monkeypatch,
                                                                                  fused):
    """The first restore of a replay takes the model and optimizer tensors the load copied to the GPU (several state
    files, copied from the reading threads): the restored state equals the host path's in value, dtype and device
    (AdamW's ``step`` stays where the optimizer keeps it: the CPU, or the GPU when fused), the optimizer keeps the
    copies without cloning them, and both replays fail at the same step with the same losses; a second restore reads
    host memory and does the same."""
    from reprokit.bundle import state_files, tensorfile
    from reprokit.replayer import Session

    monkeypatch.setattr(tensorfile, "SHARD_BYTES", 4096)
    gpu = projects("rk_gpu")
    cfg = {"device": "cuda", "amp": True, "hidden": 256}
    project = SimpleNamespace(build=gpu.build_fused, train_step=gpu.train_step) if fused else gpu
    _, exc = record(project, cfg, gpu.batches(40, 33, "cuda"), tmp_path, snapshot_every=10)
    assert isinstance(exc, reprokit.TrainingFailure), exc
    b = open_bundle(exc.bundle)
    assert len(state_files(b.manifest["files"])) > 2

    def replayed(preload: bool):
        with Session(b, preload=preload) as s:
            pre = dict(s._preload._tensors) if s._preload is not None else {}
            s.restore()
            assert s._preload is None
            opt = s.state.optimizer
            kept = {t.data_ptr() for st in opt.state.values() for t in st.values()}
            handed = bool(pre) and {t.data_ptr() for k, t in pre.items() if k.startswith("optimizer/")} <= kept
            live = {**s.state.model.state_dict(),
                    **{f"{i}/{k}": v for i, st in enumerate(opt.state.values()) for k, v in st.items()}}
            live = {k: (v.device, v.dtype, v.cpu().clone()) for k, v in live.items()}
            first, again = s.run(s.inputs(), restore=False), s.run(s.inputs())
            return sorted(pre), handed, live, first, again

    keys, handed, on, first, again = replayed(True)
    none, _, off, ref, _ = replayed(False)
    assert none == [] and keys, "a GPU copy is made on the preload path only"
    assert {k.split("/", 1)[0] for k in keys} == {"model", "optimizer"} and not any(k.endswith("/step") for k in keys)
    assert handed, "the optimizer keeps the GPU copies as they are"
    assert on.keys() == off.keys()
    for k, (dev, dtype, v) in on.items():
        assert (dev, dtype) == off[k][:2] and torch.equal(v, off[k][2]), k
    assert first.same and ref.same and repr(first.losses) == repr(ref.losses)  # repr: NaN equals NaN
    assert again.same and repr(again.losses) == repr(first.losses)

    with Session(b, preload=True) as s:  # another snapshot restored first: the copies are dropped, unused
        assert s._preload is not None and s._preload._tensors
        s.restore((s.snapshot[0], {k: v.clone() for k, v in s.snapshot[1].items()}))
        assert s._preload is None
        assert all(torch.equal(v.cpu(), on[k][2]) for k, v in s.state.model.state_dict().items())


def test_no_gpu_copy_while_read_for_an_optimizer_that_loads_its_own_way(projects, tmp_path):
    from reprokit.replayer import _Preload

    class Own(torch.optim.AdamW):
        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)

    gpu = projects("rk_gpu")
    state, rec, batches = poisoned_gpu_run(gpu, tmp_path)
    with pytest.raises(reprokit.TrainingFailure) as info:
        for b in batches:
            rec.step(b)
    b = open_bundle(info.value.bundle)
    assert _Preload.make(state, b, torch.device("cuda")) is not None
    state.optimizer = Own(state.model.parameters())
    assert _Preload.make(state, b, torch.device("cuda")) is None
    assert _Preload.make(gpu.build({"device": "cpu"}), b, torch.device("cpu")) is None


def test_a_cpu_bundle_replayed_on_the_gpu_gives_every_run_the_same_cuda_draws(projects, tmp_path):
    """The bundle has no CUDA generator state (recorded where CUDA was never used): each restore seeds the GPU's
    generator as a fresh process would, so dropout draws the same masks in every --times run (before, run 2 went on
    from where run 1 left the generator)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = ("import sys; sys.path[:0] = ['tests', 'tests/projects']; import rk_gpu, rk_testing; "
            f"_, e = rk_testing.record(rk_gpu, {{'device': 'cpu'}}, rk_gpu.batches(12, 9, 'cpu'), {str(tmp_path)!r}, "
            "snapshot_every=5); print(rk_testing.bundle_of(e))")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    bundle = Path(proc.stdout.strip().splitlines()[-1])
    assert not any(k.startswith("rng/cuda/") for k in open_bundle(bundle).step(9)[2])
    report = reprokit.replay(bundle, times=3, device="cuda")
    assert report.device == "cuda" and report.verdict == "deterministic"
    assert report.fidelity["runs_bit_identical"], [r.losses for r in report.runs]
