"""The gradient norm replayed from a CUDA graph (reprokit.norm_graph): the same value as the eager norm, bit for bit,
and never a replay over gradients that are not where the capture saw them. Runs on the GPU machine
(`python -m pytest -m cuda`); CI has no GPU."""

from __future__ import annotations

import pytest
import torch

from reprokit import norm_graph
from reprokit.detect import _norm_of_groups

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")]


def _norm(graph: norm_graph.NormGraph, groups, side: torch.cuda.Stream) -> torch.Tensor:
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = graph(groups)
    torch.cuda.current_stream().wait_stream(side)
    return out


def test_replays_read_the_gradients_as_they_are_now_and_equal_the_eager_norm_bit_for_bit():
    """Gradients kept between steps (zero_grad without set_to_none): one layout, captured once and replayed over values
    that change every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graph, side = norm_graph.NormGraph(_norm_of_groups), torch.cuda.Stream()
    norms = []
    for step in range(20):
        opt.zero_grad(set_to_none=False)
        model(torch.randn(16, 32, device="cuda")).square().mean().backward()
        groups = [[p.grad for p in model.parameters()]]
        got = _norm(graph, groups, side)
        assert torch.equal(got, _norm_of_groups(groups)) and got.dtype == torch.float64, step
        norms.append(got.item())
        opt.step()
    assert graph.captures == 1 and graph.replays == 19 and graph.off is None, graph.stats()
    assert len(set(norms)) == 20  # every replay read that step's gradients


def test_gradients_that_moved_or_changed_shape_are_normed_eagerly():
    side = torch.cuda.Stream()
    base = torch.randn(64, device="cuda")
    graph = norm_graph.NormGraph(_norm_of_groups)
    for _ in range(3):  # seen twice in a row: captured, then replayed
        _norm(graph, [[base[:32]]], side)
    assert graph.captures == 1 and graph.replays == 2
    cases = {
        "same address, more elements": [[base]],
        "same address, other shape": [[base[:32].view(4, 8)]],
        "same address, other strides": [[base.view(2, 32)[:, :16]]],
        "other address": [[base[32:]]],
        "a copy": [[base[:32].clone()]],
    }
    for what, groups in cases.items():
        replays = graph.replays
        got = _norm(graph, groups, side)
        assert graph.replays == replays, what  # not replayed: the capture read other memory
        assert torch.equal(got, _norm_of_groups(groups)), what
    assert torch.equal(_norm(graph, [[base[:32]]], side), _norm_of_groups([[base[:32]]]))
    assert graph.replays == 3


def test_a_run_whose_gradients_never_settle_stops_capturing_and_replays_only_the_layouts_it_keeps():
    side = torch.cuda.Stream()
    graph = norm_graph.NormGraph(_norm_of_groups)
    keep = [torch.randn(100 + i, device="cuda") for i in range(norm_graph.MAX_CAPTURES + 2)]
    for t in keep:  # a new layout each round, seen on two steps in a row: captured, up to MAX_CAPTURES
        for _ in range(2):
            assert torch.equal(_norm(graph, [[t]], side), _norm_of_groups([[t]]))
    assert graph.captures == norm_graph.MAX_CAPTURES and graph.off is None, graph.stats()
    assert len(graph.graphs) == norm_graph.MAX_GRAPHS
    replays = graph.replays
    last_kept, evicted, never = keep[norm_graph.MAX_CAPTURES - 1], keep[0], keep[-1]
    for t, replayed in ((last_kept, True), (evicted, False), (never, False)):
        before = graph.replays
        assert torch.equal(_norm(graph, [[t]], side), _norm_of_groups([[t]]))
        assert graph.replays == before + replayed
    assert graph.replays == replays + 1 and graph.captures == norm_graph.MAX_CAPTURES
    # The graphs evicted from the kept ones are dropped once the stream has passed them (queried at the next call).
    torch.cuda.synchronize()
    _norm(graph, [[never]], side)
    assert not graph._evicted


def test_a_recorder_detached_and_attached_again_keeps_its_graphs_and_closing_it_drops_them(projects, tmp_path):
    """Recorder.detach() (an evaluation loop between training steps) removes the hooks, not the captured graphs."""
    import reprokit

    gpu = projects("rk_gpu")
    cfg = {"device": "cuda"}
    state = gpu.build(cfg)
    rec = reprokit.Recorder(state, gpu.train_step, build=gpu.build, config=cfg, out_dir=tmp_path)
    batches = list(gpu.batches(40, None, "cuda"))
    for b in batches[:20]:
        rec.step(b)
    graphs = dict(rec.monitor._graphs)
    kept = {dev: dict(g.graphs) for dev, g in graphs.items()}
    assert kept and all(kept.values()), rec.stats()["grad_norm_graph"]
    rec.detach()
    assert rec.monitor._graphs == graphs and {dev: dict(g.graphs) for dev, g in graphs.items()} == kept
    rec.attach()
    for b in batches[20:]:
        rec.step(b)
    assert rec.stats()["grad_norm_graph"]["replays"] > 0
    rec.close()
    assert all(not g.graphs for g in graphs.values())
