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
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from reprokit._version import __version__
from reprokit.cli import bisect, demo, extract, gc, inspect, pack, recover, replay, shrink, verify
from reprokit.cli.output import _echo, _emit, _json_out
from reprokit.errors import ConfigError, ReprokitError

# Layout: this file holds the group, its error handling (every error becomes one clean message, one JSON object with
# --json, and its exit code) and the registration of the commands; each command lives in a module of its own
# (replay.py, inspect.py, ...), beside options.py (options several commands share), inputs.py (opening the BUNDLE
# argument) and output.py (printing). A new command is a module with a `click.command` added to the list below; its
# options get their REPROKIT_<COMMAND>_<OPTION> variable from _name_envvars. The modules import each other directly,
# never through this package (tests/unit/test_import_graph.py); their helpers keep a leading underscore: they are
# this package's own, not reprokit's API.
#
# Import rule (`reprokit --help` and `--version` must answer in <= 0.3 s): at module level the modules of this
# package import only click, the standard library and modules that do not import torch (reprokit.errors, the
# registries of shrink passes and bisect axes, reprokit.archive for Limits). Every command imports what it needs
# inside its function (`from reprokit.bundle import open_bundle`), so torch loads only when a command runs.
# tests/integration/test_io.py::test_help_and_version_do_not_import_torch holds this.

CONTEXT = {"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "REPROKIT"}

EXIT_USAGE = 2
EXIT_INTERNAL = 70  # EX_SOFTWARE (sysexits.h); plain `git bisect run` reads it as bad: the README's recipe stops on it
EXIT_INTERRUPTED = 130
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A full disk or quota while writing an output: said as such (exit 2), not as a bug."""


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


for _command in (replay.replay, inspect.inspect, verify.verify, shrink.shrink, pack.pack, extract.extract, bisect.bisect,
                 demo.demo, recover.recover, gc.gc):
    main.add_command(_command)


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

