"""``reprokit bisect commits``: the first commit at which the bundle fails, with the bundle as the test.

Each probe checks the commit out into a temporary ``git worktree`` (the user's
working tree, index, branch and stash are never touched) and replays the
bundle with ``python -m reprokit replay --code <worktree>`` run from there, in a
process of its own forked from a server that imported torch once and never
imports user code (:meth:`reprokit.isolation.IsolatedRunner.run_command`), so no
module state leaks between commits. Verdicts: same failure = bad, passes = good; the code
does not import, ``build`` fails, the state does not fit, a different failure
or a timeout = skip, with the reason (like ``git bisect run``'s exit 125).
The search follows ancestry, not one ordering of the range (see :func:`_search`), so
merges are bisected as ``git bisect`` does.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reprokit.bundle import Bundle, open_bundle
from reprokit.code import entry_args
from reprokit.errors import ReprokitError
from reprokit.isolation import IsolatedRunner
from reprokit.signature import summary_line

Progress = Callable[["Probe", int], None]


END_REPLAYS = 3
"""Replays of the bad end: it must fail the same way on each, since every other commit is judged on one."""


class BisectError(ReprokitError):
    """Bisection cannot start or cannot answer (a wrong end, an unknown revision)."""


@dataclass
class Probe:
    sha: str
    verdict: str  # bad | good | skip (| flaky: the bad end only)
    reason: str
    seconds: float
    role: str = "search"  # search | good end | bad end


@dataclass
class CommitBisectResult:
    first_bad: str | None
    candidates: list[str]
    probes: list[Probe]
    commits_in_range: int
    first_bad_info: dict[str, Any] | None = None
    skipped: list[str] = field(default_factory=list)

    @property
    def replays(self) -> int:
        return len(self.probes)

    def to_json(self) -> dict[str, Any]:
        return {"first_bad": self.first_bad, "candidates": self.candidates, "replays": self.replays,
                "commits_in_range": self.commits_in_range,
                "bound": math.ceil(math.log2(max(2, self.commits_in_range))) + 1,
                "first_bad_commit": self.first_bad_info, "skipped": self.skipped,
                "probes": [asdict(p) | {"seconds": round(p.seconds, 2)} for p in self.probes]}


NO_HOOKS = {"c": f"core.hooksPath={os.devnull}"}
"""``git -c core.hooksPath=/dev/null``: no repository hook (``post-checkout`` on ``worktree add``) runs while
reprokit bisects; git runs nothing but itself on the user's behalf."""


