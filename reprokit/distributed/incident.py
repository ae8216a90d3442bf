"""Replay an incident on N ranks: one process per rank under ``torch.distributed.run``, each loading its own bundle.

``reprokit replay INCIDENT_DIR`` (an incident folder written by a multi-rank run) starts ``world_size`` ranks with
``python -m torch.distributed.run`` (gloo on the CPU, NCCL on GPUs), initialises the process group before ``build``
runs (so ``build`` wraps the model in DDP as it did in training), and gathers each rank's replay report from a JSON
file it writes. A rank whose peer failed before a collective would wait in that collective forever: each rank
watches the others' reports and, once a peer has finished with a failure and this rank is still running after a
grace period, writes "blocked" as its own outcome and exits.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprokit.bundle import MANIFEST, Bundle, open_bundle, schema
from reprokit.errors import BundleError, ConfigError, ReprokitError
from reprokit.signature import FailureKind

BLOCKED_GRACE_S = 5.0


def rank_bundles(folder: Path) -> dict[int, Bundle]:
    """``{rank: opened bundle}`` of an incident folder (each verified once), checked to be one whole run: every
    rank once, the same world size and incident, and windows that start at the same step (else the ranks'
    collectives cannot line up).

    Raises:
        BundleError: naming what does not fit.
    """
    _refuse_mixed(folder)
    found: dict[int, Bundle] = {}
    worlds: set[Any] = set()
    incidents: set[Any] = set()
    starts: set[Any] = set()
    for p in sorted(folder.iterdir()):
        if not (p / MANIFEST).exists():
            continue
        b = open_bundle(p)
        d = b.run.get("distributed")
        if not isinstance(d, dict) or not isinstance(d.get("rank"), int):
            newest = max(q for q in folder.iterdir() if (q / MANIFEST).exists())  # names sort by time
            raise BundleError(f"{folder} is not a bundle, nor the incident folder of a multi-rank run: {p.name} in it "
                              "is a bundle of one process (its run.json has no `distributed` section); the folder "
                              f"looks like the recorder's out_dir. Pass one bundle folder in it, e.g. {newest}")
        if d["rank"] in found:
            raise BundleError(f"{folder}: two bundles of rank {d['rank']} ({found[d['rank']].path.name}, {p.name})")
        found[d["rank"]] = b
        worlds.add(d.get("world_size"))
        incidents.add(d.get("incident"))
        starts.add(b.run["window"]["start"])
    if not found:
        raise BundleError(f"{folder}: no bundles in this folder")
    if len(worlds) != 1 or len(incidents) != 1:
        _refuse_mixed(folder, {b.path.name: b.run["distributed"] for b in found.values()})
    world = worlds.pop()
    if not isinstance(world, int) or sorted(found) != list(range(world)):
        missing = sorted(set(range(world if isinstance(world, int) else 0)) - set(found))
        some = next((b.path for b in found.values() if b.failure.kind != FailureKind.PEER), found[min(found)].path)
        raise BundleError(f"{folder}: ranks {missing} of {world} have no bundle; an N-rank replay needs every rank. "
                          f"Replay one rank's bundle alone instead, e.g. `reprokit replay {some}`")
    if len(starts) != 1:
        raise BundleError(f"{folder}: the ranks' windows start at different steps {sorted(starts)}; their "
                          "collectives cannot line up in a replay")
    return found


def _refuse_mixed(folder: Path, dists: dict[str, Any] | None = None) -> None:
    """Refuse a folder whose bundles name different incidents or world sizes, naming each. Read first from the
    run.json files as they are (only to refuse, never to go on: every bundle is verified after), so that a bundle
    copied in from another incident is named as such rather than as one whose referenced state is missing."""
    if dists is None:
        dists = {}
        for p in sorted(folder.iterdir()):
            # Unverified: read as strictly as any bundle JSON (size and depth bounded, a FIFO or a device refused
            # unread, not following a link); one that cannot be read is left to the verification after.
            try:
                if not (p / "run.json").exists():
                    continue
                doc = schema.load_json(p / "run.json", f"{p.name}/run.json", follow_links=False)
            except (BundleError, OSError):  # unreadable (a folder we may not enter): verification says why
                continue
            d = doc.get("distributed") if isinstance(doc, dict) else None
            if isinstance(d, dict):
                dists[p.name] = d
    if len({(str(d.get("incident")), str(d.get("world_size"))) for d in dists.values()}) <= 1:
        return
    each = "; ".join(f"{name}: rank {d.get('rank')} of {d.get('world_size')}, incident {d.get('incident')}"
                     for name, d in sorted(dists.items()))
    raise BundleError(f"{folder} mixes bundles of different runs or incidents ({each}); the ranks of one incident "
                      "replay together. Keep one incident's bundles in the folder (each rank's bundle replays alone "
                      "too).")


@dataclass
class IncidentReport:
    """What an N-rank replay saw on each rank."""

    folder: Path
    incident: dict[str, Any]
    ranks: list[dict[str, Any]]
    """Per rank: its replay report (``ReplayReport.to_json()``), or ``{"rank", "blocked": True, ...}``."""
    origin: int | None = None
    """The rank whose failure the incident is about (:func:`origin_rank`); None: the rank that declared it."""
    what: dict[int, str] = field(default_factory=dict)
    """Per rank, how it failed in training (its bundle's failure, described)."""

    @property
    def failing_rank(self) -> int:
        return int(self.incident.get("rank", 0)) if self.origin is None else self.origin

    @property
    def failing_what(self) -> str | None:
        """How that rank failed in training (its bundle's failure), else the incident's own words."""
        return self.what.get(self.failing_rank, self.incident.get("what"))

    @property
    def verdict(self) -> str:
        """The verdict of the rank that failed in training: did the incident happen again? (``error``, exit 125, when
        that rank could not say: its replay raised, or its process died.)"""
        r = next((x for x in self.ranks if x.get("rank") == self.failing_rank), None)
        return str(r.get("verdict", "error")) if r else "error"  # a rank without a report never says "fixed"

    @property
    def exit_code(self) -> int:
        from reprokit.replayer import VERDICT_EXIT_CODES

        return VERDICT_EXIT_CODES.get(self.verdict, 125)

    def to_json(self) -> dict[str, Any]:
        return {"incident": self.incident, "folder": str(self.folder), "world_size": len(self.ranks),
                "failing_rank": self.failing_rank, "failing_what": self.failing_what,
                "declared_by": declared_by(self.incident), "verdict": self.verdict,
                "exit_code": self.exit_code,
                "reproduced": self.verdict in ("deterministic", "flaky"),
                "determinism_checked": bool(self.ranks) and all((r.get("runs") or 0) > 1 for r in self.ranks),
                "ranks": self.ranks}


def replay_incident(folder: str | Path, *, times: int = 1, device: str | None = None, nproc: int | None = None,
                    code: str | Path | None = None, timeout_s: float = 600,
                    entries: Sequence[str] | None = None) -> IncidentReport:
    """Replay every rank of an incident together, as many processes as the run had.

    ``code``: a checkout every rank imports build/step from instead of its bundle's code snapshot (as
    ``reprokit replay --code``). ``entries``: the ``--entry`` values the caller confirmed; with ``code``, each rank
    checks them again on the bundle it opens and replays (the folder may have changed since the caller checked).
    None: the refs are the caller's choice, as for :func:`reprokit.replay`.

    Example:
        >>> report = replay_incident("repros/incident-20261126-142501-step00000006-3f9c2a1b")  # doctest: +SKIP
        >>> report.verdict, [r.get("verdict") for r in report.ranks]                    # doctest: +SKIP
        ('deterministic', ['deterministic', 'deterministic'])
    """
    folder = Path(folder)
    bundles = rank_bundles(folder)
    world = len(bundles)
    if nproc is not None and nproc != world:
        raise ConfigError.option("nproc", f"{{opt}} {nproc}: this incident was recorded on {world} ranks, and each "
                                          f"rank replays its own bundle; pass {{opt}} {world} or leave {{opt}} out")
    first = bundles[0]
    incident = incident_doc(bundles)
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device is None:  # where it was recorded, when this machine has a GPU per rank (as a bundle replays alone)
        device = "cuda" if str(first.run.get("device", "cpu")).startswith("cuda") and gpus >= world else "cpu"
    if device == "cuda":  # refused here, once: in the ranks it would only be an error each (or a wrong device)
        if gpus < world:
            raise ConfigError.option("device", f"{{opt}} cuda: this incident replays one rank per GPU, {world} ranks, "
                                               f"but torch sees {gpus} CUDA device(s) here; use {{opt}} cpu (gloo), or a "
                                               f"machine with {world} GPUs")
    if code is not None:  # refuse a checkout without the project here, once, not in every rank
        from reprokit.code import check_refs

        for b in bundles.values():
            check_refs(b.run.get("refs"), snapshot=b.code_dir, code=Path(code), source=b.path / "run.json")
    # One launch per run: a rank whose failure skips a collective (it raised before backward) leaves its peers
    # inside that collective, so a second run in the same processes would pair its collectives with the peers' first
    # run (gradients averaged across runs). Fresh processes start every run aligned.
    launches = [_launch(folder, bundles, device, code, timeout_s, entries) for _ in range(times)]
    ranks = [_merge([launch[r] for launch in launches]) for r in range(world)]
    return IncidentReport(folder, incident, ranks, origin_rank(bundles, incident),
                          {r: b.failure.describe() for r, b in bundles.items()})


def incident_doc(bundles: dict[int, Bundle]) -> dict[str, Any]:
    """The incident as declared (step, declaring rank, what failed), from the bundle of a rank that failed itself
    where there is one (a peer's copy says the same, seen from the other side)."""
    incident = (bundles[min(bundles)].failure.detail or {}).get("incident") or {}
    for b in bundles.values():
        f = b.failure
        if f.kind != FailureKind.PEER and isinstance(f.detail, dict) and f.detail.get("incident"):
            incident = f.detail["incident"]
    return dict(incident)


def describe_incident(folder: str | Path) -> dict[str, Any]:
    """What ``reprokit inspect INCIDENT_DIR`` shows: the incident, the rank whose failure it is about (see
    :func:`origin_rank`) and, per rank, its failure and its bundle (each verified, as :func:`rank_bundles` does).

    Example:
        >>> d = describe_incident("repros/incident-20261126-142501-step00000006-3f9c2a1b")   # doctest: +SKIP
        >>> d["failing_rank"], [(r["rank"], r["failure"]["kind"]) for r in d["ranks"]]      # doctest: +SKIP
        (1, [(0, 'peer'), (1, 'nonfinite_loss')])
    """
    folder = Path(folder)
    bundles = rank_bundles(folder)
    incident = incident_doc(bundles)
    ranks = []
    for r, b in sorted(bundles.items()):
        f = b.failure
        ranks.append({"rank": r, "bundle": str(b.path), "failure": {"kind": f.kind, "step": f.step},
                      "what": f.describe(), "window": {"start": b.run["window"]["start"],
                                                       "end": b.run["window"]["end"]}})
    return {"folder": str(folder), "incident": incident, "world_size": len(bundles),
            "failing_rank": origin_rank(bundles, incident), "declared_by": declared_by(incident),
            "died": incident.get("died"), "step": incident.get("step"), "ranks": ranks}


def declared_by(incident: dict[str, Any]) -> Any:
    """The rank that declared the incident: the failing rank itself, or for a rank killed outright (``died``, see
    :mod:`reprokit.distributed.peers`) the live rank that found it dead."""
    died = incident.get("died")
    return died.get("detected_by") if isinstance(died, dict) else incident.get("rank")


_FIRST_IN_A_STEP = (FailureKind.CRASH, FailureKind.EXCEPTION, FailureKind.NONFINITE_LOSS, FailureKind.LOSS_SPIKE,
                    FailureKind.PREDICATE, FailureKind.NONFINITE_GRAD, FailureKind.NONFINITE_PARAM)
"""Failure kinds in the order a step meets them: a rank's own loss goes bad before the all-reduced gradients do, and
a rank whose process died comes first (its peers' errors, a connection closed in a collective, follow from it)."""


def origin_rank(bundles: dict[int, Bundle], incident: dict[str, Any]) -> int | None:
    """The rank whose failure the incident is about. Several ranks often fail in the same step (rank 1's NaN loss
    reaches rank 0 as a NaN gradient through the all-reduce), and which of them declared the incident is a race: the
    one whose failure comes first in a step (its own exception or loss before gradients and parameters) is the
    origin; among equals, the declaring rank, then the lowest. None when no rank failed at the incident's step."""
    step = incident.get("step")
    order: dict[str, int] = {kind: i for i, kind in enumerate(_FIRST_IN_A_STEP)}
    found = [(order.get(b.failure.kind, len(order)), r != incident.get("rank"), r) for r, b in bundles.items()
             if b.failure.kind != FailureKind.PEER and b.failure.step == step]
    return min(found)[2] if found else None


def _launch(folder: Path, bundles: dict[int, Bundle], device: str, code: str | Path | None,
            timeout_s: float, entries: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One run of every rank under ``torch.distributed.run``: each rank's report (or why it has none)."""
    import tempfile

    world = len(bundles)
    with tempfile.TemporaryDirectory(prefix="reprokit-incident-") as out:
        # Each rank is told where its bundle is: verified here once, not again by every rank.
        _write(Path(out) / "ranks.json", {str(r): str(b.path) for r, b in bundles.items()})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), "--log-dir", str(Path(out) / "logs"), "--redirects",
               "3", "-m", "reprokit.distributed.incident", str(folder), out, "1", device,
               str(Path(code).resolve()) if code is not None else "",
               json.dumps(list(entries)) if code is not None and entries is not None else ""]
        try:
            from reprokit.code import child_env

            # Each rank's private code copy goes under out: a rank blocked in a collective leaves with os._exit
            # (no cleanup), and a timeout kills them all; removing out removes the copies too.
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env(out))
        except subprocess.TimeoutExpired:
            raise ReprokitError(f"the {world}-rank replay of {folder} did not finish within {timeout_s:.0f} s") from None
        ranks = []
        for r in range(world):
            path = Path(out) / f"rank{r}.json"
            if path.exists():
                ranks.append(json.loads(path.read_text()))
            else:  # its process died (a crash, a kill, an error outside the replay): nothing says it reproduced
                ranks.append({"rank": r, "verdict": "error", "error": (
                    f"rank {r}'s process ended without a report (torchrun exit {proc.returncode}); the last lines of "
                    f"its output: {_output_tail(Path(out) / 'logs', r) or '(none)'}")})
        return ranks


