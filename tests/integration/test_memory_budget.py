"""The recorder never takes the job's memory: a host-memory budget for the window and the snapshot."""

from __future__ import annotations

import warnings

import pytest
import torch

import reprokit
from reprokit.bundle import open_bundle
from reprokit.record import default_host_budget


def _held_by_tensors(rec) -> int:
    """What the recorder's buffers really occupy, counted from the tensors (not from its own accounting)."""
    engine = rec._engine
    buffers = list(rec._pool.slots.values()) + list(engine._buffers.values())
    if engine._staging is not None:
        buffers.append(engine._staging)
    return sum(t.untyped_storage().nbytes() for t in buffers) + rec._ring_other


def _train(mlp, cfg, rec, batches):
    peak = 0
    for b in batches:
        try:
            rec.step(b)
        except reprokit.TrainingFailure as e:
            return e, max(peak, _held_by_tensors(rec))
        peak = max(peak, _held_by_tensors(rec))
    return None, peak


@pytest.mark.slow
def test_a_large_batch_run_with_a_huge_snapshot_every_stays_under_a_small_budget(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adamw", "dim": 1024, "batch_size": 256, "lr": 1e-4}  # ~1.1 MB per batch
    budget = 8 << 20
    state = mlp.build(cfg)
    rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config=cfg, out_dir=tmp_path,
                            snapshot_every=10**9, host_memory_budget=budget)
    with pytest.warns(reprokit.RecorderWarning, match="reached the host-memory budget"):
        exc, peak = _train(mlp, cfg, rec, mlp.batches(cfg, 40, poison_step=33))
    stats = rec.stats()
    assert peak <= budget, (peak, stats)
    assert stats["peak_pinned_bytes"] + stats["peak_pageable_bytes"] <= budget, stats
    assert stats["early_snapshots"] >= 3 and stats["window_steps"] < 10, stats
    assert exc is not None and exc.failure.step == 33 and exc.bundle is not None
    b = open_bundle(exc.bundle)
    assert 1 <= len(b.steps) < 10 and b.steps[-1] == 33, b.steps
    assert b.run["recorder"]["memory"]["early_snapshots"] == stats["early_snapshots"]
    report = reprokit.replay(b, times=2)
    assert report.reproduced and report.fidelity["bit_exact"], report.fidelity


def test_buffers_are_a_reused_pool_in_steady_state(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd", "dim": 64, "batch_size": 64}
    state = mlp.build(cfg)
    rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config=cfg, out_dir=tmp_path, snapshot_every=5)
    batches = list(mlp.batches(cfg, 30))
    for b in batches[:10]:
        rec.step(b)
    slots = {k: v.data_ptr() for k, v in rec._pool.slots.items()}
    buffers = {k: v.data_ptr() for k, v in rec._engine._buffers.items()}
    for b in batches[10:]:
        rec.step(b)
    assert {k: v.data_ptr() for k, v in rec._pool.slots.items()} == slots, "batch buffers reused, none allocated"
    assert {k: v.data_ptr() for k, v in rec._engine._buffers.items()} == buffers, "snapshot buffers reused"


@pytest.mark.slow
def test_a_state_bigger_than_the_budget_is_snapshotted_to_disk_and_said_once(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adamw", "dim": 4096, "batch_size": 4}  # model 262 KB, with AdamW state 786 KB
    budget = 600 << 10
    state = mlp.build(cfg)
    rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config=cfg, out_dir=tmp_path / "out",
                            snapshot_every=4, host_memory_budget=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exc, peak = _train(mlp, cfg, rec, mlp.batches(cfg, 14, poison_step=12))
    spilled = [str(w.message) for w in caught if "does not fit the recorder's host-memory budget" in str(w.message)]
    assert len(spilled) == 1, [str(w.message) for w in caught]
    assert "(0.44 MiB)" in spilled[0] and "snapshots are written to" in spilled[0], spilled
    assert peak <= budget
    assert rec.stats()["snapshots_spilled"] and rec.stats()["snapshot_bytes"] == 0
    assert list((tmp_path / "out" / ".reprokit-spill").rglob("*.safetensors"))
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.fidelity["bit_exact"]
    rec.close()
    assert not list((tmp_path / "out" / ".reprokit-spill").rglob("*")), "close() removes the spilled snapshot"


def test_a_batch_that_cannot_fit_is_not_recorded_and_training_goes_on(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "sgd", "dim": 1024, "batch_size": 256}
    state = mlp.build(cfg)
    rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config=cfg, out_dir=tmp_path,
                            host_memory_budget=1 << 20)
    with pytest.warns(reprokit.RecorderWarning):
        exc, peak = _train(mlp, cfg, rec, mlp.batches(cfg, 6, poison_step=4))
    assert peak <= 1 << 20
    assert isinstance(exc, reprokit.TrainingFailure) and exc.bundle is None
    assert rec.stats()["unrecorded_steps"] >= 1