def _repo(path: Path | None) -> Any:
    """The repository to bisect: the one holding ``path`` (``--repo``), else the one holding the current folder.

    Never one a bundle names: its ``env.json`` is the sender's, and its hooks and code would run here."""
    try:
        import git
    except ImportError as e:  # pragma: no cover - gitpython is a dependency
        raise BisectError("commit bisection needs gitpython: pip install gitpython") from e
    where = path if path is not None else Path.cwd()
    try:
        r = git.Repo(where, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        hint = ("pass --repo PATH, the repository whose history to bisect" if path is not None else
                "run it from inside the repository whose history to bisect, or pass --repo PATH")
        raise BisectError(f"{where} is not inside a git repository; {hint}") from None
    if r.working_tree_dir is None:
        raise BisectError(f"{where} is a bare git repository; pass --repo PATH, a checkout of it")
    r.git.set_persistent_git_options(**NO_HOOKS)
    return r


def _resolve(repo: Any, rev: str, end: str, git_env: dict[str, Any]) -> str:
    try:
        return repo.commit(rev).hexsha
    except Exception:
        raise BisectError(f"--{end} {rev!r} is not a revision of {repo.working_tree_dir}; check --{end}, and that "
                          f"this is the repository to bisect{_elsewhere_note(repo, git_env)}") from None


def _elsewhere_note(repo: Any, git_env: dict[str, Any]) -> str:
    """Where the bundle says it was recorded, when the chosen repository lacks that commit: a hint that it is the
    wrong repository (shown, never used: the bundle's ``git.root`` is the sender's word)."""
    commit = git_env.get("commit")
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", commit):
        return ""
    try:
        repo.git.cat_file("-e", f"{commit}^{{commit}}")
        return ""
    except Exception:
        root = git_env.get("root")
        where = f" in {str(root)[:200]!r}" if isinstance(root, str) else ""
        return (f". The bundle says it was recorded{where} at commit {commit[:10]}, which {repo.working_tree_dir} "
                "does not have: if the history is elsewhere, run from inside that repository or pass --repo PATH "
                "(the bundle's recorded path is never used by itself)")


class _Prober:
    """Checks commits out into throwaway worktrees and replays the bundle against them."""

    def __init__(self, repo: Any, bundle: Bundle, subdir: str, timeout: float, device: str | None,
                 runner: IsolatedRunner | None = None):
        self.repo, self.bundle, self.subdir, self.timeout, self.device = repo, bundle, subdir, timeout, device
        self.cache: dict[str, Probe] = {}
        self.times = 1
        """Replays of the commit being probed (the bad end's are checked for flakiness)."""
        self.probes: list[Probe] = []
        self._runner = runner  # the caller's; else one of our own, started at the first replay
        self._own = runner is None

    def __enter__(self) -> _Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the fork server the replays ran from (if this bisection started one)."""
        if self._own and self._runner is not None:
            self._runner.close()
            self._runner = None

    def probe(self, sha: str, role: str = "search", times: int = 1) -> Probe:
        if sha in self.cache:
            return self.cache[sha]
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix="reprokit-bisect-"))
        tree = tmp / "tree"
        try:
            try:
                self.repo.git.worktree("add", "--detach", str(tree), sha)
            except Exception as e:
                raise BisectError(f"cannot check out {sha[:10]} into a temporary worktree: {e}") from None
            self.times = times
            verdict, reason = self._replay(tree / self.subdir)
        finally:
            # Also on Ctrl-C: never leave a worktree registered in the user's repository.
            try:
                self.repo.git.worktree("remove", "--force", str(tree))
            except Exception:
                pass
            self.repo.git.worktree("prune")
            shutil.rmtree(tmp, ignore_errors=True)
        p = Probe(sha, verdict, reason, time.perf_counter() - t0, role)
        self.cache[sha] = p
        self.probes.append(p)
        return p

    def _replay(self, code: Path) -> tuple[str, str]:
        if not code.is_dir():
            return "skip", f"the project folder {self.subdir!r} does not exist at this commit"
        args = ["replay", str(self.bundle.path.resolve()), "--code", str(code), *entry_args(self.bundle.run["refs"]),
                "--json", "--times", str(self.times)]
        if self.device:
            args += ["--device", self.device]
        if self._runner is None:
            self._runner = IsolatedRunner(empty_cwd=True)
        # Run from the checked-out tree: ``python -m`` puts the working directory first on sys.path, and the caller's
        # (their own checkout, with files this commit lacks, such as one never committed) would let a commit that does
        # not build import them and be judged on code it does not have. The fork server itself runs in an empty
        # folder and imports no user code, so nothing of one commit is there when the next one is probed.
        proc = self._runner.run_command(args, cwd=code, timeout=self.timeout)
        if proc.timed_out:
            return "skip", f"replay timed out after {self.timeout:g}s"
        err = proc.stderr
        # The CLI's own message ("Error: ...", possibly over several lines), else the last line printed.
        last = " ".join(err[err.index("Error: ") + 7:].split()) if "Error: " in err else \
            (err.strip().splitlines() or [""])[-1]
        try:
            d = json.loads(proc.stdout) if proc.stdout.strip() else {}
        except ValueError:
            d = {}
        # replay exits 1 reproduced, 0 passed, 125 different failure (or code that does not import).
        if proc.returncode in (0, 1, 125) and "verdict" in d:
            if d["verdict"] == "flaky":
                return "flaky", f"failed the same way in {d['failed_runs']} of {d['runs']} replays"
            if d["reproduced"]:
                return "bad", "same failure: " + _describe(d["failure"])
            if d["verdict"] == "different_failure":
                return "skip", (f"different failure: {_describe(d['failure'])} "
                                f"(recorded: {_describe(d['recorded_failure'])})")
            return "good", f"passed {d['per_run'][0]['steps_run']} steps"
        if "error" in d:
            last = " ".join(str(d["error"].get("message", "")).split()) or last
        if proc.returncode == 125:
            return "skip", last[:300]
        return "skip", f"replay exited {proc.returncode}: {last[:300]}"


def _describe(f: dict[str, Any] | None) -> str:
    return summary_line(f, frame=False)


def bisect_commits(bundle: str | Path | Bundle, *, good: str, bad: str, repo: str | Path | None = None,
                   first_parent: bool = False, timeout: float = 600.0, device: str | None = None,
                   progress: Progress | None = None, runner: IsolatedRunner | None = None) -> CommitBisectResult:
    """Find the first commit in ``good..bad`` at which the bundle fails the same way.

    Each commit's replay runs in a process forked from a fork server that imported torch (see the module
    docstring); the bisection starts one and stops it at the end. ``runner``: an
    ``IsolatedRunner(empty_cwd=True)`` of the caller's, whose server the probes of several bisections share (each
    probe is still a process of its own that starts from the server's clean state, with the environment the server
    was started with); the caller closes it.

    Raises:
        BisectError: when an end is wrong (bad passes, good fails) or a revision is unknown.

    Example:
        >>> r = bisect_commits("repros/bundle-...", good="v1.2", bad="HEAD")   # doctest: +SKIP
        >>> r.first_bad                                                          # doctest: +SKIP
    """
    if runner is not None and not runner.empty_cwd:
        raise ValueError("bisect_commits(runner=...) needs an IsolatedRunner(empty_cwd=True): a fork server in the "
                         "caller's folder could import the caller's files where a commit lacks them")
    b = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
    git_env = b.env.get("git") or {}
    # The bundle's git.root is where the sender's repository was: information, never the repository to run.
    r = _repo(Path(repo) if repo else None)
    subdir = git_env.get("code_subdir") or "."
    good_sha, bad_sha = _resolve(r, good, "good", git_env), _resolve(r, bad, "bad", git_env)
    if not r.is_ancestor(good_sha, bad_sha):
        raise BisectError(f"--good {good} is not an ancestor of --bad {bad}; swap them or pick another good end")
    commits, parents = _range(r, good_sha, bad_sha, first_parent)
    if not commits:
        raise BisectError(f"no commits between --good {good} and --bad {bad}")
    with _Prober(r, b, subdir, timeout, device, runner) as prober:

        def step(p: Probe) -> Probe:
            if progress:
                progress(p, len(commits))
            return p

        # Sanity checks first: the bad end must fail the same way and the good end must pass.
        end = step(prober.probe(bad_sha, "bad end", times=END_REPLAYS))
        if end.verdict == "flaky":
            raise BisectError(f"the bad end {bad} ({bad_sha[:10]}) {end.reason}: a failure that does not recur on "
                              "every replay would let a lucky pass call a bad commit good. Make it deterministic first "
                              "(`reprokit replay BUNDLE --times 5`; a random generator outside state.extra, or state "
                              "kept outside train_step, are the usual causes)")
        if end.verdict != "bad":
            raise BisectError(f"the bad end {bad} ({bad_sha[:10]}) does not fail the same way ({end.verdict}: "
                              f"{end.reason}); check --bad, or that this bundle reproduces at all"
                              f"{_dirty_note(git_env)}{_elsewhere_note(r, git_env)}")
        start = step(prober.probe(good_sha, "good end"))
        if start.verdict != "good":
            raise BisectError(f"the good end {good} ({good_sha[:10]}) does not pass ({start.verdict}: "
                              f"{start.reason}); pick an older --good")
        first, candidates, skipped = _search(commits, parents, lambda sha: step(prober.probe(sha)).verdict)
        return CommitBisectResult(first, candidates, prober.probes, len(commits),
                                  _info(r, first) if first else None, skipped)


def _range(repo: Any, good: str, bad: str, first_parent: bool) -> tuple[list[str], list[list[int]]]:
    """The commits of ``good..bad``, parents before children, and each one's parents (positions in that list;
    parents outside the range are ancestors of ``good``, known good, and left out)."""
    args = ["--parents", "--topo-order", "--reverse", *(["--first-parent"] if first_parent else []), f"{good}..{bad}"]
    rows = [line.split() for line in repo.git.rev_list(*args).splitlines() if line.strip()]
    pos = {row[0]: i for i, row in enumerate(rows)}
    return [row[0] for row in rows], [[pos[p] for p in row[1:2 if first_parent else None] if p in pos]
                                      for row in rows]


def _dirty_note(git_env: dict[str, Any]) -> str:
    """Why the bad end may pass: the bundle was recorded from uncommitted changes, which no commit holds."""
    if not git_env.get("dirty"):
        return ""
    changed = [line[6:] for line in str(git_env.get("diff") or "").splitlines() if line.startswith("+++ b/")]
    files = f" ({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''})" if changed else ""
    return (f". The bundle was recorded at {str(git_env.get('commit'))[:10]} with uncommitted changes{files}: no "
            "commit holds them, so if the bug is in them, commit them and pass that commit as --bad")


def _search(commits: list[str], parents: list[list[int]],
            verdict: Callable[[str], str]) -> tuple[str | None, list[str], list[str]]:
    """Bisect a range of history (the last commit known bad) as ``git bisect`` does, also across merges.

    Bad-ness is monotone along ancestry, not along any one ordering of a history with merges: a commit found good
    clears it and its ancestors, one found bad narrows the candidates to its ancestors. Each probe is the commit whose
    ancestors among the candidates are nearest half of them (on a linear history: the middle one). Returns the first
    bad commit (None when skipped commits leave it open), the candidates left, and the skipped commits.
    """
    anc: list[int] = []
    for i, ps in enumerate(parents):  # parents come first: their ancestor sets are ready
        mask = 1 << i
        for p in ps:
            mask |= anc[p]
        anc.append(mask)
    bad = len(commits) - 1
    cands, skipped = anc[bad], 0
    while True:
        open_ = [i for i in range(len(commits)) if cands >> i & 1 and not skipped >> i & 1 and i != bad]
        if not open_:
            break
        total = cands.bit_count()
        mid = min(open_, key=lambda i: (abs(2 * (anc[i] & cands).bit_count() - total), (anc[i] & cands).bit_count(), i))
        v = verdict(commits[mid])
        if v == "bad":
            bad, cands = mid, cands & anc[mid]
        elif v == "good":
            cands &= ~anc[mid]
        else:
            skipped |= 1 << mid
    left = [commits[i] for i in range(len(commits)) if cands >> i & 1]
    return (commits[bad] if len(left) == 1 else None), left, [commits[i] for i in range(len(commits))
                                                                if skipped >> i & 1]


def _info(repo: Any, sha: str) -> dict[str, Any]:
    c = repo.commit(sha)
    return {"sha": c.hexsha, "subject": c.summary, "author": f"{c.author.name} <{c.author.email}>",
            "date": c.authored_datetime.isoformat(), "files": sorted(c.stats.files)}
