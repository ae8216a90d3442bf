"""How big is the packed extract of a GPT-2-124M failure, and does it replay with only torch, numpy, safetensors?

    python bench/extract_size.py                # GPT-2 124M on the CPU, batch 2 x 64 tokens
    python bench/extract_size.py --quick        # a tiny GPT (smoke run for the test suite)
    python bench/extract_size.py --json
    python bench/extract_size.py --save bench/results/extract_size-cpu-COMMIT.json

The model is bench/gpt.py's GPT-2 (same shapes, tied head, 124M parameters) with its attention
written out as a submodule the nanoGPT way, which masks padding keys with ``-inf``. The fault is
the classic fully masked row: step 3's batch holds a short document, left-padded, so the first
query positions of that row see only padding and softmax over a row of ``-inf`` is NaN. The
recorder catches the NaN loss and writes a bundle (model + AdamW state, two steps); the bench
shrinks it (steps, rows: what a user does first), runs ``reprokit extract`` on it, packs the
extract (``reprokit pack``), and replays the packed ``repro.py`` (and the one-op repro) in a
fresh interpreter whose import path holds only torch, numpy and safetensors (with --quick, a process
forked from one such ``python -S`` interpreter that imported torch: the same import path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))


import gpt  # noqa: E402

PAD = 0
"""Token id of the padding (its key positions are masked out)."""
FAIL_STEP = 3
"""The step whose batch holds the left-padded document."""
FULL = {**gpt.GPT2, "batch": 2, "seq": 64}
QUICK = {"layers": 2, "d": 64, "heads": 4, "vocab": 128, "ctx": 64, "batch": 2, "seq": 16}


class Attention(nn.Module):
    """Causal self-attention that also masks padding keys: a row with no key left is NaN (the fault)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.heads = heads

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~(causal & keep[:, None, None, :]), float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, keep):
        x = x + self.attn(self.ln1(x), keep)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class InlineBlock(gpt.Block):
    """gpt.py's Block (attention written inline, no submodule of its own), masking padding keys."""

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, 2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~(causal & keep[:, None, None, :]), float("-inf"))
        x = x + self.proj((F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(gpt.GPT):
    """bench/gpt.py's GPT-2, its blocks holding the padding-aware attention (a submodule, or inline)."""

    def __init__(self, layers: int, d: int, heads: int, vocab: int, ctx: int, inline: bool = False):
        super().__init__(0, d, heads, vocab, ctx)
        self.blocks = nn.ModuleList((InlineBlock if inline else Block)(d, heads) for _ in range(layers))

    def forward(self, idx):
        keep = idx != PAD
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x, keep)
        return self.head(self.ln_f(x))


def build(config):
    import reprokit

    torch.manual_seed(0)
    model = GPT(*(config[k] for k in ("layers", "d", "heads", "vocab", "ctx")), inline=config.get("inline", False))
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=6e-4))


