"""``reprokit extract``: the module that failed, cut out into a bundle of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from reprokit.cli.inputs import _confirm_entries, _open
from reprokit.cli.options import _new_folder, archive_opts, bundle_arg, entry_opt, json_opt
from reprokit.cli.output import _echo, _emit


@click.command()
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
