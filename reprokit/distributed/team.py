"""The ranks of one incident deciding together, through files beside the incident's own (no collective).

A skip under torch.distributed (:mod:`reprokit.skip`) needs every rank to replay the same steps in the same order:
their replays run the model's collectives. What each rank replays next depends on what the replays before showed,
so after each one the ranks tell each other what they saw. A collective would do, except where it matters most:
a rank stuck in the training's own collective never answers one. Files in ``out_dir/.reprokit-incidents`` (the
folder the incident machinery already shares between ranks) never block: every wait is bounded, and a rank that
does not answer in time ends the attempt for the others.

Two kinds of messages:

* :meth:`Team.exchange`: every rank posts a value under the next sequence number and reads every rank's. Ranks
  that take the same branches post the same sequence of names; a rank that took another reads names nobody writes,
  and its wait ends with :class:`TeamLost`.
* :meth:`Team.post` / :meth:`Team.read`: one rank (the leader of a phase) posts, the others read.

:meth:`Team.decide` settles a yes/no that must be the same on every rank even when waits time out: the first rank
to create the decision file wins (``os.link``, exclusive), and every rank reads what it says.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

POLL_S = 0.002


def write_first(path: Path, text: str, writer: int) -> None:
    """Write ``text`` at ``path`` unless a file is there already: of several processes writing it at once, the first
    wins whole (written aside, then ``os.link``, which fails on an existing name) and the others change nothing.

    Raises:
        OSError: the folder cannot be written.
    """
    tmp = path.with_name(f".{path.name}.{writer}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


class TeamLost(Exception):
    """A rank did not answer within the team's timeout: the attempt ends on this rank."""


class Team:
    """This rank among ``ranks``, exchanging small JSON values through files in ``folder``.

    Example:
        >>> team = Team(folder, rank=1, ranks=[0, 1], timeout_s=60)            # doctest: +SKIP
        >>> team.exchange("reproduced", True)                                   # doctest: +SKIP
        {0: True, 1: True}
    """

    def __init__(self, folder: Path, rank: int, ranks: list[int], timeout_s: float):
        self.folder = Path(folder)
        self.rank = rank
        self.ranks = sorted(ranks)
        self.timeout_s = timeout_s
        self._seq = 0
        self.folder.mkdir(parents=True, exist_ok=True)

    def _name(self, tag: str, rank: int | str) -> Path:
        return self.folder / f"{self._seq:05d}-{tag}.{rank}.json"

    def _write(self, path: Path, value: Any) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"value": value}))
        os.replace(tmp, path)  # readers see the whole file or none

    def _wait(self, path: Path, who: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return json.loads(path.read_text())["value"]
            except (OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                raise TeamLost(f"{who} did not answer within {self.timeout_s:.0f} s ({path.name})")
            time.sleep(POLL_S)

    def exchange(self, tag: str, value: Any) -> dict[int, Any]:
        """Post ``value``; every rank's value, once all have posted theirs (at most ``timeout_s``).

        Raises:
            TeamLost: a rank posted nothing in time.
        """
        self._seq += 1
        self._write(self._name(tag, self.rank), value)
        return {r: self._wait(self._name(tag, r), f"rank {r}") for r in self.ranks}

    def say(self, tag: str, value: Any) -> None:
        """This rank's part of the next :meth:`exchange` under ``tag``, without waiting for the others' (a rank that
        takes no further part: the others read what it said instead of waiting for it)."""
        self._seq += 1
        self._write(self._name(tag, self.rank), value)

    def post(self, tag: str, value: Any) -> None:
        """The leader of a phase posts ``value``; :meth:`read` on the other ranks returns it."""
        self._seq += 1
        self._write(self._name(tag, "lead"), value)

    def read(self, tag: str, leader: int) -> Any:
        """What the leader posted next under ``tag``.

        Raises:
            TeamLost: it posted nothing in time.
        """
        self._seq += 1
        return self._wait(self._name(tag, "lead"), f"rank {leader}")

    def decide(self, tag: str, proposal: Any, ready: dict[int, Any] | None) -> Any:
        """Settle one value for every rank: ``proposal`` when this rank is the first to decide, else what the first
        decided. ``ready`` is what this rank gathered before (None: it timed out waiting), for the record."""
        self._seq += 1
        path = self._name(tag, "decision")
        write_first(path, json.dumps({"value": proposal, "by": self.rank, "gathered": ready}), self.rank)
        return json.loads(path.read_text())["value"]

    def gather(self, tag: str, value: Any) -> dict[int, Any] | None:
        """:meth:`exchange` that returns None instead of raising when a rank did not answer in time."""
        try:
            return self.exchange(tag, value)
        except TeamLost:
            return None
