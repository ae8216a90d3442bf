"""``reprokit verify``: check every file of a bundle or archive against its manifests."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from reprokit.cli.inputs import _open
from reprokit.cli.options import archive_opts, bundle_arg, json_opt
from reprokit.cli.output import _echo, _emit


@click.command()
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