def _merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One rank's reports of several launches (one run each) as one report, its verdict counted as
    :class:`reprokit.replayer.ReplayReport` counts it. A launch where the rank errored makes the whole an error (it
    could not say); one where it stayed blocked in a collective counts as a run that failed otherwise."""
    from reprokit.replayer import VERDICT_EXIT_CODES, verdict_of

    if len(docs) == 1:
        return docs[0]
    if err := next((d for d in docs if d.get("verdict") == "error"), None):
        return {**err, "note": f"in one of {len(docs)} runs"}
    ran = [d for d in docs if not d.get("blocked")]
    if not ran:
        return {**docs[0], "note": f"{docs[0].get('note', '')} (in each of {len(docs)} runs)"}
    out = dict(ran[0])
    blocked = len(docs) - len(ran)
    out["per_run"] = [x for d in ran for x in d["per_run"]]
    out["runs"] = len(docs)
    out["determinism_checked"] = True  # each launch ran once (False in each doc); together they ran len(docs) times
    out["failed_runs"] = sum(d["failed_runs"] for d in ran)
    out["different_runs"] = sum(d["different_runs"] for d in ran) + blocked
    out["verdict"] = verdict_of(out["failed_runs"], out["different_runs"], len(docs))
    out["exit_code"] = VERDICT_EXIT_CODES[out["verdict"]]
    out["reproduced"] = out["failed_runs"] > 0
    out["transient"] = out["verdict"] == "not_reproduced" and all(d.get("transient") for d in ran)
    out["failure"] = next((d["failure"] for d in ran if d.get("reproduced")), None) or next(
        (d["failure"] for d in ran if d.get("failure")), None)
    losses = [[(x["step"], _bits(x["loss"])) for x in r["losses"]] for r in out["per_run"]]
    out["fidelity"] = {**out.get("fidelity", {}), "runs_bit_identical": all(x == losses[0] for x in losses[1:])}
    if blocked:
        out["note"] = f"blocked in a collective in {blocked} of {len(docs)} runs"
    return out


def _bits(x: Any) -> Any:
    """A loss as it compares bit for bit (NaN equal to NaN)."""
    return "nan" if isinstance(x, float) and x != x else x


def _output_tail(logs: Path, rank: int, lines: int = 3) -> str:
    """The last lines rank ``rank`` wrote to stderr (torch.distributed.run's ``--log-dir``), joined with `` | ``."""
    kept = [x.strip() for x in _stderr_lines(logs, rank)]
    return " | ".join([x for x in kept if x and set(x) != {"^"}][-lines:])


def _stderr_lines(logs: Path, rank: int) -> list[str]:
    """What rank ``rank`` wrote to stderr (torch.distributed.run's ``--log-dir``), each line without its
    ``[rankN]:`` prefix."""
    found = sorted(logs.glob(f"*/attempt_*/{rank}/stderr.log"))
    if not found:
        return []
    try:
        text = found[-1].read_text(errors="replace")
    except OSError:
        return []
    return [x.removeprefix(f"[rank{rank}]:") for x in text.splitlines()]


def free_port() -> int:
    """A TCP port free on this host now, for a local process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(folder: str, out: str, times: str, device: str, code: str = "", entries: str = "") -> None:
    """One rank, under torch.distributed.run. Its replay runs in a process forked from this one (which imported torch
    and nothing else: no thread, no device, so the fork is safe), as :mod:`reprokit.isolation` runs one replay: a
    step that kills its process (a SIGKILL, a segfault, an abort: what a ``crash`` bundle recorded) ends that child,
    and this process, which torchrun watches, writes the rank's report of the death (the signal, the step it started
    last) and exits normally, so torchrun stops no other rank for it."""
    import torch  # noqa: F401 - before the fork: the replay's process has it

    rank = int(os.environ["RANK"])
    mine = Path(out) / f"rank{rank}.json"
    steps = Path(out) / f"rank{rank}.steps"
    t0 = time.perf_counter()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _rank_replay(folder, out, times, device, code, entries, steps, parent)
        except BaseException:  # _rank_replay leaves with os._exit(0); here only if reprokit itself failed
            import traceback

            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(70)
    _, status, usage = os.wait4(pid, 0)
    if not mine.exists():
        _write(mine, _death_doc(rank, out, device, code, steps, os.waitstatus_to_exitcode(status), pid,
                                time.perf_counter() - t0, usage.ru_maxrss * 1024))
    os._exit(0)


def _death_doc(rank: int, out: str, device: str, code: str, steps: Path, returncode: int, pid: int, seconds: float,
               peak: int) -> dict[str, Any]:
    """The report of a rank whose replay's process died (see :func:`_rank_main`): a ``crash`` at the step it started
    last, judged against the rank's recorded failure as an isolated replay judges one."""
    from reprokit.isolation import LOG_TAIL_LINES, death_failure, died, isolation_summary
    from reprokit.replayer import code_label, loss_fidelity, report_of

    started: list[int] = []
    finished: dict[int, float | None] = {}
    try:
        for line in steps.read_text().splitlines():
            what, step, loss = json.loads(line)
            if what == "started":
                started.append(int(step))
            elif what == "finished":
                finished[int(step)] = loss
    except (OSError, ValueError):
        pass  # a line torn by the death: the lines before it stand
    if not started:  # it ended before the window's first step (the process group, loading): no death to judge
        return {"rank": rank, "verdict": "error", "error": (
            f"rank {rank}'s replay ended without a report and before its first step (exit status {returncode}); the "
            f"last lines of its output: {_output_tail(Path(out) / 'logs', rank) or '(none)'}")}
    try:
        bundle = open_bundle(json.loads((Path(out) / "ranks.json").read_text())[str(rank)])
    except (OSError, ValueError, KeyError, ReprokitError) as e:
        return {"rank": rank, "verdict": "error", "error": f"rank {rank}'s replay died ({returncode}) and its "
                f"bundle could not be read again: {e}"}
    tail = "\n".join(_stderr_lines(Path(out) / "logs", rank)[-LOG_TAIL_LINES:])
    failure = death_failure(returncode, None, started, finished, tail, pid)
    attempt = died(failure, bundle.failure, finished, seconds, peak)
    outcome = attempt.outcome
    outcome.fidelity = loss_fidelity(bundle, outcome.losses, same_device=device == "cpu" and str(
        bundle.run.get("device", "cpu")) == "cpu", same_code=not code)
    report = report_of(bundle, [outcome], device, code_label(bundle, Path(code) if code else None))
    report.isolation = isolation_summary(report, [attempt], {"child_starts": 0, "attempts": 1, "child_deaths": 1,
                                                      "startup_seconds": 0.0, "waited_seconds": 0.0}, bundle.env)
    return {"rank": rank, **report.to_json()}


