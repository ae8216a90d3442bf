"""Bundles as regression tests, in plain Python and as a pytest plugin.

A bundle is a test case: it fails while the bug is there and passes once it is
fixed. :func:`assert_fixed` says so for one bundle against a code directory; the
pytest plugin turns every bundle in a folder into a test item::

    pytest -p reprokit.testing --reprokit-bundles regressions/ --reprokit-code .

(with reprokit installed, the plugin is registered through the ``pytest11`` entry
point and ``-p reprokit.testing`` may be left out). Each bundle folder or packed
``.tar`` / ``.tar.gz`` under ``--reprokit-bundles`` becomes an item marked ``reprokit_bundle``
that **passes** when the failure no longer reproduces with that code, **fails**
when it still does (the failure and the step are in the report), and **errors**
when the bundle fails some other way, is invalid, or the code does not import:
a different failure is never a pass. Without ``--reprokit-bundles`` (or the
``reprokit_bundles`` ini option) the plugin does nothing.

This module imports torch only when a bundle is replayed, so loading the plugin
costs pytest nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reprokit.errors import ReprokitError
from reprokit.text import printable

ARCHIVES = (".tar", ".tar.gz", ".tgz")
"""Names of packed bundles the plugin collects (what ``reprokit pack`` writes, and earlier versions' archives)."""

if TYPE_CHECKING:
    from reprokit.replayer import ReplayReport

__all__ = ["DifferentFailure", "StillFails", "assert_fixed", "find_bundles"]

MARKER = "reprokit_bundle"


class StillFails(ReprokitError, AssertionError):
    """The bundle still reproduces: the bug is not fixed (a test failure, not an error)."""


class DifferentFailure(ReprokitError):
    """The bundle fails, but not the way it was recorded: neither fixed nor the same bug."""


def _describe(f: dict[str, Any] | None) -> str:
    if not f:
        return "no failure"
    what = f"{f['exception_type']}: {f.get('message')}" if f.get("exception_type") else \
        f"{f.get('kind')} ({f.get('message')})" if f.get("message") else str(f.get("kind"))
    where = f" in {f['frame']}" if f.get("frame") else ""
    return f"{what}{where} at step {f.get('step')}"


def assert_fixed(bundle: str | Path, *, code: str | Path | None = None, times: int = 1,
                 device: str | None = None, sha256: str | None = None) -> ReplayReport:
    """Replay ``bundle`` with ``code`` and raise unless the failure is gone.

    Args:
        bundle: a bundle folder or a packed ``.tar.gz`` (checked against ``sha256`` or
            the ``.sha256`` beside it, when there is one).
        code: the directory to import ``build`` and the step function from (your fixed
            checkout); default: the bundle's own code snapshot, which still has the bug.
        times: replays; more than one catches a failure that only sometimes recurs.
        device: ``"cpu"`` or ``"cuda"``; default: where it was recorded, if available.

    Returns:
        The :class:`~reprokit.replayer.ReplayReport` (verdict ``not_reproduced``).

    Raises:
        StillFails: the recorded failure reproduced in at least one run (an ``AssertionError``).
        DifferentFailure: no run reproduced it, but one failed another way or at another step.
        ReprokitError: the bundle is invalid, or the code does not import or fit the state.

    Example:
        >>> assert_fixed("regressions/bundle-...-nonfinite_loss", code=".")   # doctest: +SKIP
    """
    from reprokit.archive import bundle_dir
    from reprokit.bundle import open_bundle
    from reprokit.code import entry_args
    from reprokit.replayer import replay, verdict_phrase

    with bundle_dir(bundle, sha256=sha256) as path:
        opened = open_bundle(path)
        report = replay(opened, times=times, device=device, code=code)
    entry = " ".join(entry_args(opened.run["refs"]))
    d = report.to_json()
    recorded = _describe(d["recorded_failure"])
    with_code = f"with the code in {code}" if code is not None else "with the bundle's own code snapshot"
    if report.verdict in ("deterministic", "flaky"):
        phrase = verdict_phrase(report.verdict, len(report.runs), "times=N (--reprokit-times N)")
        raise StillFails(
            f"{bundle} still fails {with_code}: {_describe(d['failure'])} "
            f"({report.failed_runs}/{len(report.runs)} runs, {phrase}); "
            "expected it to pass once fixed. "
            f"Debug it with `reprokit replay {bundle}" + (f" --code {code} {entry}`".replace(" `", "`")
                                                          if code is not None else "`"))
    if report.verdict == "different_failure":
        raise DifferentFailure(
            f"{bundle} fails differently {with_code}: {_describe(d['failure'])}, recorded: {recorded}. "
            "It is neither fixed nor the same bug; replay it to see which, and re-record the bundle if the "
            "old failure is gone and this one is expected.")
    return report


def find_bundles(folder: str | Path) -> list[Path]:
    """Bundle folders (holding ``manifest.json``) and packed archives (``.tar``, ``.tar.gz``) under ``folder``, sorted.

    A bundle's own subfolders are not searched. Raises :class:`ReprokitError` when
    ``folder`` does not exist.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ReprokitError(f"--reprokit-bundles {root}: no such folder; expected a folder of bundle folders "
                            "or .tar / .tar.gz archives (what `reprokit pack` writes)")
    return sorted(_walk(root))


def _walk(folder: Path) -> Iterator[Path]:
    if (folder / "manifest.json").is_file():
        yield folder
        return
    for p in sorted(folder.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            yield from _walk(p)
        elif p.name.endswith(ARCHIVES):
            yield p


# --- the pytest plugin ------------------------------------------------------------------

try:
    import pytest
except ImportError:  # pragma: no cover - the plugin needs pytest; assert_fixed does not
    pytest = None  # type: ignore[assignment]


if pytest is not None:

    class BundleItem(pytest.Item):
        """One bundle: replayed in ``setup`` (errors there: invalid, different failure), judged in ``runtest``."""

        def __init__(self, *, bundle: Path, code: Path | None, times: int, device: str | None, **kw: Any):
            super().__init__(**kw)
            self.bundle = bundle
            self.code = code
            self.times = times
            self.device = device
            self._still: StillFails | None = None
            self.add_marker(MARKER)

        def setup(self) -> None:
            # A different failure or a bundle that cannot run raise here, so pytest reports an error: reprokit's
            # message alone (it says what happened and what to do), not pytest's and pluggy's frames around it.
            try:
                assert_fixed(self.bundle, code=self.code, times=self.times, device=self.device)
            except StillFails as e:
                self._still = e
            except ReprokitError as e:
                pytest.fail(printable(f"{type(e).__name__}: {e}"), pytrace=False)

        def runtest(self) -> None:
            if self._still is not None:
                raise self._still

        def repr_failure(self, excinfo: Any, style: Any = None) -> str:
            if isinstance(excinfo.value, ReprokitError):
                return printable(str(excinfo.value))
            return str(super().repr_failure(excinfo))

        def reportinfo(self) -> tuple[Path, None, str]:
            return self.bundle, None, f"reprokit bundle {self.bundle.name}"

    def pytest_addoption(parser: Any) -> None:
        group = parser.getgroup("reprokit", "reprokit: bundles as regression tests")
        group.addoption("--reprokit-bundles", action="append", default=None, metavar="DIR",
                        help="Folder of bundles (folders, .tar or .tar.gz); each becomes a test that passes once the "
                             "failure no longer reproduces. Repeatable.")
        group.addoption("--reprokit-code", default=None, metavar="DIR",
                        help="Import build/step from this directory (your checkout) instead of each bundle's "
                             "own code snapshot.")
        group.addoption("--reprokit-times", type=int, default=None, metavar="N",
                        help="Replays per bundle (default 1); more catch failures that only sometimes recur.")
        group.addoption("--reprokit-device", default=None, choices=["cpu", "cuda"],
                        help="Where to replay (default: where each bundle was recorded, if available).")
        parser.addini("reprokit_bundles", "Folders of bundles to run as regression tests", type="paths", default=[])
        parser.addini("reprokit_code", "Directory to import build/step from", default="")
        parser.addini("reprokit_times", "Replays per bundle", default="1")

    def pytest_configure(config: Any) -> None:
        config.addinivalue_line("markers", f"{MARKER}: a reprokit bundle replayed as a regression test")

    def _folders(config: Any) -> list[Any]:
        """The bundle folders named on the command line, else in the ini file."""
        return list(config.getoption("--reprokit-bundles") or config.getini("reprokit_bundles"))

    def pytest_report_collectionfinish(config: Any, items: list[Any]) -> str | None:
        # pytest's "collected N items" counts what its collectors found; bundles join the items after that.
        folders = _folders(config)
        if not folders:
            return None
        n = sum(isinstance(i, BundleItem) for i in items)
        return f"reprokit: {n} bundle{'s' if n != 1 else ''} from {', '.join(map(str, folders))}, one test each"

    @pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so they apply to bundles too
    def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
        folders = [Path(p) for p in _folders(config)]
        if not folders:
            return
        code_opt = config.getoption("--reprokit-code") or config.getini("reprokit_code")
        code = (config.rootpath / code_opt).resolve() if code_opt else None  # absolute paths stay as they are
        times = config.getoption("--reprokit-times") or int(config.getini("reprokit_times"))
        device = config.getoption("--reprokit-device")
        try:
            found = [b for folder in folders for b in find_bundles(folder)]
        except ReprokitError as e:
            raise pytest.UsageError(str(e)) from None
        for bundle in found:
            # The bundle's own path names the item ("regressions/bundle-...::reprokit"), as a test file names its tests.
            where = bundle.resolve()
            rel = where.relative_to(config.rootpath) if where.is_relative_to(config.rootpath) else where
            items.append(BundleItem.from_parent(session, name=f"reprokit::{bundle.name}", path=where,
                                                nodeid=f"{rel.as_posix()}::reprokit", bundle=bundle,
                                                code=code, times=times, device=device))
