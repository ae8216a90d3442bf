"""A Recorder's part in its process group's incidents: one rank fails, every rank writes its window.

Under torch.distributed every rank's Recorder shares an :class:`~reprokit.distributed.IncidentBoard` (files under
``out_dir``, never a collective). :class:`RankIncidents` is what one rank does with it:

* **This rank failed** (:meth:`RankIncidents.dump`, the main thread): declare the incident or join the one a peer
  declared, write this rank's window into the incident folder, wait (bounded by ``incident_wait_s``) for every
  rank's, and under ``on_incident="abort"`` abort the process group where the peers abort theirs.
* **A peer failed** (:meth:`RankIncidents.on_incident`, the board's watcher thread): write this rank's window as it is
  (a peer's failure), then under ``on_incident="abort"`` end this rank's part of the run: abort the process group so
  a blocked collective returns, and its next step raises :class:`~reprokit.errors.PeerFailure`
  (:meth:`RankIncidents.peer_failure`); under gloo, end the process if it stays blocked (see
  :mod:`reprokit.distributed.abort`).
* **A peer died outright** (durable recording, :meth:`RankIncidents.watch_peers`): declare the incident for it
  (see :mod:`reprokit.distributed.peers`); ``reprokit recover`` writes its window from its flight log.

The Recorder owns the window and writes bundles (``Recorder._dump``); this class decides when and where, and holds
what a rank remembers of its incidents.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprokit.bundle import verify
from reprokit.distributed import IncidentBoard, RankInfo
from reprokit.distributed import abort as fail_fast
from reprokit.distributed.peers import BEAT_EVERY_S, Death, PeerWatch
from reprokit.errors import PeerFailure
from reprokit.signature import Failure, FailureKind

if TYPE_CHECKING:
    from reprokit.record import Recorder

INCIDENT_GRACE_S = 1.0
"""How long a rank's watcher lets its main thread write a failure of its own (a NaN all-reduced into every rank's
gradients fails them all at once) before writing this rank's window as a peer's."""
PEER_EXIT_S = 1.0
"""How long a rank whose collective raised looks for a peer on this host that died (its process still torn down)."""


class RankIncidents:
    """One rank's part in the incidents of its process group (see the module docstring).

    Example:
        >>> incidents = RankIncidents(recorder, board)     # made by a Recorder under a process group  # doctest: +SKIP
        >>> incidents.dump(failure)                         # this rank failed: its bundle in the incident  # doctest: +SKIP
    """

    def __init__(self, rec: Recorder, board: IncidentBoard, info: RankInfo):
        self.rec = rec
        self.board = board
        self.info = info
        self.peers: PeerWatch | None = None
        """With ``durable=True`` and more than one rank: this rank's check of its peers' flight folders."""
        self.waiting: tuple[int, float] = (-1, 0.0)
        """(step, monotonic time) at which the watcher first saw this rank inside that step."""
        self.beat_at = 0.0
        self.peer_doc: dict[str, Any] | None = None
        """The incident whose window this rank's watcher wrote as a peer's (this rank had not failed itself)."""
        self.peer_step: int | None = None
        """The step this rank was at when its watcher wrote that window."""
        self.failed_at: int | None = None
        """The last step at which this rank failed itself."""
        self.aborted: dict[str, Any] | None = None
        """The incident after which this rank's part of the run was ended (``on_incident="abort"``)."""
        self.stepped_since = True
        """This rank finished a step since the last incident it handled: a failure now is a new incident."""
        self.bundle: Path | None = None
        """This rank's bundle of the last incident it handled."""

    def dump(self, failure: Failure, lag: int = 0) -> Path | None:
        """This rank failed: declare the incident (or join the one a peer declared), write this rank's window into
        the incident folder unless the watcher already did, then wait (bounded) for every rank to write its own.

        A failure in the step this rank was in when an incident came (a peer that failed and left this rank's
        collective hanging, or the NaN a peer all-reduced into this rank's gradients) belongs to that incident; once
        this rank has finished a step since, a failure is a new incident (a loop that skipped the failing step)."""
        board = self.board
        assert board is not None and self.info is not None
        with self.rec._lock:
            if board.current is not None and not self.stepped_since:
                doc, path = board.current, self.bundle
            else:
                try:
                    doc = board.declare(failure.step, self.info.rank, failure.describe())
                except OSError as e:  # never let our bookkeeping replace the training's own error
                    self.rec._warn("", f"reprokit: {failure.describe()}, but the incident could not be declared under "
                                   f"{board.path.parent} ({e!r}); no bundle")
                    return None
                board.handle(doc)
                self.stepped_since = False
                failure.detail = {**failure.detail, "incident": doc}
                path = self.bundle = self.rec._dump(failure, incident=doc["incident"], lag=lag)
                board.done(self.info.rank)
        self.peer_doc = None  # this rank failed itself: its own error is raised
        board.mark_outcome(self.info.rank, "failed")
        missing = board.wait_for_all(self.rec.incident_wait_s)
        if missing:
            self.rec._warn("", f"reprokit: incident {doc['incident']}: ranks {missing} did not write their window within "
                           f"{self.rec.incident_wait_s:.0f} s")
        if self.rec.on_incident == "abort":
            self._abort_with_peers(doc, lag)
        return path

    def on_incident(self, doc: dict[str, Any]) -> None:
        """Watcher thread: a peer failed; write this rank's window as it is now (a peer's failure, not this rank's)."""
        board = self.board
        assert board is not None and self.info is not None
        # A rank whose own detector fires at the same step (a NaN all-reduced into its gradients) is about to write
        # its own failure: give its main thread a moment before writing this rank's window as a peer's. (A peer that
        # died outright is the whole incident: no wait.)
        if "died" not in doc:
            time.sleep(INCIDENT_GRACE_S)
        with self.rec._lock:
            if board.seen == doc["incident"] or int(doc["number"]) < board.handled:
                return
            board.handle(doc)
            self.stepped_since = False
            step = max(self.rec.step_index, self.rec._ring[-1].step if self.rec._ring else self.rec.step_index)
            failure = Failure(kind=FailureKind.PEER, step=int(doc.get("step", step)),
                              message=f"rank {doc.get('rank')} failed: {doc.get('what')}",
                              detail={"incident": doc, "this_rank_step": step})
            self.bundle = self._peer_window(failure, doc)
            board.done(self.info.rank)
            self.peer_doc, self.peer_step = doc, self.rec.step_index
        if self.rec.on_incident == "abort":
            self._end_after_incident(doc, self.peer_step)

    def watch_peers(self) -> None:
        """Watcher thread, before each look for incidents (durable, under a process group): rewrite this rank's
        heartbeat (every ``BEAT_EVERY_S``), and declare the incident of a peer found dead (its pid gone and its lock
        released on this host; elsewhere its heartbeat older than ``peer_timeout_s`` while this rank waits); the
        look that follows handles it as any incident."""
        flight, board, watch = self.rec._flight, self.board, self.peers
        if flight is None or board is None or watch is None:
            return
        now = time.monotonic()
        k, in_step = self.rec.step_index, self.rec._in_step
        if now - self.beat_at >= BEAT_EVERY_S:
            self.beat_at = now
            flight.beat(k if in_step else k - 1)
        if self.waiting[0] != k or not in_step:
            self.waiting = (k if in_step else -1, now)
        if self.aborted is not None or board.pending() is not None:
            return
        waited = now - self.waiting[1] if in_step else 0.0
        for death in self._new_deaths(watch.dead(waiting_s=waited)):
            self._declare_death(death)

    def _new_deaths(self, deaths: list[Death]) -> list[Death]:
        """``deaths`` without the ranks whose window of the incident this rank is still in is written: a rank that
        failed itself and then ended (its launcher's SIGTERM, the gloo abort's ``os._exit``) is no new incident."""
        board = self.board
        if board is None or board.current is None or self.stepped_since:
            return deaths
        return [d for d in deaths if not board.done_path(d.rank).exists()]

    def _declare_death(self, death: Death) -> dict[str, Any] | None:
        """Rank ``death.rank`` died without writing an incident: declare one for it (or join the one a peer declared
        first), mark it dead (no rank waits for its window) and say so in the incident folder; ``reprokit recover``
        writes its window there from its flight log."""
        board = self.board
        assert board is not None
        step = death.last_started if death.last_started is not None else self.rec.step_index
        try:
            doc = board.declare(step, death.rank, death.what(), died=death.to_json())
        except OSError as e:
            self.rec._warn("", f"reprokit: {death.what()}, but the incident could not be declared under "
                           f"{board.path.parent} ({e!r})")
            return None
        board.mark_dead(death.rank, death.to_json())
        died: dict[str, Any] = doc["died"] if isinstance(doc.get("died"), dict) else death.to_json()
        try:
            folder = self.rec.out_dir / str(doc["incident"])
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"died-rank{death.rank}.json"
            tmp = folder / f".{path.name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({**died, "incident": doc["incident"], "what": death.what(),
                                       "recover": f"reprokit recover {self.rec.out_dir}"}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # the incident file and every rank's bundle say it too
        print(f"reprokit: rank {death.detected_by}: {death.what()}; incident {self.rec.out_dir / str(doc['incident'])}; "
              f"its window: `reprokit recover {shlex.quote(str(self.rec.out_dir))}` once the job has ended",
              file=sys.stderr, flush=True)
        return doc

    def await_dead_peer(self, exc: BaseException) -> None:
        """Main thread, the step raised ``exc`` (durable, under a process group). A collective broken by a peer's
        death (gloo raises as soon as the peer's sockets close) reaches this rank within moments of it: when a peer on
        this host is dead (for a ``RuntimeError``, the type collectives raise, looked for up to ``PEER_EXIT_S`` while
        the peer's process is still torn down) or a death incident is pending, wait (bounded) until the watcher has
        written this rank's window for it, so that the step raises :class:`PeerFailure` (``on_incident="abort"``),
        or this rank's error joins that incident (``"wait"``)."""
        board, watch = self.board, self.peers
        if board is None or watch is None or self.peer_doc is not None:
            return
        deadline = time.monotonic() + (PEER_EXIT_S if isinstance(exc, RuntimeError) else 0.0)
        doc = None
        while doc is None:
            current, pending = board.current, board.pending()
            if current is not None and "died" in current and not self.stepped_since:
                doc = current  # the watcher is handling it (or has) since this step began
                break
            if pending is not None:
                if "died" not in pending:
                    return  # a peer's raised failure: the usual path decides
                doc = pending
                break
            for death in self._new_deaths(watch.dead(remote=False)):
                doc = self._declare_death(death) or doc
            if doc is None:
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.05)
        deadline = time.monotonic() + 2 * board.poll_s + 5.0
        while board.seen != doc["incident"] and time.monotonic() < deadline:
            time.sleep(0.02)
        with self.rec._lock:  # the watcher writes this rank's window holding it
            pass

    def _peer_window(self, failure: Failure, doc: dict[str, Any]) -> Path | None:
        """Watcher thread: this rank's window of a peer's incident. Of a peer that died outright, the window must
        start where the dead rank's flight log has one (``reprokit recover`` writes the dead rank's from there, and
        an incident replays only when every rank's window starts at one step): a rank killed just after a snapshot
        had not yet committed it, so its newest window starts one snapshot earlier. Then this rank's window is
        written from its own flight log, which keeps that earlier window too (see :mod:`reprokit.flight`)."""
        died, flight, snap = doc.get("died"), self.rec._flight, self.rec._snapshot
        incident = str(doc["incident"])
        if not isinstance(died, dict) or flight is None or snap is None:
            return self.rec._dump(failure, incident=incident, from_watcher=True)
        from reprokit.recover import read_rank, window_chain, write_window

        try:
            theirs = window_chain(read_rank(flight.run_folder / f"rank{died.get('rank')}"))
            if isinstance(theirs, str) or theirs[0] >= snap.step:
                return self.rec._dump(failure, incident=incident, from_watcher=True)
            mine = read_rank(flight.folder)
            chain = window_chain(mine, theirs[0])
            if isinstance(chain, str):
                self.rec._warn("", f"reprokit: rank {died.get('rank')}'s flight log holds a window from step {theirs[0]} "
                               f"only, and this rank's own log has none from there ({chain}); this rank's window "
                               f"starts at step {snap.step}, so `reprokit recover` cannot line rank "
                               f"{died.get('rank')}'s window up with it")
                return self.rec._dump(failure, incident=incident, from_watcher=True)
            path = write_window(mine, self.rec.out_dir / incident, chain, failure, incident=incident)
        except Exception as e:  # never let our bookkeeping stop the run: the window from memory still serves
            self.rec._warn("", f"reprokit: could not write this rank's window from its flight log ({e!r}); writing the "
                           "one in memory")
            return self.rec._dump(failure, incident=incident, from_watcher=True)
        self.rec.bundles.append(path)
        flight.record(b"bndl", {"step": failure.step, "path": str(path.absolute()), "incident": incident,
                                "kind": failure.kind})
        return path

    def _end_after_incident(self, doc: dict[str, Any], at: int) -> None:
        """Watcher thread, ``on_incident="abort"``: this rank's window of a peer's incident is written (it was at
        step ``at``). Once every rank's window is, end this rank's part of the run unless its own step failed in the
        same incident: abort the process group, so that a collective it is blocked in returns with an error (and its
        next step raises :class:`PeerFailure` otherwise); under gloo, end the process if it stays blocked."""
        board, info = self.board, self.info
        assert board is not None and info is not None
        missing = board.wait_for_all(self.rec.incident_wait_s)
        deadline = time.monotonic() + fail_fast.ABORT_GRACE_S
        while self.rec._in_step and self.rec.step_index == at and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.failed_at is not None and self.failed_at >= at:
            return  # its own failure in this incident is what its loop sees (and may catch and go on from)
        incident = self.rec.out_dir / str(doc["incident"])
        checked = self._verified(self.bundle)
        self.aborted = {**doc, "missing": missing}
        board.mark_outcome(info.rank, "abort")
        blocked = self.rec._in_step and self.rec.step_index == at
        lines = [f"reprokit: rank {info.rank}: rank {doc.get('rank')} failed at step {doc.get('step')} "
                 f"({doc.get('what')}); incident: {incident}", f"reprokit: rank {info.rank}'s window: {checked}"]
        if missing:
            lines.append(f"reprokit: ranks {missing} wrote no window within {self.rec.incident_wait_s:.0f} s "
                         "(incident_wait_s); the others' are in the incident folder")
        interrupts = fail_fast.abort_interrupts(info.backend)
        if interrupts:
            why = fail_fast.abort_process_group()
            lines.append(f"reprokit: rank {info.rank} aborted its process group (on_incident=\"abort\"; "
                         "on_incident=\"wait\" keeps it waiting)" if why is None else
                         f"reprokit: rank {info.rank} could not abort its process group: {why}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        if not blocked:
            return  # its collective broke by itself, or it is outside a step: its next step raises PeerFailure
        deadline = time.monotonic() + fail_fast.UNBLOCK_S
        while self.rec._in_step and self.rec.step_index == at and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.rec._in_step and self.rec.step_index == at:  # gloo cannot abort a blocked call; the process's end does
            why = "its process group was aborted, yet the call has not returned" if interrupts else \
                "gloo cannot abort a blocked call"
            fail_fast.end_process(
                f"reprokit: rank {info.rank} is still blocked in step {at}'s collective {fail_fast.UNBLOCK_S:.0f} s "
                f"after every window was written; {why}, so it ends its process (exit 1, on_incident=\"abort\"; "
                f"on_incident=\"wait\" keeps it waiting). Every rank's window: "
                f"`reprokit replay {shlex.quote(str(incident))}`")

    def _abort_with_peers(self, doc: dict[str, Any], lag: int = 0) -> None:
        """Main thread, this rank failed itself (``on_incident="abort"``): when a peer aborts, abort this rank's
        process group too, before its own error is raised, so that its exit path (``dist.destroy_process_group()``
        under NCCL, a ``dist.barrier()``) does not wait for peers that are gone. Not under gloo, whose abort does not
        interrupt a blocked call (the peers' processes ending does); not when every rank failed itself (a loop that
        catches the failure may go on), unless this rank saw its failure ``lag`` steps late: it has queued the
        collectives of the steps after it, which peers that stopped sooner never join."""
        board, info = self.board, self.info
        assert board is not None and info is not None
        if not fail_fast.abort_interrupts(info.backend):
            return
        others = [r for r in board.recording_ranks() if r != info.rank]
        deadline = time.monotonic() + fail_fast.ABORT_GRACE_S + 2 * INCIDENT_GRACE_S + 1.0
        while True:
            outcomes = [board.outcome(r) for r in others]
            if "abort" in outcomes or time.monotonic() >= deadline:
                break
            if all(o == "failed" for o in outcomes):
                if not lag:
                    return
                break
            time.sleep(0.02)
        self.aborted = {**doc, "missing": []}
        why = fail_fast.abort_process_group()
        print(f"reprokit: rank {info.rank} failed at step {doc.get('step')} and its peers end their part of the run: "
              + ("its process group is aborted too, so that its exit path does not wait for them" if why is None else
                 f"its process group could not be aborted ({why})"), file=sys.stderr, flush=True)

    def _verified(self, path: Path | None) -> str:
        """``path`` and whether its files are all there as its manifest says (sizes and headers: a window is never
        reported complete when it is not)."""
        if path is None:
            return "none could be written (see the warning above)"
        try:
            problems = verify(path, hash_tensors=False)
        except Exception as e:
            return f"{path} (could not verify: {e!r})"
        return f"{path} (verified)" if not problems else f"{path} ({len(problems)} problem(s): {problems[0]})"

    def peer_failure(self, doc: dict[str, Any]) -> PeerFailure:
        """The error a rank that did not fail itself sees: who failed, where, and where every window is."""
        incident = self.rec.out_dir / str(doc["incident"])
        aborted = self.aborted is not None and self.info is not None and \
            fail_fast.abort_interrupts(self.info.backend)
        missing = doc.get("missing") or []
        lost = f" Ranks {missing} wrote no window in time." if missing else ""
        if isinstance(doc.get("died"), dict):
            lost += (f" Rank {doc['died'].get('rank')} could write none (its process died): once the job has ended, "
                     f"`reprokit recover {shlex.quote(str(self.rec.out_dir))}` writes it from its flight log.")
        how = "reprokit aborted the process group" if aborted else "reprokit ended this rank's part of the run"
        return PeerFailure(f"{how}: rank {doc.get('rank')} failed at step {doc.get('step')} ({doc.get('what')}); "
                           f"incident: {incident}.{lost} Replay every rank: `reprokit replay "
                           f"{shlex.quote(str(incident))}`. (on_incident=\"wait\" keeps this rank waiting instead.)",
                           incident=incident, failed_rank=doc.get("rank"), step=doc.get("step"))
