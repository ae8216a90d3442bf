"""The ``reprokit`` command line. Thin: parse, call the library, print, exit.

Exit codes, the same for every command (the README's table says which apply to each):

====  ==============================================================================
0     ok; ``replay``: the failure did not reproduce (fixed)
1     ``replay``: reproduced (same signature at the same step, in at least one run);
      ``verify``: problems found; ``shrink``: the bundle does not reproduce
2     usage error (unknown option, missing path, bad value, an output path that cannot be created;
      ``bisect commits``: a wrong end)
3     invalid or tampered bundle (not a bundle, an empty folder, a folder of bundles, a checksum mismatch)
70    internal error: an unexpected exception (a bug); the traceback is saved to a file
125   the code cannot be imported or the state does not fit; ``replay``: a different
      failure (another signature, or the same one at another step)
130   interrupted (Ctrl-C)
====  ==============================================================================

1, 0 and 125 are what ``git bisect run`` reads as bad, good and skip, so
``git bisect run reprokit replay BUNDLE --code . --entry build=M:F,step=M:F`` works;
git reads 2, 3 and 70 as bad too (README: "Which commit broke it?" stops on them)
and 130 as stop. With ``--json`` every command prints
exactly one JSON object on stdout, also on failure:
``{"error": {"type": ..., "message": ..., "exit_code": ...}}``; anything the
user's code prints goes to stderr meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import click

from reprokit._version import __version__
from reprokit.bisect.registry import AXES, VARIANTS
from reprokit.errors import ConfigError, ReprokitError
from reprokit.shrink.registry import PASS_NAMES

# Import rule (`reprokit --help` and `--version` must answer in <= 0.3 s): at module level this
# file imports only click, the standard library and modules that do not import torch (reprokit.errors, the
# registries of shrink passes and bisect axes, reprokit.archive for Limits). Every command imports what it needs
# inside its function (`from reprokit.bundle import open_bundle`), so torch loads only when a command runs.
# tests/integration/test_io.py::test_help_and_version_do_not_import_torch holds this.

CONTEXT = {"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "REPROKIT"}

EXIT_USAGE = 2
EXIT_INTERNAL = 70  # EX_SOFTWARE (sysexits.h); plain `git bisect run` reads it as bad: the README's recipe stops on it
EXIT_INTERRUPTED = 130
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A full disk or quota while writing an output: said as such (exit 2), not as a bug."""

# Where --json output goes: the real stdout, saved while the command's own stdout is sent to stderr.
_json_out: list[TextIO] = []


def _echo(message: Any = None, **kw: Any) -> None:
    """``click.echo`` of text that may hold a bundle's strings (messages, names): control characters escaped."""
    from reprokit.text import printable

    click.echo(None if message is None else printable(str(message)), **kw)


def _emit(obj: dict[str, Any]) -> None:
    from reprokit.bundle import jsonable

    out = _json_out[-1] if _json_out else None
    click.echo(json.dumps(jsonable(obj), indent=2, sort_keys=False), file=out)  # json escapes control chars


def _wants_json(args: Sequence[str]) -> bool:
    """Did this invocation ask for --json (on the command line or via REPROKIT_<COMMAND>_JSON)?

    Read from the raw arguments so that it is known also when parsing them failed.
    """
    words: list[str] = []
    for a in args:
        if a == "--":
            break
        if a == "--json":
            return True
        if not a.startswith("-") and len(words) < 2 and (not words or words[0] == "bisect"):
            words.append(a)
    env = "REPROKIT_" + "_".join(w.upper().replace("-", "_") for w in words) + "_JSON"
    return bool(words) and os.environ.get(env, "").strip().lower() in ("1", "true", "yes", "on", "t", "y")


Update = Callable[[int, str], None]


@contextlib.contextmanager
def _progress(length: int, label: str, *, enabled: bool = True) -> Iterator[Update]:
    """A progress bar on stderr, only when stderr is a terminal; yields ``update(done, info)``.

    Elsewhere (a pipe, a log file, CliRunner, ``--json``) it prints nothing, so a captured log
    holds no carriage returns. The bar ends its line on exit, also when the command fails, so
    an error message or the final output never lands on it.
    """
    if not enabled or not sys.stderr.isatty():
        def nothing(done: int, info: str = "") -> None:
            pass

        yield nothing
        return
    with click.progressbar(length=length, label=label, file=sys.stderr, show_eta=False, show_pos=True,
                           item_show_func=lambda info: info) as bar:
        def update(done: int, info: str = "") -> None:
            bar.update(max(0, min(done, length) - bar.pos), info)

        yield update