def _rank_replay(folder: str, out: str, times: str, device: str, code: str, entries: str, steps: Path,
                 parent: int) -> None:
    """The replay of one rank (in the process :func:`_rank_main` forked): init the process group, replay this rank's
    bundle, telling ``steps`` as each step starts and finishes, write its report."""
    import datetime
    import faulthandler
    import threading

    import torch
    import torch.distributed as dist

    from reprokit.replayer import replay

    faulthandler.enable(all_threads=True)  # a segfault's traceback goes to this rank's stderr log: its death says where
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=300))
    mine = Path(out) / f"rank{rank}.json"
    fd = os.open(steps, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def on_step(what: str, step: int, loss: float | None) -> None:
        os.write(fd, (json.dumps([what, step, loss]) + "\n").encode())  # one write: the page cache outlives a kill

    def watch_peers() -> None:
        """A peer finished with a failure and this rank still runs: it waits in a collective that never completes.
        The rank's process (this one's parent) ended: so does this one."""
        while not mine.exists():
            time.sleep(0.2)
            if os.getppid() != parent:
                os._exit(1)
            for r in range(world):
                p = Path(out) / f"rank{r}.json"
                if r == rank or not p.exists():
                    continue
                try:
                    peer = json.loads(p.read_text())
                except ValueError:
                    continue
                if peer.get("failure") is not None:
                    time.sleep(BLOCKED_GRACE_S)
                    if not mine.exists():
                        _write(mine, {"rank": rank, "blocked": True, "verdict": "blocked",
                                      "note": f"still running {BLOCKED_GRACE_S:.0f} s after rank {r} failed: blocked "
                                              "in a collective that rank never joined"})
                        os._exit(0)

    threading.Thread(target=watch_peers, daemon=True).start()
    try:
        mine_bundle: Any = json.loads((Path(out) / "ranks.json").read_text())[str(rank)]
        if code and entries:  # the --entry check again, on the very bundle this rank replays
            from reprokit.code import confirm_entries

            mine_bundle = open_bundle(mine_bundle)
            confirm_entries(mine_bundle.run.get("refs"), json.loads(entries), code, snapshot=mine_bundle.code_dir,
                            source=mine_bundle.path / "run.json")
        report = replay(mine_bundle, times=int(times), device=device, code=code or None, as_rank=True,
                        on_step=on_step)
        doc = {"rank": rank, **report.to_json()}
    except Exception as e:  # a report, not a traceback: the peers' collectives then break and they report too
        doc = {"rank": rank, "error": f"{type(e).__name__}: {e}", "verdict": "error"}
    _write(mine, doc)
    os._exit(0)  # peers may still be blocked in a collective: leave without one (no destroy_process_group)


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


if __name__ == "__main__":
    _rank_main(*sys.argv[1:7])
