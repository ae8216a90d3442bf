"""``reprokit gc``: the temp folders that killed bundle writers left behind."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from reprokit.cli.options import json_opt
from reprokit.cli.output import _echo, _emit


@click.command()
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
