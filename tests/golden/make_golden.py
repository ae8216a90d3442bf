"""Regenerate a golden bundle for the current format version (run by hand, never by the tests).

    python tests/golden/make_golden.py

Golden bundles of every past version stay in the repository unchanged: readers
must keep opening them (through the upgrade functions in reprokit/bundle/reader.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from reprokit import Recorder, TrainingFailure, demo
from reprokit.bundle import VERSION

CONFIG = {**demo.DEFAULT_CONFIG, "samples": 512, "batch_size": 16, "hidden": 8, "poison_step": 6}


def main() -> None:
    target = Path(__file__).parent / f"v{VERSION}" / "demo-nan"
    with tempfile.TemporaryDirectory() as tmp:
        state = demo.build(CONFIG)
        rec = Recorder(state, demo.train_step, build=demo.build, config=CONFIG, out_dir=tmp, snapshot_every=4)
        try:
            for batch in demo.batches(CONFIG):
                rec.step(batch)
        except TrainingFailure as e:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(e.bundle, target)
            print(f"wrote {target}")
            return
    raise SystemExit("the golden run did not fail")


if __name__ == "__main__":
    main()