def train_step(state, batch):
    logits = state.model(batch["idx"])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1), ignore_index=PAD)
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps):
    g = torch.Generator().manual_seed(1)
    for s in range(steps):
        seq = torch.randint(1, config["vocab"], (config["batch"], config["seq"] + 1), generator=g)
        if s == FAIL_STEP:
            seq[1, : config["seq"] // 4] = PAD  # a short document, left-padded
        yield {"idx": seq[:, :-1].clone(), "targets": seq[:, 1:].clone()}


def _bare(site: Path, tmp: Path, *argv: str, server=None) -> subprocess.CompletedProcess:
    """Run python -S with only ``site`` importable, from a folder holding nothing. ``server`` (--quick): a script
    runs forked from that ``python -S`` fork server (tests/rk_forked.py, started with the same ``PYTHONPATH``; torch
    imported once), which imports what a fresh ``python -S`` could and nothing more."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp)}
    cwd = tmp / "elsewhere"
    cwd.mkdir(exist_ok=True)
    if server is not None and argv[0] != "-c":
        return server.capture(list(argv[1:]), script=Path(argv[0]), cwd=cwd, env=env, replace_env=True, timeout=600)
    return subprocess.run([sys.executable, "-S", *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _parts(extract: Path) -> dict:
    """Bytes of the extract per top folder (state/: the module's weights; steps/: its inputs; code/; extract/: the
    one-op repro), from its manifest."""
    parts: dict = {}
    for rel, m in json.loads((extract / "manifest.json").read_text())["files"].items():
        top = rel.split("/")[0] if "/" in rel else "(top)"
        parts[top] = parts.get(top, 0) + int(m["size"])
    return dict(sorted(parts.items()))


def run(cfg: dict, tmp: Path, site: Path, server=None) -> dict:
    import reprokit
    from reprokit.bundle import open_bundle
    from reprokit.extract import extract
    from reprokit.pack import pack
    from reprokit.shrink import shrink

    times = {}
    t0 = time.perf_counter()
    rec = reprokit.Recorder(build(cfg), train_step, build=build, config=cfg, out_dir=tmp / "repros", snapshot_every=2)
    failure = None
    for b in batches(cfg, FAIL_STEP + 2):
        try:
            rec.step(b)
        except reprokit.TrainingFailure as e:
            failure = e
            break
    rec.close()
    if failure is None:
        raise SystemExit("the run did not fail")
    times["record_s"] = time.perf_counter() - t0
    bundle = rec.bundles[-1]

    t0 = time.perf_counter()
    shrunk = shrink(bundle, tmp / "shrunk", passes=("steps", "rows"))
    times["shrink_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ex = extract(open_bundle(shrunk.output), tmp / "extract")
    times["extract_s"] = time.perf_counter() - t0
    packed = tmp / "extract.tar.gz"
    pack(ex.output, packed)

    unpacked = tmp / "colleague"
    unpacked.mkdir()
    with tarfile.open(packed) as tf:
        tf.extractall(unpacked, filter="data")
    (top,) = list(unpacked.iterdir())
    probes = {m: _bare(site, tmp, "-c", f"import {m}").returncode != 0 for m in ("reprokit", "click", "git")}
    t0 = time.perf_counter()
    replay = _bare(site, tmp, str(top / "repro.py"), "--json", server=server)
    times["standalone_replay_s"] = time.perf_counter() - t0
    got = json.loads(replay.stdout) if replay.returncode == 1 and replay.stdout.startswith("{") else {}
    op = top / "bundle" / "extract" / "op_repro.py"
    one = _bare(site, tmp, str(op), server=server) if op.exists() else None
    return {
        "failure": str(failure).splitlines()[0],
        "bundle_bytes": _size(bundle), "shrunk_bytes": _size(shrunk.output), "extract_bytes": _size(ex.output),
        "packed_extract_bytes": packed.stat().st_size,
        "extract_parts_bytes": _parts(ex.output),
        "shrunk": {"before": shrunk.before, "after": shrunk.after},
        "extract": {"level": ex.level, "module": ex.module, "class": ex.cls, "phase": ex.phase, "op": ex.op,
                    "failure": ex.failure, "notes": ex.notes},
        "not_importable_in_replay_env": probes,
        "standalone_replay": {"exit": replay.returncode, "verdict": got.get("verdict"),
                              "exception_type": (got.get("failure") or {}).get("exception_type"),
                              "stderr_tail": replay.stderr[-400:] if not got else ""},
        "op_repro": None if one is None else {"exit": one.returncode, "last_line": one.stdout.strip().splitlines()[-1]
                                              if one.stdout.strip() else one.stderr[-400:]},
        "seconds": {k: round(v, 1) for k, v in times.items()},
    }


VARIANTS = {"attention module": False, "attention inline": True}
"""Attention as its own submodule (nanoGPT's layout), or written inline in the block (gpt.py's layout)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny GPT instead of GPT-2 124M (smoke run)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--save", type=Path, help="also write the results (with commit and device) to this JSON file")
    args = ap.parse_args()
    cfg = QUICK if args.quick else FULL
    variants = {}
    # Imported here, not at the top, and tests/ off the path again before recording: replays import this module from
    # the bundle's code snapshot, without tests/.
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    sys.path.insert(0, tests)
    from rk_forked import ForkedRuns
    from rk_testing import minimal_site

    sys.path.remove(tests)

    with contextlib.ExitStack() as stack:
        site = minimal_site(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="extract-size-site-"))) / "s")
        # --quick (a smoke run): the hand-off runs fork from one python -S server instead of a torch import each.
        server = stack.enter_context(ForkedRuns(env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}, bare=True)) \
            if args.quick else None
        for name, inline in VARIANTS.items():
            with tempfile.TemporaryDirectory(prefix="extract-size-") as tmp:
                variants[name] = run({**cfg, "inline": inline}, Path(tmp), site, server)
    for res in variants.values():
        res["fits_10MB"] = res["packed_extract_bytes"] <= 10_000_000
        res["replays_standalone"] = res["standalone_replay"]["exit"] == 1 and res["standalone_replay"]["verdict"] == \
            "deterministic" and all(res["not_importable_in_replay_env"].values())
    from io_bench import _commit  # bench/ is the script's folder
    commit = _commit()
    params = sum(p.numel() for p in GPT(*(cfg[k] for k in ("layers", "d", "heads", "vocab", "ctx"))).parameters())
    report = {"commit": commit, "device": f"cpu ({platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads)", "torch": torch.__version__, "config": cfg,
              "parameters": params, "variants": variants}
    if args.save:
        args.save.write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"reprokit extract size - GPT ({params / 1e6:.1f}M parameters), batch {cfg['batch']} x {cfg['seq']} tokens, "
          f"{report['device']}, torch {torch.__version__}, commit {commit}")
    for name, res in variants.items():
        _show(name, res)


def _show(name: str, res: dict) -> None:
    mb = 1e6
    print(f"\n[{name}] failure: {res['failure']}")
    e = res["extract"]
    print(f"extract ({e['level']}): module {e['module']} ({e['class']}), {e['phase']}, op {e['op']}; "
          f"alone: {e['failure']}")
    for note in e["notes"]:
        print(f"  note: {note}")
    for label, key in (("full bundle (folder)", "bundle_bytes"), ("shrunk bundle (folder)", "shrunk_bytes"),
                       ("extract (folder)", "extract_bytes"), ("packed extract (.tar.gz)", "packed_extract_bytes")):
        print(f"  {label:<28}{res[key] / mb:>12.2f} MB")
    print("  extract parts: " + ", ".join(f"{k} {v / mb:.2f} MB" for k, v in res["extract_parts_bytes"].items()))
    b, a = res["shrunk"]["before"], res["shrunk"]["after"]
    print(f"  shrink (steps, rows): {b['steps']} steps x {b['rows']} rows -> {a['steps']} x {a['rows']}")
    r = res["standalone_replay"]
    print(f"packed repro.py with only torch/numpy/safetensors: exit {r['exit']}, verdict {r['verdict']} "
          f"({r['exception_type']}); reprokit/click/git not importable there: {res['not_importable_in_replay_env']}")
    if res["op_repro"]:
        print(f"op_repro.py: exit {res['op_repro']['exit']}, {res['op_repro']['last_line']}")
    print("seconds: " + ", ".join(f"{k} {v}" for k, v in res["seconds"].items()))
    print(f"packed extract <= 10 MB: {res['fits_10MB']}; replays standalone: {res['replays_standalone']}")


if __name__ == "__main__":
    main()
