"""Regenerate examples/README.md: run every zoo example and the commands that diagnose it, paste the real output.

    PYTHONPATH=. python examples/tools/make_readme.py            # rewrites examples/README.md
    PYTHONPATH=. python examples/tools/make_readme.py --only oov_token --stdout

Not an example itself (examples/*.py are; this lives one folder down). Runs each script with
--quick, in a scratch folder, then each command through `python -m reprokit`; absolute scratch
paths are shown relative to it. Long tables are cut in the middle, and the cut is marked.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ROOT = HERE.parent
KEEP = 16  # most output lines shown per command

# script, the commands after recording ({b}: the bundle), the diagnosis
CASES: list[tuple[str, list[str], str]] = [
    ("fp16_overflow.py", ["replay {b} --times 3", "shrink {b} -o small --passes steps,rows",
                          "bisect precision small --variants recorded,fp32,bf16,fp16", "pack small -o repro.tar.gz",
                          "replay repro.tar.gz"],
     "The failure is the number format, not the model or the data: fp32 and bf16 pass the same step from the "
     "same state. Train in bf16, or keep targets in a range fp16 can hold (normalise them), and use a GradScaler "
     "for fp16's small end."),
    ("bad_batch.py", ["replay {b} --times 3", "shrink {b} -o small --passes steps,rows", "pack small -o repro.tar.gz",
                      "replay repro.tar.gz"],
     "One step, one sample: its labels are all -100, so the mean over labelled tokens is 0/0. The shrunk bundle "
     "names the sample's dataset index (from the batch's `index` leaf). Fix: divide the summed loss by "
     "max(1, labelled tokens), or drop such samples in the loader (tests/integration/test_testing_plugin.py "
     "replays this bundle against the fix)."),
    ("oov_token.py", ["replay {b} --times 3", "shrink {b} -o small", "bisect layers small",
                      "pack small -o repro.tar.gz", "replay repro.tar.gz"],
     "One row, one position, one token: id 65 into an embedding of 64 rows (`tok`). Resize the embeddings "
     "after adding special tokens (`model.resize_token_embeddings`) or fix the tokenizer."),
    ("long_sample.py", ["replay {b} --times 3", "shrink {b} -o small --passes steps,rows,sequence",
                        "bisect layers small", "pack small -o repro.tar.gz", "replay repro.tar.gz"],
     "The shrunk case is one row cut to 33 positions: the position table (`pos`) has 32. The shortest failing "
     "length is the table size + 1, so the cause is length, not content (any row of that batch fails: it is "
     "padded to its longest document, 40). Truncate or chunk documents to the model's context in the data "
     "pipeline."),
    ("empty_document.py", ["replay {b} --times 3", "shrink {b} -o small --passes steps,rows", "bisect layers small"],
     "Shrinking keeps row 3 and its dataset index: its mask is all zeros. The origin is the division in the step "
     "function (0/0 in that row only). Clamp the denominator (`m.sum(1).clamp(min=1)`) or drop empty documents."),
    ("collate_dtype.py", ["replay {b} --times 3", "shrink {b} -o small --passes steps,rows", "inspect small"],
     "Any single row fails, and only in the ragged last batch: the batch's dtype is the bug, not a sample. "
     "`inspect` shows `y` as int32. Make the collate function produce one dtype on every path."),
    ("lr_no_warmup.py", ["replay {b} --times 3", "bisect steps {b}"],
     "The loss swung wider and the gradient norm multiplied by 3 or more each step, several steps before the NaN, "
     "at a constant LR of 0.055 from the first step. Restore the warmup (`warmup: 100` trains this model for 1500 "
     "steps without trouble) or lower the LR."),
    ("naive_softmax.py", ["replay {b} --times 3", "bisect layers {b}", "extract {b} -o cut"],
     "The first non-finite value is made inside `blocks.0.softmax` (a NaiveSoftmax): `exp` overflows on a score "
     "past 88.7 and the division makes inf / inf = NaN. The causal mask's -inf in its input is not the cause (exp "
     "turns it into 0 in every step). Subtract the row max before `exp`, or use `torch.softmax`."),
    ("nondeterministic.py", ["replay {b} --times 3"],
     "The recorded run failed; three replays from the same state and batches did not (or not at the same step). "
     "That is information, not a fix: the failure is not a function of the code, the data or the recorded "
     "state. Suspect the hardware, or a source of randomness the recorder cannot see."),
    ("shuffled_labels.py", ["replay {b} --times 3", "bisect steps {b}"],
     "No step is bad until the predicate fires: no exploding gradient, no spike, a loss flat at ln 4 = 1.39 "
     "and ordinary gradient norms. An optimizer problem would show in the gradients; this is the data. "
     "Shuffle inputs and labels with one permutation."),
    ("lr_x100.py", ["replay {b} --times 3", "bisect steps {b}"],
     "The LR column jumps from 0.001 to 0.1 at step 60; the gradient norm explodes two steps later and the "
     "loss spikes at 64: the schedule, not the data."),
    ("missing_zero_grad.py", ["replay {b} --times 3", "bisect steps {b}"],
     "The gradient norm climbs at nearly every step (gradients are summed, never cleared) until it explodes. "
     "Call `optimizer.zero_grad()` after each step."),
    ("sum_reduction.py", ["replay {b} --times 3", "bisect steps {b}"],
     "At step 40 the batch grows from 16 to 256 rows: the summed loss and the gradient norm jump by about that "
     "factor while the LR stays put. Use `reduction='mean'` (or scale the LR with the batch)."),
    ("autocast_no_scaler.py", ["replay {b} --times 3", "bisect precision {b} --variants recorded,fp32,bf16,fp16"],
     "fp32 and bf16 pass, fp16 fails: gradients below fp16's smallest value vanish. Use "
     "`torch.amp.GradScaler` with fp16 autocast, or bf16."),
]


def run(cmd: list[str], cwd: Path) -> tuple[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REPROKIT_REPLAY_TRUST": "1"}
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return (p.stdout + p.stderr).replace(str(cwd) + "/", "").rstrip(), p.returncode


def cut(text: str) -> str:
    lines = text.splitlines()
    if len(lines) <= KEEP:
        return text
    return "\n".join([*lines[:3], f"... ({len(lines) - KEEP} lines cut)", *lines[-(KEEP - 3):]])


def section(script: str, commands: list[str], diagnosis: str, scratch: Path) -> str:
    doc = ast.get_docstring(ast.parse((HERE / script).read_text())) or ""
    title, _, rest = doc.partition("\n\n")
    symptom = rest.split("\n\n")[0].replace("\n", " ")
    work = scratch / script[:-3]
    work.mkdir()
    out, code = run([sys.executable, str(HERE / script), "--quick", "--out", "repros"], work)
    transcript = [f"$ python examples/{script} --quick --out repros", out]
    bundle = next((work / "repros").glob("bundle-*")).relative_to(work)
    for c in commands:
        c = c.format(b=bundle)
        out, code = run([sys.executable, "-m", "reprokit", *c.split()], work)
        transcript += [f"$ reprokit {c}", cut(out) + (f"\n(exit {code})" if code else "")]
    body = "\n".join(transcript)
    return (f"## {script[:-3]}: {title}\n\n**Symptom.** {symptom}\n\n```console\n{body}\n```\n\n"
            f"**Diagnosis.** {diagnosis}\n")


HEADER = """# The failure zoo

