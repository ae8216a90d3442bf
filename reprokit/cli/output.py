"""What a command prints: text with control characters escaped, the one JSON object of ``--json``, a progress bar."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import click

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
