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
    buffers = list(rec._slots.values()) + list(engine._buffers.values())
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
    slots = {k: v.data_ptr() for k, v in rec._slots.items()}
    buffers = {k: v.data_ptr() for k, v in rec._engine._buffers.items()}
    for b in batches[10:]:
        rec.step(b)
    assert {k: v.data_ptr() for k, v in rec._slots.items()} == slots, "batch buffers reused, none allocated"
    assert {k: v.data_ptr() for k, v in rec._engine._buffers.items()} == buffers, "snapshot buffers reused"


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
    assert list((tmp_path / "out" / ".reprokit-spill").glob("*.safetensors"))
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.fidelity["bit_exact"]
    rec.close()
    assert not list((tmp_path / "out" / ".reprokit-spill").glob("*.safetensors")), "close() removes the spill file"


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
    with pytest.raises(reprokit.CaptureError, match="host_memory_budget"):
        m = torch.nn.Linear(2, 2)
        reprokit.Recorder(reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1)),
                          _step, build=_build, host_memory_budget=0)


def _build(config):
    m = torch.nn.Linear(2, 2)
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))


def _step(state, batch):
    return state.model(batch).sum()
