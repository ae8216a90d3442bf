"""``reprokit shrink``: the smallest bundle that still fails the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from reprokit.cli.inputs import _confirm_entries, _open, _recovered
from reprokit.cli.options import _new_folder, archive_opts, bundle_arg, entry_opt, json_opt
from reprokit.cli.output import _echo, _emit, _progress
from reprokit.shrink.registry import PASS_NAMES


@click.command()
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
