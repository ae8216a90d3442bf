"""The gradient check under a GradScaler driving a fused optimizer (real training steps on the CPU).

A fused Adam/AdamW gets ``step()`` called by the GradScaler on every step, overflowed ones
too, with the gradients still scaled: the kernel unscales them (writing them back) and
skips the update when the scaler found an overflow. The check must neither fail on such a
routine skip nor report the scaled norm.
"""

from __future__ import annotations

import torch

import reprokit
from reprokit.detect import DetectSettings, Monitor, global_norm


def _build(config=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return reprokit.TrainState(model=model, optimizer=opt, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))


def _step(state, batch):
    loss = state.model(batch["x"]).square().mean()
    state.scaler.scale(loss * batch["mult"]).backward()
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def _batches():
    g = torch.Generator().manual_seed(3)
    # Step 2's loss is multiplied by 1e36: its scaled gradients overflow, the scaler skips it.
    return [{"x": torch.randn(32, 8, generator=g), "mult": 1e36 if k == 2 else 1.0} for k in range(5)]


def test_overflow_skipped_by_the_scaler_is_no_failure_and_norms_are_unscaled():
    state = _build()
    unscaled: list[float] = []

    def reference(opt, *_):  # after the fused step the gradients are unscaled, in place
        unscaled.append(global_norm([p.grad for p in state.model.parameters()]).item())

    state.optimizer.register_step_post_hook(reference)
    monitor = Monitor(state, DetectSettings())
    results = [monitor.run(_step, b, k) for k, b in enumerate(_batches())]
    monitor.close()
    assert [r.failure for r in results] == [None] * 5, [r.failure for r in results]
    assert results[2].grad_norm is None, "a step the scaler skipped has no gradient norm"
    for k in (0, 1, 3, 4):
        # Scales are powers of two: dividing the scaled norm by the scale is exact.
        assert results[k].grad_norm == unscaled[k], (k, results[k].grad_norm, unscaled[k])
        assert results[k].grad_norm < 100  # not the scaled norm (~1e4 here)
    assert monitor.skip_streak == 0 and monitor.last_scale == 2.0**15


def test_recorder_with_a_fused_optimizer_and_grad_scaler_trains_through_an_overflow(tmp_path):
    state = _build()
    rec = reprokit.Recorder(state, _step, build=_build, out_dir=tmp_path, snapshot_every=3)
    for b in _batches():
        rec.step(b)  # raises TrainingFailure if the overflow were taken for a failure
    assert rec.bundles == []
    history = {h[0]: h[2] for h in rec._history}  # (step, loss, grad norm, ...)
    assert history[2] is None and all(history[k] is not None and history[k] < 100 for k in (0, 1, 3, 4))
