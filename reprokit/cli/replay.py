"""``reprokit replay``: re-run a bundle (or every rank of an incident folder) and give the verdict."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from reprokit.cli.inputs import _confirm_entries, _open, _recovered
from reprokit.cli.options import archive_opts, bundle_arg, entry_opt, json_opt
from reprokit.cli.output import _echo, _emit, _progress
from reprokit.errors import ConfigError


@click.command()
@bundle_arg
@click.option("--times", "-n", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="Replay this many times to tell deterministic from flaky (an incident folder: every run "
                   "launches all ranks afresh).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where to replay (default: where it was recorded, if available).")
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Import build/step from this checkout instead of the bundle's code snapshot.")
@entry_opt
@click.option("--trust", is_flag=True, help="Do not print the note that replaying runs the bundle's code.")
@click.option("--nproc", type=click.IntRange(1, 1024), default=None,
              help="For an incident folder of a multi-rank run: the number of ranks (default: the run's world size).")
@click.option("--isolate", is_flag=True,
              help="Run each replay in a child process, so that a step that kills the process (a segfault, an "
                   "abort, a poisoned CUDA context) cannot end reprokit (always so for a crash or device-error bundle).")
@archive_opts
@json_opt
def replay(bundle: Path, times: int, device: str | None, code: Path | None, entries: tuple[str, ...], trust: bool,
           nproc: int | None, isolate: bool, as_json: bool, **kw: Any) -> None:
    """Re-run BUNDLE and report whether it fails the same way at the same step.

    Replaying runs code: build() and the step function are imported from the bundle's
    code snapshot (or from --code) and executed. Replay bundles whose code you would run
    yourself; verify, inspect and pack never import it. A bundle from elsewhere (a packed
    archive, or recorded on another host) gets a one-line note saying so on stderr.

    With --code DIR, only the functions --entry names run (build=MOD:FN,step=MOD:FN): a
    bundle may come from anyone, so it does not choose which functions of DIR run.

    Verdicts: deterministic (every run reproduced; with one run, "reproduced once": --times N
    tells deterministic from flaky), flaky (some did), different_failure
    (none did, some failed with another signature or at another step), not_reproduced
    (marked transient, not a fix, when the bundle's own code on the recording device was
    bit-exact up to the failing step).

    A bundle whose failure is a crash (the process died: a signal, an abort) or a device
    error, or any bundle with --isolate, replays each run in a child process: "reproduced"
    then means the child died the same way at the same step (e.g. with SIGSEGV at step 37).

    Exit 1 deterministic or flaky, 0 not reproduced (fixed), 125 different failure
    (git bisect run skips it) or code that does not import, 3 invalid bundle.
    """
    from reprokit.archive import is_archive
    from reprokit.bundle import is_incident, open_bundle
    from reprokit.replayer import foreign_code_note, format_report
    from reprokit.replayer import replay as do_replay

    bundle = _recovered(bundle, as_json)
    if is_incident(bundle) or nproc is not None:
        _replay_incident(bundle, times, device, code, entries, nproc, as_json, trust, kw)

    with _progress(times, "replay", enabled=not as_json and times > 1) as update, _open(bundle, kw) as path:
        opened = open_bundle(path)  # verified once, here
        _confirm_entries(opened, code, entries)
        note = None if trust else foreign_code_note(opened, is_archive(bundle), code)
        if note:
            _echo(note, err=True)
        report = do_replay(opened, times=times, device=device, code=code, isolate=isolate or None,
                           progress=lambda i, n: update(i, f"run {i}/{n}"))
    d = report.to_json()
    d["bundle"] = str(bundle)
    top = path.parent.parent if path.parent.name.startswith("repro-") else path.parent  # pack's repro-*/
    if is_archive(bundle) and isinstance(d.get("code"), str) and Path(d["code"]).is_relative_to(top):
        # the archive was extracted into a temporary folder, removed by now: name the code inside the archive
        d["code"] = f"{bundle}: {Path(d['code']).relative_to(top)}"
    if as_json:
        _emit(d)
    else:
        _echo(format_report(d))
    sys.exit(report.exit_code)


def _replay_incident(folder: Path, times: int, device: str | None, code: Path | None, entries: tuple[str, ...],
                     nproc: int | None, as_json: bool, trust: bool, kw: dict[str, Any]) -> None:
    """``replay`` of an incident folder: the same checks and code note as one bundle's, then every rank replayed."""
    from reprokit.bundle import is_incident
    from reprokit.distributed.incident import rank_bundles, replay_incident
    from reprokit.replayer import foreign_code_note
    from reprokit.report import format_incident

    if not is_incident(folder):
        raise click.UsageError(f"--nproc needs an incident folder of a multi-rank run; {folder} is not one")
    if kw.get("sha256") is not None:  # as for one bundle folder: its manifests' checksums are what is checked
        raise ConfigError.option("sha256", f"{{opt}} checks an archive; {folder} is an incident folder, whose "
                                           "bundles are checked by their manifests' checksums")
    notes = []
    for opened in rank_bundles(folder).values():
        _confirm_entries(opened, code, entries)
        note = None if trust else foreign_code_note(opened, False, code)
        if note and note not in notes:  # every rank runs its bundle's code: one note per distinct origin
            notes.append(note)
    for note in notes:
        _echo(note, err=True)
    report = replay_incident(folder, times=times, device=device, nproc=nproc, code=code,
                             entries=entries if code is not None else None)
    d = report.to_json()
    if as_json:
        _emit(d)
    else:
        _echo(format_incident(d))
    sys.exit(report.exit_code)
