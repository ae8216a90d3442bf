"""A user's script run as __main__ inside a git repository, recorded and replayed from elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import git
import pytest
from rk_testing import cli_process

ROOT = Path(__file__).resolve().parents[2]

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
def test_script_in_a_dirty_git_repo(tmp_path):
    repo_dir = tmp_path / "proj"
    repo_dir.mkdir()
    (repo_dir / "helpers.py").write_text(HELPERS)
    (repo_dir / "train.py").write_text(SCRIPT)
    repo = git.Repo.init(repo_dir)
    repo.index.add(["helpers.py", "train.py"])
    actor = git.Actor("t", "t@example.com")
    commit = repo.index.commit("initial", author=actor, committer=actor)
    (repo_dir / "train.py").write_text(SCRIPT.replace("lr=config[\"lr\"]", "lr=config[\"lr\"] * 1"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "train.py", str(tmp_path / "repros")], cwd=repo_dir, env=env,
                          capture_output=True, text=True, timeout=300)
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
    proc = cli_process("replay", bundle, "--json", env=env)
    assert proc.returncode == 1, proc.stderr
    d = json.loads(proc.stdout)
    assert d["failure"]["step"] == 17 and d["fidelity"]["bit_exact"]
