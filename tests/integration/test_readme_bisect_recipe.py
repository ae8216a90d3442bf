"""A newcomer's path through the docs' "Which commit broke it?" (docs/guide/bisect.md): a training script run as
``python train.py``, its bundle replayed against a checkout with the page's ``--entry`` and its ``git bisect run``
line."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import textwrap
from pathlib import Path

import git
import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import reprokit

    def build(config):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))

    def train_step(state, batch):
        x = torch.nan_to_num(batch["x"], posinf=0.0)  # FIX
        loss = ((state.model(x).squeeze(-1) - batch["y"]) ** 2).mean()
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        return loss

    if __name__ == "__main__":
        rec = reprokit.Recorder(build({}), train_step, build=build, config={}, out_dir=sys.argv[1], snapshot_every=4)
        g = torch.Generator().manual_seed(0)
        try:
            for step in range(8):
                x = torch.randn(4, 4, generator=g)
                if step == 6:
                    x[1, 2] = float("inf")
                rec.step({"x": x, "y": torch.randn(4, generator=g)})
        except reprokit.TrainingFailure as e:
            print(e.bundle)
            sys.exit(7)
''')
BUGGY = SCRIPT.replace('torch.nan_to_num(batch["x"], posinf=0.0)  # FIX', 'batch["x"]')


def _docs_bisect_block() -> str:
    text = (ROOT / "docs" / "guide" / "bisect.md").read_text()
    section = text[text.index("## Which commit broke it?"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def project(tmp_path_factory, fork_server):
    """A git repo: a good commit, then the commit that drops the fix, then an unrelated one; the bundle recorded by
    running the buggy script as `python train.py` (forked from the shared fork server: a process of its own without
    a torch import)."""
    tmp = tmp_path_factory.mktemp("newbie")
    repo_dir = tmp / "proj"
    repo_dir.mkdir()
    repo = git.Repo.init(repo_dir)
    actor = git.Actor("t", "t@example.com")
    shas = []
    for text, msg in [(SCRIPT, "good"), (BUGGY, "drop the fix"), (BUGGY + "# unrelated\n", "unrelated")]:
        (repo_dir / "train.py").write_text(text)
        repo.index.add(["train.py"])
        shas.append(repo.index.commit(msg, author=actor, committer=actor).hexsha)
    proc = fork_server.capture([tmp / "repros"], script=repo_dir / "train.py", cwd=repo_dir, timeout=120)
    assert proc.returncode == 7, proc.stderr
    return repo, shas, Path(proc.stdout.strip().splitlines()[-1]), fork_server


def _replay(bundle: Path, cwd: Path, fork_server, *args: str) -> subprocess.CompletedProcess:
    """``python -m reprokit replay BUNDLE --code . ARGS`` from ``cwd``, forked from the shared fork server."""
    return fork_server.reprokit("replay", bundle, "--code", ".", *args, cwd=cwd)


@pytest.mark.slow
def test_docs_entry_fits_a_script_and_a_module_form_entry_is_named_in_the_error(project):
    repo, _, bundle, fork_server = project
    cwd = Path(repo.working_tree_dir)
    entry = re.search(r"--entry (\S+)", _docs_bisect_block()).group(1)
    assert _replay(bundle, cwd, fork_server, "--entry", entry).returncode == 1
    # The mix-up a newcomer makes: the module form for a script's functions. The error says what was passed,
    # why it does not match and the --entry to pass.
    proc = _replay(bundle, cwd, fork_server, "--entry", "build=train:build,step=train:train_step")
    assert proc.returncode == 2, proc.stderr
    assert "you passed build = train:build, step = train:train_step" in proc.stderr
    assert "named by its file: train.py:build" in proc.stderr
    assert "then pass: --entry build=train.py:build,step=train.py:train_step" in proc.stderr


def _bisect(repo: git.Repo, shas: list[str], line: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cwd = repo.working_tree_dir
    subprocess.run(["git", "bisect", "start", shas[-1], shas[0]], cwd=cwd, check=True, capture_output=True)
    try:
        return subprocess.run(["sh", "-c", line], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    finally:
        subprocess.run(["git", "bisect", "reset"], cwd=cwd, check=True, capture_output=True)


@pytest.mark.slow
def test_docs_git_bisect_run_line_finds_the_commit_and_stops_on_a_usage_error(project):
    """The page's line as written, but for its ``reprokit``: ``python -m reprokit`` forked from the rank server
    (``rk_ranks.stand_in``: no torch import at each commit)."""
    from rk_ranks import stand_in

    repo, shas, bundle, _ = project
    python, env = stand_in({**os.environ, "PYTHONPATH": str(ROOT)})
    line = next(ln for ln in _docs_bisect_block().splitlines() if ln.startswith("git bisect run"))
    line = line.replace("/abs/path/to/BUNDLE", str(bundle)).replace("reprokit replay",
                                                                    f"{shlex.join(python)} -m reprokit replay")
    proc = _bisect(repo, shas, line, env)
    assert proc.returncode == 0 and f"{shas[1]} is the first bad commit" in proc.stdout, proc.stdout + proc.stderr
    # A wrong --entry exits 2, which plain `git bisect run` reads as bad: the docs' line stops instead of
    # naming a wrong commit.
    wrong = line.replace("build=train.py:build,step=train.py:train_step", "build=train:build,step=train:train_step")
    assert wrong != line
    proc = _bisect(repo, shas, wrong, env)
    assert proc.returncode != 0 and "is the first bad commit" not in proc.stdout, proc.stdout + proc.stderr
