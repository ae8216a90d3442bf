"""The ranks of an incident deciding together through files (``reprokit.distributed.team``): two ranks as two
threads on one real folder."""

from __future__ import annotations

import threading

import pytest

from reprokit.distributed.team import Team, TeamLost


def both(folder, fn0, fn1):
    """Run ``fn0(team of rank 0)`` and ``fn1(team of rank 1)`` at once; their results."""
    out: dict[int, object] = {}

    def rank(r, fn):
        out[r] = fn(Team(folder, r, [0, 1], timeout_s=10))

    threads = [threading.Thread(target=rank, args=(r, fn)) for r, fn in ((0, fn0), (1, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out[0], out[1]


def test_every_rank_reads_every_rank_s_value_and_the_leader_s_posts(tmp_path):
    def rank0(team):
        got = [team.exchange("a", "zero"), team.exchange("b", 0)]
        team.post("lead", {"run": 7})
        team.post("lead", {"end": "done"})
        return got

    def rank1(team):
        got = [team.exchange("a", "one"), team.exchange("b", 1)]
        return got + [team.read("lead", 0), team.read("lead", 0)]

    r0, r1 = both(tmp_path, rank0, rank1)
    assert r0 == [{0: "zero", 1: "one"}, {0: 0, 1: 1}]
    assert r1 == [*r0, {"run": 7}, {"end": "done"}]


def test_the_first_decision_holds_for_every_rank(tmp_path):
    a, b = Team(tmp_path, 0, [0, 1], timeout_s=1), Team(tmp_path, 1, [0, 1], timeout_s=1)
    assert a.decide("go", "stop: rank 0 timed out", None) == "stop: rank 0 timed out"
    assert b.decide("go", "go", {0: {}, 1: {}}) == "stop: rank 0 timed out"


def test_a_rank_that_never_answers_ends_the_wait(tmp_path):
    team = Team(tmp_path, 0, [0, 1], timeout_s=0.2)
    assert team.gather("ready", {"why": None}) is None
    with pytest.raises(TeamLost, match="rank 1 did not answer within 0 s"):
        team.exchange("next", 1)


def test_a_rank_that_says_and_leaves_is_read_without_waiting(tmp_path):
    Team(tmp_path, 0, [0, 1], timeout_s=0).say("ready", {"why": "rank 0 does not skip"})
    waiting = Team(tmp_path, 1, [0, 1], timeout_s=30)
    assert waiting.gather("ready", {"why": None}) == {0: {"why": "rank 0 does not skip"}, 1: {"why": None}}