def _save_traceback(exc: BaseException) -> Path | None:
    try:
        fd, name = tempfile.mkstemp(prefix=f"reprokit-traceback-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"reprokit {' '.join(sys.argv[1:])}\n\n")
            f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return Path(name)
    except OSError:
        return None


class _Group(click.Group):
    """Turns every error into one clean message (one JSON object with --json) and its exit code."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        as_json = _wants_json(argv)
        _json_out.append(sys.stdout)
        try:
            # With --json, stdout carries exactly one JSON object: whatever else prints goes to stderr.
            with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
                rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as e:  # `reprokit` alone: its help, then exit 2
            e.show()
            sys.exit(EXIT_USAGE)
        except click.ClickException as e:
            self._fail(as_json, type(e).__name__, e.format_message(), EXIT_USAGE, show=e.show)
        except (click.Abort, KeyboardInterrupt):
            self._fail(as_json, "Interrupted", "interrupted", EXIT_INTERRUPTED)
        except ReprokitError as e:
            problems = getattr(e, "problems", None)
            extra_info = {"problems": problems} if problems else {}
            extra_info.update(getattr(e, "details", None) or {})
            message = e.cli_message if isinstance(e, ConfigError) else str(e)  # `--times`, where Python says `times`
            self._fail(as_json, type(e).__name__, message, e.exit_code, **extra_info)
        except OSError as e:
            if e.errno not in _DISK_FULL:
                self._internal(as_json, e)
            where = f" ({e.filename})" if e.filename else ""
            self._fail(as_json, "DiskFull", f"no space left to write{where}: {e.strerror or e}. Nothing partial was "
                                            "kept. Free some space (or name an output on another disk) and run again.",
                       EXIT_USAGE)
        except Exception as e:
            self._internal(as_json, e)
        finally:
            _json_out.pop()
        sys.exit(rv if isinstance(rv, int) else 0)

    def _internal(self, as_json: bool, e: Exception) -> None:
        saved = _save_traceback(e)
        cause = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        where = f"the traceback is in {saved}" if saved else "the traceback could not be saved"
        self._fail(as_json, type(e).__name__,
                   f"internal error: {cause}. This is a bug in reprokit (or an unexpected error from your code); "
                   f"{where}; please include it in a bug report.",
                   EXIT_INTERNAL, internal=True, traceback=str(saved) if saved else None)

    @staticmethod
    def _fail(as_json: bool, kind: str, message: str, code: int, show: Any = None, **fields: Any) -> None:
        if show is not None:
            show()  # click's own "Usage: ... Error: ..." on stderr
        else:
            _echo(f"Error: {message}", err=True)
        if as_json:
            _emit({"error": {"type": kind, "message": message, "exit_code": code, **fields}})
        sys.exit(code)


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(__version__, prog_name="reprokit")  # not package metadata: a checkout on PYTHONPATH has none
def main() -> None:
    """reprokit: turn a failing training run into a small, portable repro.

    A bundle is a test case: `replay` exits 1 while the failure reproduces, 0 once
    it is fixed and 125 when it fails differently, so `git bisect run reprokit
    replay BUNDLE --code . --entry build=train.py:build,step=train.py:train_step`
    works (run it once on the bad commit first: git reads 2, 3 and 70 as bad too).
    Exit codes of every command: 0 ok, 1 see the command, 2 usage, 3 invalid
    bundle, 70 internal error (traceback saved), 125 code does not import / state
    does not fit, 130 interrupted.
    """


bundle_arg = click.argument("bundle", type=click.Path(exists=True, path_type=Path))
json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")


def _sha256_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A digest given on the command line is 64 hex digits, or a usage error (exit 2) before anything is read."""
    if value is not None:
        want = value.strip().lower()
        if len(want) != 64 or any(c not in "0123456789abcdef" for c in want):
            raise click.BadParameter(f"expected a sha256: 64 hex digits, got {value[:80]!r}")
        return want
    return value


def _writable(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """An output path (-o, --out, --plot) whose folder cannot be written is a usage error (exit 2), said before any
    work: not an internal error after a whole shrink. Probed with a temporary file in the nearest existing folder."""
    if value is not None:
        _probe(value.absolute().parent, f"{value} cannot be created there; name a path in a folder you can write to")
    return value


def _probe(path: Path, then: str) -> None:
    """A usage error when files cannot be written at ``path`` (see :func:`reprokit.bundle.write_probe`)."""
    from reprokit.bundle import write_probe

    folder, why = write_probe(path)
    if why is not None:
        raise click.BadParameter(f"cannot write into {folder} ({why}), so {then}")


def _folder_to_write_into(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """A folder the command writes files into (demo's --out): probed itself when it exists (a read-only mount in a
    writable folder passes :func:`_writable`, which probes where a new path would be made)."""
    if value is not None:
        try:
            what = "nothing can be written into it" if value.is_dir() else f"{value} cannot be created there"
        except OSError:  # a name too long: write_probe says so
            what = f"{value} cannot be created there"
        _probe(value, f"{what}; name a folder you can write to")
    return value


def _new_folder(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """An output folder (-o of shrink, extract) that the result is renamed onto, atomically: :func:`_writable`, and
    not a mount point (a rename onto one fails with EBUSY after the whole run)."""
    if value is not None and os.path.ismount(value):
        raise click.BadParameter(f"{value} is a mount point; the result is written beside it and renamed into place "
                                 "(so that a half-written one never shows), which cannot replace a mount point. "
                                 f"Name a new folder inside it, e.g. {value / 'small'}")
    return _writable(ctx, param, value)


def _accept_generated(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """``--accept-generated``: for the rest of the command, generated files that differ are not problems."""
    if value:
        from reprokit.generated import accepting

        ctx.with_resource(accepting())


accept_generated_opt = click.option(
    "--accept-generated", is_flag=True, expose_value=False, callback=_accept_generated,
    help="Accept generated files (extract/op_repro.py, code/rk_extract.py; an archive's repro.py, README.md and "
         "reprokit/ runtime) that differ from what this reprokit writes: written by another version, or edited. "
         "They run when the bundle's instructions are followed: read them first.")


def archive_opts(fn: Any) -> Any:
    """Options for opening a packed archive (.tar or .tar.gz): its digest and the extraction caps; and
    --accept-generated."""
    from reprokit.archive import Limits

    d = Limits()
    opts = [
        accept_generated_opt,
        click.option("--sha256", default=None, callback=_sha256_option,
                     help="Expected sha256 of an archive (default: read BUNDLE.sha256 beside it, if there is one)."),
        click.option("--max-members", default=d.max_members, show_default=True, type=click.IntRange(1),
                     help="Refuse archives with more members."),
        click.option("--max-file-bytes", default=d.max_file_bytes, show_default=True, type=click.IntRange(1),
                     help="Refuse archives holding a larger file."),
        click.option("--max-total-bytes", default=d.max_total_bytes, show_default=True, type=click.IntRange(1),
                     help="Refuse archives that inflate to more bytes."),
        click.option("--max-ratio", default=d.max_ratio, show_default=True, type=click.FloatRange(1),
                     help="Refuse archives that inflate more than this many times their size."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _refuse_folder_of_bundles(path: Path) -> None:
    from reprokit.bundle import folder_of_bundles
    from reprokit.errors import BundleError

    message = folder_of_bundles(path)
    if message:
        raise BundleError(message)


ENTRY_HELP = ("With --code: the functions of your checkout the bundle may run, [ROLE=]MODULE:QUALNAME, comma-separated "
              "or repeated (e.g. build=train:build,step=train:train_step; a script run as `python train.py` is "
              "train.py:build; `reprokit inspect` lists the refs); the bundle's own refs are refused "
              "otherwise, since a bundle may come from anyone.")
entry_opt = click.option("--entry", "entries", multiple=True, metavar="[ROLE=]MODULE:QUALNAME", help=ENTRY_HELP)


def _confirm_entries(opened: Any, code: Path | None, entries: tuple[str, ...]) -> None:
    """With --code, refuse (exit 2) refs of the opened bundle that --entry does not name; without, refuse --entry."""
    from reprokit.code import confirm_entries

    if code is None:
        if entries:
            raise click.UsageError("--entry only applies with --code (the bundle's own snapshot runs its own refs)")
        return
    confirm_entries(opened.run.get("refs"), entries, code, snapshot=opened.code_dir, source=opened.path / "run.json")


def _open(bundle: Path, kw: dict[str, Any]) -> Any:
    """Context manager yielding a bundle folder for a folder or a (safely extracted) archive."""
    from reprokit.archive import Limits, bundle_dir

    _refuse_folder_of_bundles(bundle)
    limits = Limits(max_members=kw.pop("max_members"), max_file_bytes=kw.pop("max_file_bytes"),
                    max_total_bytes=kw.pop("max_total_bytes"), max_ratio=kw.pop("max_ratio"))
    return bundle_dir(bundle, sha256=kw.pop("sha256"), limits=limits)


@main.command()
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


@main.command()
@bundle_arg
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, callback=_writable,
              help="Also draw loss and grad-norm history, failure marked, to this PNG (needs matplotlib).")
@click.option("--batch", "show_batch", is_flag=True, help="Also print the failing step's batch itself, row by row.")
@click.option("--rows", default=None, help="With --batch: only these rows (e.g. 5, 1,4 or 2-6).")
@archive_opts
@json_opt
def inspect(bundle: Path, plot: Path | None, show_batch: bool, rows: str | None, as_json: bool, **kw: Any) -> None:
    """Show BUNDLE's failure, window, batch structure, a diagnosis of the failing batch, state sizes, env and losses.

    BUNDLE may be a bundle folder or a packed archive (.tar or .tar.gz), the incident folder of a
    multi-rank run (its ranks, the rank that failed first, each rank's failure and bundle), or the out_dir of a run
    recorded with on_failure="skip" (or its skips.jsonl): every skipped sample, its evidence and its bundle.
    The diagnosis checks the failing step's batch for non-finite values, ids past the model's embedding tables,
    empty masks, all-ignored labels and sequences past the position table.
    """
    from reprokit.bundle import open_bundle
    from reprokit.report import batch_dump, describe, format_batch, format_describe, parse_rows, plot_history

    if rows is not None and not show_batch:
        raise click.UsageError("--rows needs --batch")
    bundle = _recovered(bundle, as_json)
    if _is_incident(bundle):
        _inspect_incident(bundle, plot, show_batch, as_json)
        return
    if _is_skips(bundle):
        _inspect_skips(bundle, plot, show_batch, as_json)
        return
    picked = parse_rows(rows) if rows is not None else None
    with _open(bundle, kw) as path:
        opened = open_bundle(path)
        d = describe(opened)
        if show_batch:
            d["batch_values"] = batch_dump(opened, picked)
        if plot is not None:
            plot_history(opened, plot)
            d["plot"] = str(plot)
    d["bundle"] = str(bundle)
    if as_json:
        _emit(d)
        return
    _echo(format_describe(d))
    if plot is not None:
        _echo(f"plot     wrote {plot}")
    if show_batch:
        _echo(format_batch(d["batch_values"]))


def _is_incident(path: Path) -> bool:
    """A folder of rank bundles, named as a multi-rank run names them. A folder of one process's bundles (a copy of an
    out_dir, an unpacked repro) is not: inspect then names the bundles in it instead of talking of incidents."""
    from reprokit.bundle.layout import RANK_BUNDLE, is_incident

    return is_incident(path) and any(RANK_BUNDLE.fullmatch(p.name) for p in path.iterdir() if p.is_dir())


def _is_skips(path: Path) -> bool:
    """A run's journal of skipped samples, or an out_dir (not a bundle) that holds one."""
    from reprokit.skip import JOURNAL

    if path.is_file():
        return path.name == JOURNAL
    return not (path / "manifest.json").exists() and (path / JOURNAL).is_file()


def _inspect_skips(where: Path, plot: Path | None, show_batch: bool, as_json: bool) -> None:
    """``inspect`` of an out_dir that holds a journal of skips (or of the journal): each skip and its evidence."""
    from reprokit.report import format_skips
    from reprokit.skip import describe_skips

    if plot is not None or show_batch:
        raise click.UsageError(f"--plot and --batch show one bundle; {where} holds a run's skips: pass one of the "
                               "bundles it lists")
    d = describe_skips(where)
    if as_json:
        _emit(d)
    else:
        _echo(format_skips(d))


def _inspect_incident(folder: Path, plot: Path | None, show_batch: bool, as_json: bool) -> None:
    """``inspect`` of an incident folder: its ranks, who failed first, each rank's failure and bundle."""
    from reprokit.distributed.incident import describe_incident
    from reprokit.report import format_describe_incident

    if plot is not None or show_batch:
        raise click.UsageError(f"--plot and --batch show one bundle; {folder} is an incident folder: pass one "
                               "rank's bundle in it")
    d = describe_incident(folder)
    if as_json:
        _emit(d)
    else:
        _echo(format_describe_incident(d))


@main.command()
@bundle_arg
@archive_opts
@json_opt
def verify(bundle: Path, as_json: bool, **kw: Any) -> None:
    """Check every file of BUNDLE against its manifest; exit 1 if anything is wrong.

    For an archive: its sha256 (from --sha256 or BUNDLE.sha256 beside it), then
    every member and the whole stream, then the manifests of what it holds
    (every file, repro.py and the runtime included). Files reprokit generates
    (extract/op_repro.py, code/rk_extract.py; an archive's repro.py, README.md and
    runtime) must be what this reprokit writes, unless --accept-generated (each
    accepted one is still listed); a file beyond the bundle layout is a problem.
    Every problem is listed. Exit 3 if the format is newer than this reprokit reads.
    """
    from reprokit.archive import digest_source, is_archive
    from reprokit.bundle import MANIFEST
    from reprokit.bundle import verify as verify_bundle
    from reprokit.errors import BundleError
    from reprokit.generated import accepted
    from reprokit.pack import differences

    origin = digest_source(bundle, kw["sha256"]) if is_archive(bundle) else None
    from reprokit.bundle import folder_of_bundles

    parent = folder_of_bundles(bundle)
    diffs: list[dict[str, Any]] = []
    try:
        if parent:  # listed as the problem (exit 1), as for any folder that is not a bundle
            problems = [{"file": MANIFEST, "problem": f"missing: {parent}"}]
        else:
            with _open(bundle, kw) as path:
                problems = verify_bundle(path)
                diffs = differences(path) if accepted() else []  # what --accept-generated let through, listed
    except BundleError as e:
        if not e.problems:
            raise
        problems = e.problems
    note = None
    if is_archive(bundle) and origin is None:
        note = ("origin not checked: no --sha256 given and no .sha256 beside the archive; the manifests prove "
                "it is consistent, not who made it. Compare with a sha256 you received separately.")
    d: dict[str, Any] = {"bundle": str(bundle), "ok": not problems, "problems": problems}
    if accepted() and not problems:
        d["accepted"] = diffs
    if bundle.is_dir():
        from reprokit.bundle.reference import referenced

        refs = referenced(bundle)
        if refs is not None:  # a bundle that holds another rank's state by reference
            d["referenced"] = refs
    if is_archive(bundle):
        d |= {"origin_checked": origin is not None and not problems, "origin": origin, "note": note}
    if as_json:
        _emit(d)
    else:
        from reprokit.report import format_verify

        _echo(format_verify(d))
    sys.exit(1 if problems else 0)


@main.command()
@bundle_arg
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path), callback=_new_folder,
              help="Directory for the shrunk bundle (must not exist, or be empty).")
@click.option("--budget", default=300, show_default=True, type=click.IntRange(1),
              help="Most candidate replays to spend.")
@click.option("--passes", default=",".join(PASS_NAMES), show_default=True,
              help="Comma-separated passes to run, in order.")
@click.option("--pad-id", default=0, show_default=True, type=int,
              help="Neutral value for integer tensors in the tokens pass (your tokenizer's pad id).")
@click.option("--isolate", is_flag=True, help="Replay each candidate in a subprocess (segfaults, hangs).")
@click.option("--timeout", default=60.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds per isolated candidate before it counts as not failing.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Where to replay candidates.")
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Import build/step from this checkout instead of the bundle's code snapshot; the shrunk bundle "
                   "then carries the files of it that ran (what the failure was confirmed against).")
@entry_opt
@archive_opts
@json_opt
def shrink(bundle: Path, output: Path, budget: int, passes: str, pad_id: int, isolate: bool, timeout: float,
           device: str | None, code: Path | None, entries: tuple[str, ...], as_json: bool, **kw: Any) -> None:
    """Minimise BUNDLE to the fewest steps, rows, sequence positions and tokens that fail the same way.

    Exit 0 with the shrunk bundle written to OUTPUT; exit 1 if BUNDLE does not
    reproduce to begin with; 3 invalid bundle; 125 code does not import or state
    does not fit.
    """
    from reprokit.bundle import open_bundle
    from reprokit.shrink import shrink as do_shrink

    bundle = _recovered(bundle, as_json)
    with _progress(budget, "shrink", enabled=not as_json) as update, _open(bundle, kw) as path:
        opened = open_bundle(path)
        _confirm_entries(opened, code, entries)
        result = do_shrink(opened, output, budget=budget, passes=[p.strip() for p in passes.split(",") if p.strip()],
                           pad_id=pad_id, isolate=isolate, timeout=timeout, device=device, code=code,
                           progress=lambda name, replays, size: update(replays, f"{name}, best: {size}"))
    from reprokit.report import format_shrink

    d = result.to_json()
    _emit(d) if as_json else _echo(format_shrink(d))


def _archive_name(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``pack -o``: a name that says what the file is (a tarball named .zip would be opened as a zip and fail)."""
    if value is not None and not value.name.endswith((".tar", ".tar.gz", ".tgz")):
        raise click.BadParameter(f"{value.name} does not end in .tar, .tar.gz or .tgz; pack writes a tarball "
                                 f"(try {value.with_suffix('').name or value.name}.tar)")
    return _writable(ctx, param, value)


@main.command()
@bundle_arg
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), callback=_archive_name,
              help="The archive to write: OUTPUT.tar (uncompressed, fast) or OUTPUT.tar.gz (gzip, much slower: float "
                   "tensors barely compress); OUTPUT.sha256 is written beside it.")
@click.option("--force", is_flag=True, help="Replace OUTPUT (and its .sha256) if it exists.")
@accept_generated_opt
@json_opt
def pack(bundle: Path, output: Path, force: bool, as_json: bool) -> None:
    """Pack BUNDLE into a deterministic tarball that replays with only torch, numpy and safetensors.

    BUNDLE is a bundle folder (an archive is packed already). Inside the tarball: the
    bundle, repro.py, the reprokit runtime and a README. Send the archive and its
    .sha256; the receiver runs `python repro.py`. Exit 0 written; 2 OUTPUT exists
    (--force replaces it); 3 not a bundle folder, or an invalid or tampered bundle.
    """
    from reprokit.pack import pack as do_pack

    if not bundle.is_dir():
        from reprokit.errors import BundleError

        raise BundleError(f"{bundle} is not a bundle folder; pack takes the folder the recorder wrote "
                          "(a .tar or .tar.gz is already packed: send it with its .sha256)")
    _refuse_folder_of_bundles(bundle)
    if output.exists() and not force:  # said before packing; a tarball sent earlier is not replaced unasked
        raise click.BadParameter(f"{output} already exists; pick another name, or pass --force to replace it",
                                 param_hint="-o")
    from reprokit.report import format_pack

    r = do_pack(bundle, output).to_json()
    _emit(r) if as_json else _echo(format_pack(r, output.name))


@main.command()
@bundle_arg
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path), callback=_new_folder,
              help="Folder for the extract (must not exist, or be empty).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Where to replay.")
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Import build/step from this checkout instead of the bundle's code snapshot.")
@entry_opt
@archive_opts
@json_opt
def extract(bundle: Path, output: Path, device: str | None, code: Path | None, entries: tuple[str, ...],
            as_json: bool, **kw: Any) -> None:
    """Cut the module that failed out of BUNDLE: a small bundle of that module alone.

    The extract holds the module's class (source from the code snapshot, or a torch
    class), its parameters and buffers, the inputs it received and, for a backward
    failure, the gradient flowing into it; replaying it runs just that module. Where
    one aten op made the first bad value, extract/op_repro.py runs that op alone.
    Exit 0 written; 1 the bundle does not reproduce, or no module is to blame (the
    step function's own code or the batch made the value: said, and that op's inputs
    saved in OUTPUT where known).
    """
    from reprokit.bundle import open_bundle
    from reprokit.extract import extract as do_extract
    from reprokit.extract import format_extract

    with _open(bundle, kw) as path:
        opened = open_bundle(path)
        _confirm_entries(opened, code, entries)
        result = do_extract(opened, output, device=device, code=code, source=bundle)
    d = result.to_json()
    _emit(d) if as_json else _echo(format_extract(d))


class _AxisGroup(click.Group):
    """``bisect``: a bundle given where the axis goes (``reprokit bisect BUNDLE``) gets the axes named."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        if args and args[0] not in self.commands and os.path.exists(args[0]):
            what = "; ".join(f"{name}: {finds}" for name, finds in AXES.items())
            raise click.UsageError(f"bisect needs an axis before the bundle: reprokit bisect {'|'.join(AXES)} "
                                   f"{args[0]} ({what})", ctx)
        return super().resolve_command(ctx, args)


@main.group(cls=_AxisGroup)
def bisect() -> None:
    """Localise a failure: over steps, layers/ops, precision and kernels, or git commits."""


def _bisect_axis(axis: str, bundle: Path, device: str | None, code: Path | None, as_json: bool, kw: dict[str, Any],
                 **opts: Any) -> None:
    """Run one replay-based bisect axis, print its result, and exit 1 when the recorded failure did not reproduce
    (what it printed then localises nothing, and it says so)."""
    from reprokit.bisect import axis as replay_axis
    from reprokit.bundle import open_bundle
    from reprokit.replayer import not_reproduced_note

    fn, fmt = replay_axis(axis)
    with _open(bundle, kw) as path:
        opened = open_bundle(path)
        _confirm_entries(opened, code, kw.pop("entries"))
        d = fn(opened, device=device, code=code, **opts)
    if d.get("reproduced") is False:
        d["note"] = d.get("note") or not_reproduced_note(opened)
    _emit(d) if as_json else _echo(fmt(d))
    if d.get("reproduced") is False:
        if not as_json:
            _echo(d["note"])
        sys.exit(1)


device_opt = click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Where to replay.")
code_opt = click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
                        help="Import build/step from this checkout instead of the bundle's code snapshot.")


@bisect.command("steps")
@bundle_arg
@device_opt
@code_opt
@entry_opt
@archive_opts
@json_opt
def bisect_steps(bundle: Path, device: str | None, code: Path | None, as_json: bool, **kw: Any) -> None:
    """Replay step by step: the first step whose grads, params, optimizer state, scaler or loss
    went bad (often before the failure fired), with loss, grad norm, top-5 grads, LR and scale per step.

    Exit 0; 1 when the recorded failure does not reproduce (the table is still printed, but localises
    nothing); 3 invalid bundle; 125 code does not import or state does not fit.
    """
    _bisect_axis("steps", bundle, device, code, as_json, kw)


@bisect.command("layers")
@bundle_arg
@device_opt
@code_opt
@entry_opt
@click.option("--keep", default=20, show_default=True, type=click.IntRange(1),
              help="How many module frames before the culprit to show.")
@archive_opts
@json_opt
def bisect_layers(bundle: Path, device: str | None, code: Path | None, keep: int, as_json: bool, **kw: Any) -> None:
    """Replay the failing step with hooks on every module: the first module (and aten op inside
    it) producing a non-finite value, or the module whose forward raised, with the frames before it.

    Exit 0; 1 when the recorded failure does not reproduce; 3 invalid bundle; 125 code does not
    import or state does not fit.
    """
    _bisect_axis("layers", bundle, device, code, as_json, kw, keep=keep)


@bisect.command("precision")
@bundle_arg
@device_opt
@code_opt
@entry_opt
@click.option("--variants", default=None,
              help="Comma-separated subset of variants to run (default: all): " + ", ".join(VARIANTS) + ".")
@archive_opts
@json_opt
def bisect_precision(bundle: Path, device: str | None, code: Path | None, variants: str | None, as_json: bool,
                     **kw: Any) -> None:
    """Replay under fp32 / bf16 / fp16 autocast, TF32 on/off, each SDPA backend and
    deterministic algorithms: pass, fail, n/a or different_failure per variant, and the smallest fix.
    fp32 / bf16 / fp16 say the dtypes they ran in; one that did not run in its dtype is not_applied.

    Exit 0; 1 when the recorded failure does not reproduce; 3 invalid bundle; 125 code does not
    import or state does not fit.
    """
    names = [v.strip() for v in variants.split(",") if v.strip()] if variants is not None else None
    if names == []:
        raise click.BadParameter(f"{variants!r} names no variant; give some, e.g. --variants recorded,fp32 (or "
                                 "leave --variants out to run them all)", param_hint="--variants")
    with _progress(len(names or VARIANTS), "bisect precision", enabled=not as_json) as update:
        done: list[str] = []

        def progress(name: str, verdict: str) -> None:
            done.append(name)
            update(len(done), f"{name}: {verdict}")

        _bisect_axis("precision", bundle, device, code, as_json, kw, variants=names, progress=progress)


@bisect.command("commits")
@bundle_arg
@click.option("--good", required=True, help="A revision where training worked (tag, branch, sha).")
@click.option("--bad", required=True, help="A revision where it fails the same way as BUNDLE.")
@click.option("--repo", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The git repository to bisect (default: the one holding the current folder; never one the "
                   "bundle names).")
@click.option("--first-parent", is_flag=True, help="Follow only the first parent of merges.")
@click.option("--timeout", default=600.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds per probe before it is skipped.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Where to replay.")
@click.option("--entry", "entries", multiple=True, metavar="[ROLE=]MODULE:QUALNAME",
              help="The functions of your commits the bundle may run (each commit's checkout is replayed as "
                   "--code), e.g. build=train:build,step=train:train_step (a script run as `python train.py`: "
                   "train.py:build; `reprokit inspect` lists the refs); needed for the project's own refs, "
                   "since a bundle may come from anyone.")
@archive_opts
@json_opt
def bisect_commits(bundle: Path, good: str, bad: str, repo: Path | None, first_parent: bool, timeout: float,
                   device: str | None, entries: tuple[str, ...], as_json: bool, **kw: Any) -> None:
    """Find the first commit between --good and --bad at which BUNDLE fails the same way.

    Bisects the repository holding the current folder (or --repo), never one the
    bundle names. Each probed commit is checked out into a temporary git worktree
    (your working tree, index, branch and stash are left alone; no git hook runs)
    and replayed in a subprocess.
    Commits that do not import, whose state does not fit, or that fail
    differently are skipped with the reason. Exit 0 found (or the remaining
    candidates listed); 2 a wrong end (the bad end does not fail the same way
    on each of three replays, or the good end does not pass), a ref --entry
    does not name, or no git repository here (pass --repo); 3 invalid bundle.
    """
    from reprokit.bisect import bisect_commits as run

    def progress(p: Any, n: int) -> None:
        _echo(f"  {p.role:<8} {p.sha[:10]}  {p.verdict:<4}  {p.seconds:5.1f}s  {p.reason[:90]}", err=True)

    from reprokit.bundle import open_bundle
    from reprokit.code import confirm_entries

    with _open(bundle, kw) as path:
        opened = open_bundle(path)
        confirm_entries(opened.run.get("refs"), entries, None, snapshot=opened.code_dir,
                        source=opened.path / "run.json")
        if not as_json:
            _echo(f"bisecting {good}..{bad} with {path}", err=True)
        result = run(opened, good=good, bad=bad, repo=repo, first_parent=first_parent, timeout=timeout, device=device,
                     progress=None if as_json else progress)
    d = result.to_json()
    if as_json:
        _emit(d)
        return
    if result.first_bad:
        info = d["first_bad_commit"]
        _echo(f"first bad commit: {info['sha']}\n  {info['subject']}\n  {info['author']}, {info['date']}")
        _echo("  files: " + ", ".join(info["files"]))
    else:
        _echo("ambiguous because of skipped commits; the first bad commit is one of:")
        for sha in d["candidates"]:
            _echo(f"  {sha}")
    _echo(f"{d['replays']} replays over {d['commits_in_range']} commits ({len(d['skipped'])} skipped)")


@main.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None, callback=_folder_to_write_into,
              help="Where to write the bundle (default: a temporary directory).")
@json_opt
def demo(out: Path | None, as_json: bool) -> None:
    """Train a tiny model until a poisoned sample kills it, then replay, shrink, localise, pack and verify the bundle."""
    from reprokit.demo_story import run_demo

    if out is not None and (out / "manifest.json").exists():  # files added to a bundle break its manifest
        raise click.BadParameter(f"{out} is a bundle folder; the demo would write its own bundle, shrunk copy and "
                                 "tarball into it, and that bundle would no longer verify. Give a new or empty "
                                 "folder (or leave --out out: a temporary one)", param_hint="--out")
    taken = [name for name in ("shrunk", "repro.tar.gz") if out is not None and (out / name).exists()]
    if taken:  # said before training, not after it
        raise click.BadParameter(f"{out} already holds {' and '.join(taken)} from an earlier demo; give a new or "
                                 "empty folder (or leave --out out: a temporary one)", param_hint="--out")
    out = out or Path(tempfile.mkdtemp(prefix="reprokit-demo-"))
    result = run_demo(out, say=(lambda s: None) if as_json else _echo)
    if as_json:
        _emit(result)


@main.command()
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@json_opt
def recover(out_dir: Path, as_json: bool) -> None:
    """Turn the flight logs of durable runs that died (Recorder(durable=True)) in OUT_DIR into bundles.

    A run still alive (its lock held) is left alone. Each dead run gives a bundle with failure kind
    "crash" (the ranks of one torchrun job: one incident folder), verified before its flight log is
    removed; running it again says there is nothing to recover. Exit 1 if a bundle could not be written.
    """
    from reprokit.recover import format_recover
    from reprokit.recover import recover as do_recover

    report = do_recover(out_dir)
    _emit(report.to_json()) if as_json else _echo(format_recover(report.to_json()))
    sys.exit(report.exit_code)


def _recovered(bundle: Path, as_json: bool) -> Path:
    """A flight folder (or an out_dir holding dead runs' flight logs) given where a bundle goes: recover it first."""
    from reprokit.recover import recovered_input

    path, note = recovered_input(bundle)
    if note:
        _echo(note, err=True)
    return path


@main.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
@json_opt
def gc(directory: Path, dry_run: bool, as_json: bool) -> None:
    """List and remove temp folders (.tmp-*) that killed bundle writers left in DIRECTORY.

    A folder whose writer is still running on this host is never touched; one
    written from another host (or by an older reprokit) is removed once idle
    for 24 hours. Exit 1 if a removal failed.
    """
    from reprokit.bundle import remove_leftovers

    found = remove_leftovers(directory, dry_run=dry_run)
    failed = [x for x in found if x.error]
    if as_json:
        _emit({"directory": str(directory), "dry_run": dry_run, "leftovers": [x.to_json() for x in found],
               "removed_bytes": sum(x.bytes for x in found if x.removed)})
    else:
        for x in found:
            verb = ("would remove" if dry_run else "removed") if x.removable and not x.error else \
                ("FAILED to remove" if x.error else "kept")
            why = {"writing": "its writer is still running", "recent": "owner unknown, changed lately"}.get(x.state, "")
            _echo(f"{verb} {x.path.name} ({x.bytes / 1e6:.1f} MB, {x.owner}, idle {x.age_s / 3600:.1f} h"
                       + (f"; {why}" if why and not x.removable else "") + (f"; {x.error}" if x.error else "") + ")")
        n = sum(x.removable for x in found)
        _echo(f"{directory}: {len(found)} leftover temp folder(s), {n} abandoned"
                   + (" (dry run: nothing removed)" if dry_run else ""))
    sys.exit(1 if failed else 0)


def _name_envvars(group: click.Group, prefix: str) -> None:
    """Give every option the variable the README documents: ``REPROKIT_<COMMAND>_<OPTION>``.

    Named after the option (``--json`` -> ``REPROKIT_REPLAY_JSON``), not after the Python
    parameter (click's automatic names would read ``REPROKIT_REPLAY_AS_JSON``).
    """
    for name, cmd in group.commands.items():
        cmd_prefix = f"{prefix}_{name.upper().replace('-', '_')}"
        if isinstance(cmd, click.Group):
            _name_envvars(cmd, cmd_prefix)
        for param in cmd.params:
            if isinstance(param, click.Option) and not param.is_eager and param.envvar is None:
                long = max((o for o in param.opts if o.startswith("--")), key=len, default=param.opts[0])
                param.envvar = f"{cmd_prefix}_{long.lstrip('-').upper().replace('-', '_')}"


_name_envvars(main, "REPROKIT")


if __name__ == "__main__":  # pragma: no cover
    main()
