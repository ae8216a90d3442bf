"""Options and arguments shared by several commands (``--json``, the archive options, ``--entry``, ...), and the
checks of output paths that run while the command line is parsed (a usage error, exit 2, before any work)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

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
    from reprokit.archive_limits import Limits

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


ENTRY_HELP = ("With --code: the functions of your checkout the bundle may run, [ROLE=]MODULE:QUALNAME, comma-separated "
              "or repeated (e.g. build=train:build,step=train:train_step; a script run as `python train.py` is "
              "train.py:build; `reprokit inspect` lists the refs); the bundle's own refs are refused "
              "otherwise, since a bundle may come from anyone.")
entry_opt = click.option("--entry", "entries", multiple=True, metavar="[ROLE=]MODULE:QUALNAME", help=ENTRY_HELP)


device_opt = click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Where to replay.")
code_opt = click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
                        help="Import build/step from this checkout instead of the bundle's code snapshot.")