Fourteen small training programs (CPU, seeded, seconds each), one per class of
training failure that reprokit exists for (see the table in the main README). Each
trains until it fails under a `reprokit.Recorder`, and the commands after it are
the ones that diagnose it. `tinylm.py` holds what they share: a tiny decoder-only
transformer LM, an MLP and the recording loop.

Everything below is real output, regenerated by `examples/tools/make_readme.py`
(bundle names carry the time they were written; long tables are cut in the middle,
marked). `tests/integration/test_zoo.py` runs the same journeys and asserts each
diagnosis. Run any example yourself, from the repository root:

```bash
python examples/oov_token.py --quick --out repros   # seconds
python examples/oov_token.py --out repros           # a longer run, same story: minutes on a CPU, silent until it fails
```
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="one example (name without .py)")
    ap.add_argument("--stdout", action="store_true", help="print instead of writing examples/README.md")
    args = ap.parse_args()
    cases = [c for c in CASES if args.only is None or c[0] == f"{args.only}.py"]
    with tempfile.TemporaryDirectory(prefix="reprokit-zoo-") as tmp:
        sections = [section(s, cmds, diag, Path(tmp)) for s, cmds, diag in cases]
    text = HEADER + "\n" + "\n".join(sections)
    if args.stdout:
        print(text)
    else:
        (HERE / "README.md").write_text(text)
        print(f"wrote {HERE / 'README.md'} ({len(sections)} examples)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
