"""``reprokit inspect``: what a bundle (or an incident folder) holds and why it failed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from reprokit.cli.inputs import _open, _recovered
from reprokit.cli.options import _writable, archive_opts, bundle_arg, json_opt
from reprokit.cli.output import _echo, _emit


@click.command()
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
    from reprokit.skip_journal import JOURNAL

    if path.is_file():
        return path.name == JOURNAL
    return not (path / "manifest.json").exists() and (path / JOURNAL).is_file()


def _inspect_skips(where: Path, plot: Path | None, show_batch: bool, as_json: bool) -> None:
    """``inspect`` of an out_dir that holds a journal of skips (or of the journal): each skip and its evidence."""
    from reprokit.report import format_skips
    from reprokit.skip_journal import describe_skips

    _one_of_several(plot, show_batch, f"{where} holds a run's skips: pass one of the bundles it lists")
    _show(describe_skips(where), format_skips, as_json)


def _inspect_incident(folder: Path, plot: Path | None, show_batch: bool, as_json: bool) -> None:
    """``inspect`` of an incident folder: its ranks, who failed first, each rank's failure and bundle."""
    from reprokit.distributed.incident import describe_incident
    from reprokit.report import format_describe_incident

    _one_of_several(plot, show_batch, f"{folder} is an incident folder: pass one rank's bundle in it")
    _show(describe_incident(folder), format_describe_incident, as_json)


def _one_of_several(plot: Path | None, show_batch: bool, what: str) -> None:
    """--plot and --batch show one bundle: refused for a folder of several (``what`` says which to pass)."""
    if plot is not None or show_batch:
        raise click.UsageError(f"--plot and --batch show one bundle; {what}")


def _show(d: dict[str, Any], fmt: Callable[[dict[str, Any]], str], as_json: bool) -> None:
    if as_json:
        _emit(d)
    else:
        _echo(fmt(d))