def test_the_default_budget_is_a_share_of_this_machine(monkeypatch):
    one = default_host_budget()
    assert 0 < one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_host_budget() in range(one // 4 - (64 << 20), one // 4 + (64 << 20))  # available RAM moves a bit
    with pytest.raises(reprokit.ConfigError, match="host_memory_budget"):
        m = torch.nn.Linear(2, 2)
        reprokit.Recorder(reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)),
                          _step, build=_build, host_memory_budget=0)


def _build(config):
    m = torch.nn.Linear(2, 2)
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def _step(state, batch):
    return state.model(batch).sum()


def test_a_state_that_grows_after_the_first_snapshot_still_stays_under_the_budget(tmp_path):
    """The first snapshot has no AdamW moments; the next is 3x larger. Room for it is judged on the new size."""
    state = _build_linear(256)
    S = sum(p.numel() * 4 for p in state.model.parameters())
    budget = int(S * 4.5)
    rec = reprokit.Recorder(state, _linear_step, build=_build_linear_default, out_dir=tmp_path, snapshot_every=4,
                            host_memory_budget=budget)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(12):
            rec.step({"x": torch.randn(128, 256, generator=g)})
            assert rec.held_bytes() <= budget and _held_by_tensors(rec) <= budget, rec.stats()


def test_a_skipped_snapshot_does_not_leave_a_stale_prepared_walk(tmp_path):
    """prepare() walks the state after the step before a due snapshot; if that snapshot is then skipped (its batch
    does not fit the budget), a later snapshot must walk afresh, not take the old walk's plain values."""
    state = _build_linear(4)
    state.extra["n"] = 0
    rec = reprokit.Recorder(state, _counting_step, build=_build_linear_default, out_dir=tmp_path, snapshot_every=2,
                            host_memory_budget=200_000)
    rec._engine._stream = object()  # as after a CUDA snapshot: prepare() walks ahead (this machine has no GPU)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            b = {"x": torch.ones(3, 4)}
            if i == 2:
                b["big"] = torch.zeros(100_000)  # does not fit: the due snapshot of step 2 is skipped
            n_before = state.extra["n"]
            rec.step(b)
            if rec._snapshot is not None and rec._snapshot.step == i:
                assert rec._snapshot.tree["state"]["extra"]["n"] == n_before, (i, rec._snapshot.tree["state"])
    assert rec._snapshot is not None and rec._snapshot.step == 3


def _build_linear(d):
    torch.manual_seed(0)
    m = torch.nn.Linear(d, d)
    return reprokit.TrainState(model=m, optimizer=torch.optim.Adam(m.parameters(), lr=1e-3))


def _build_linear_default(config=None):
    return _build_linear(256)


def _linear_step(state, batch):
    loss = state.model(batch["x"]).square().mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


def _counting_step(state, batch):
    state.extra["n"] += 1
    return _linear_step(state, batch)


def test_warnings_turned_into_errors_never_reach_the_training_loop(tmp_path, capsys):
    """Under -W error a RecorderWarning would raise; the recorder prints it instead and training goes on."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where out_dir should be")
    state = _build_linear(4)
    rec = reprokit.Recorder(state, _linear_step, build=_build_linear_default, out_dir=blocker)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec.step({"x": torch.ones(2, 4)})
        with pytest.raises(reprokit.TrainingFailure) as info:
            rec.step({"x": torch.full((2, 4), float("nan"))})
    assert info.value.bundle is None
    assert "could not write a bundle" in capsys.readouterr().err
