"""A user's script run as __main__ inside a git repository, recorded and replayed from elsewhere.

The script and the replay run as processes of their own forked from one server that imported torch and nothing of
the script (the ``fork_server`` fixture, tests/rk_forked.py)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import git
import pytest

HELPERS = textwrap.dedent('''
    import torch

    def make_data(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 4, generator=g)
        if step == 17:
            x[0, 0] = float("inf")
        return {"x": x, "y": x.sum(-1)}
''')

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import reprokit
    from helpers import make_data

    def build(config):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        return reprokit.TrainState(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=config["lr"]))

    def train_step(state, batch):
        loss = torch.nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        return loss

    if __name__ == "__main__":
        cfg = {"lr": 0.01}
        rec = reprokit.Recorder(build(cfg), train_step, build=build, config=cfg, out_dir=sys.argv[1],
                                snapshot_every=10)
        try:
            for step in range(30):
                rec.step(make_data(step))
        except reprokit.TrainingFailure as e:
            print(e.bundle)
            sys.exit(7)
''')


@pytest.mark.slow
def test_script_in_a_dirty_git_repo(tmp_path, fork_server):
    repo_dir = tmp_path / "proj"
    repo_dir.mkdir()
    (repo_dir / "helpers.py").write_text(HELPERS)
    (repo_dir / "train.py").write_text(SCRIPT)
    repo = git.Repo.init(repo_dir)
    repo.index.add(["helpers.py", "train.py"])
    actor = git.Actor("t", "t@example.com")
    commit = repo.index.commit("initial", author=actor, committer=actor)
    (repo_dir / "train.py").write_text(SCRIPT.replace("lr=config[\"lr\"]", "lr=config[\"lr\"] * 1"))
    proc = fork_server.capture([tmp_path / "repros"], script=repo_dir / "train.py", cwd=repo_dir, timeout=300)
    assert proc.returncode == 7, proc.stderr
    bundle = Path(proc.stdout.strip().splitlines()[-1])
    assert sorted(p.name for p in (bundle / "code").iterdir()) == ["helpers.py", "train.py"]
    run = json.loads((bundle / "run.json").read_text())
    assert run["refs"]["build"] == {"script": "train.py", "qualname": "build"}
    gitinfo = json.loads((bundle / "env.json").read_text())["git"]
    assert gitinfo["commit"] == commit.hexsha and gitinfo["dirty"] is True
    assert '* 1' in gitinfo["diff"]

    # Replay from an unrelated directory, with the repo moved out of the way.
    (repo_dir / "helpers.py").unlink()
    proc = fork_server.reprokit("replay", bundle, "--json", cwd="/")
    assert proc.returncode == 1, proc.stderr
    d = json.loads(proc.stdout)
    assert d["failure"]["step"] == 17 and d["fidelity"]["bit_exact"]
