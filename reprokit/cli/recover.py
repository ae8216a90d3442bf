"""``reprokit recover``: the flight logs of durable runs that died, turned into bundles."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from reprokit.cli.options import json_opt
from reprokit.cli.output import _echo, _emit


@click.command()
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
