"""``reprokit bisect``: localise a failure over steps, layers, precision or commits."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from reprokit.bisect.registry import AXES, VARIANTS
from reprokit.cli.inputs import _confirm_entries, _open
from reprokit.cli.options import archive_opts, bundle_arg, code_opt, device_opt, entry_opt, json_opt
from reprokit.cli.output import _echo, _emit, _progress


class _AxisGroup(click.Group):
    """``bisect``: a bundle given where the axis goes (``reprokit bisect BUNDLE``) gets the axes named."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        if args and args[0] not in self.commands and os.path.exists(args[0]):
            what = "; ".join(f"{name}: {finds}" for name, finds in AXES.items())
            raise click.UsageError(f"bisect needs an axis before the bundle: reprokit bisect {'|'.join(AXES)} "
                                   f"{args[0]} ({what})", ctx)
        return super().resolve_command(ctx, args)


@click.group(cls=_AxisGroup)
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
