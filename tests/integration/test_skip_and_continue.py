"""``Recorder(on_failure="skip")`` on real tiny loops: poisoned samples are skipped and the run ends where a run that
never held them ends, bit for bit; a failure with no culprit rows (an LR bug), a flaky or a transient one stops the
run with its bundle and the reason; the limits and the budget stop it too.

The "clean" run a skipping run is compared with trains on the same batches in the same order with the poisoned rows
left out of them (a batch one row shorter at each poisoned step): what "the data never held those samples" means for
a loop that draws batches by position, and what a skip does to the one batch it is in.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

import reprokit
from reprokit.cli import main
from reprokit.errors import ReprokitError
from reprokit.skip_journal import JOURNAL, read_journal

STEPS = 160
POISON_STEPS = (40, 130)


def poisoned(rk):
    """Dataset indices of the two poisoned samples: row 3 of step 40's batch and row 5 of step 130's."""
    return [POISON_STEPS[0] * rk.BATCH + 3, POISON_STEPS[1] * rk.BATCH + 5]


def train(rk, config, batches, out_dir, step=None, **options):
    """Train under a Recorder; the state, the recorder and the warnings it gave."""
    state = rk.build(config)
    rec = reprokit.Recorder(state, step or rk.train_step, build=rk.build, config=config, out_dir=out_dir,
                            snapshot_every=25, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in batches:
            rec.step(b)
    rec.close()
    return state, [str(w.message) for w in caught if issubclass(w.category, reprokit.RecorderWarning)]


def train_plain(rk, config, batches):
    """The same loop with no Recorder at all."""
    state = rk.build(config)
    for b in batches:
        rk.train_step(state, b)
    return state


def assert_same_state(a, b):
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for k, st in sa["state"].items():
        for name, v in st.items():
            assert torch.equal(v, sb["state"][k][name]), (k, name)
    assert a.scheduler.state_dict() == b.scheduler.state_dict()


@pytest.mark.slow
def test_two_poisoned_samples_are_skipped_and_the_run_ends_as_one_that_never_held_them(projects, tmp_path):
    rk = projects("rk_skip")
    bad = poisoned(rk)
    data = rk.dataset(STEPS * rk.BATCH, bad)
    torch.manual_seed(1234)  # dropout draws from the global generator: both runs start it alike
    skipping, said = train(rk, {}, rk.batches(data, STEPS), tmp_path / "repros", on_failure="skip")
    rng_after_skipping = torch.get_rng_state()
    torch.manual_seed(1234)
    clean = train_plain(rk, {}, rk.batches(data, STEPS, drop=set(bad)))
    assert_same_state(skipping, clean)
    assert torch.equal(rng_after_skipping, torch.get_rng_state())

    entries = read_journal(tmp_path / "repros")
    assert [(e["step"], e["rows"], e["dataset_indices"]) for e in entries] == [(40, [3], [bad[0]]), (130, [5], [bad[1]])]
    for e in entries:
        ev = e["evidence"]
        assert ev["without_culprits"]["verdict"] == "passed" and ev["only_culprits"]["verdict"] == "same failure"
        assert ev["state_check"]["verdict"] == "data" and ev["window"]["replayed_bit_exact"] is True
        assert e["failure"]["kind"] == "nonfinite_loss" and e["seconds_lost"] > 0
        assert (tmp_path / "repros" / e["bundle"].rsplit("/", 1)[-1] / "manifest.json").exists()
    skip_warnings = [s for s in said if "skipped dataset indices" in s]
    assert len(skip_warnings) == 2 and str(bad[0]) in skip_warnings[0] and str(bad[1]) in skip_warnings[1]
    assert reprokit.skip_list(tmp_path / "repros") == sorted(bad)

    # A run resumed with the journal's indices drops those rows itself, never fails, and ends the same way.
    torch.manual_seed(1234)
    resumed, _ = train(rk, {}, rk.batches(data, STEPS), tmp_path / "resumed",
                       skip_indices=reprokit.skip_list(tmp_path / "repros"))
    assert_same_state(resumed, clean)
    assert not (tmp_path / "resumed" / JOURNAL).exists()

    out = CliRunner().invoke(main, ["inspect", str(tmp_path / "repros")])
    assert out.exit_code == 0, out.output
    assert "2 skips in" in out.output and f"dataset indices [{bad[0]}]" in out.output
    assert f"(reprokit.skip_list): {sorted(bad)}" in out.output
    d = json.loads(CliRunner().invoke(main, ["inspect", str(tmp_path / "repros" / JOURNAL), "--json"]).output)
    assert d["count"] == 2 and d["dataset_indices"] == sorted(bad)


def test_two_bad_rows_in_one_batch_are_both_skipped(projects, tmp_path):
    rk = projects("rk_skip")
    bad = [9 * rk.BATCH + 1, 9 * rk.BATCH + 6]
    data = rk.dataset(20 * rk.BATCH, bad)
    torch.manual_seed(7)
    skipping, _ = train(rk, {}, rk.batches(data, 20), tmp_path / "repros", on_failure="skip")
    torch.manual_seed(7)
    assert_same_state(skipping, train_plain(rk, {}, rk.batches(data, 20, drop=set(bad))))
    (entry,) = read_journal(tmp_path / "repros")
    assert entry["rows"] == [1, 6] and entry["dataset_indices"] == bad


def test_a_token_id_past_the_vocabulary_is_skipped_though_the_step_raised(projects, tmp_path):
    rk = projects("rk_skip")
    bad = 17 * rk.BATCH + 5
    state = rk.build_lm({})
    rec = reprokit.Recorder(state, rk.lm_step, build=rk.build_lm, config={}, out_dir=tmp_path, snapshot_every=10,
                            on_failure="skip")
    said = rf"step 17 failed \(IndexError in rk_skip.py:lm_step .*skipped dataset indices \[{bad}\]"
    with pytest.warns(reprokit.RecorderWarning, match=said):
        for b in rk.lm_batches(30, bad_step=17):
            rec.step(b)
    rec.close()
    clean = rk.build_lm({})
    for b in rk.lm_batches(30, drop={bad}):
        rk.lm_step(clean, b)
    assert all(torch.equal(a, b) for a, b in zip(state.model.state_dict().values(), clean.model.state_dict().values()))
    (entry,) = read_journal(tmp_path)
    assert entry["failure"]["exception_type"] == "IndexError" and entry["dataset_indices"] == [bad]


def fails_with(rk, config, step, tmp_path, steps=40, bad=(), **options):
    """Train until the Recorder raises; the error and its notes."""
    data = rk.dataset(steps * rk.BATCH, bad)
    with pytest.raises(Exception) as info:
        train(rk, config, rk.batches(data, steps), tmp_path / "repros", step=step, on_failure="skip", **options)
    return info.value, "\n".join(getattr(info.value, "__notes__", []))


def test_a_nan_from_the_learning_rate_stops_with_the_bundle_and_the_reason(projects, tmp_path):
    rk = projects("rk_skip")
    exc, notes = fails_with(rk, {"jump_at": 25}, None, tmp_path)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.bundle is not None and exc.bundle.exists()
    assert "did not skip step 26 (state): no rows to blame: the state fails on any data" in notes
    assert not (tmp_path / "repros" / JOURNAL).exists()


def test_a_flaky_failure_is_not_skipped(projects, tmp_path):
    rk = projects("rk_skip")
    rk._calls["n"] = 0
    exc, notes = fails_with(rk, {}, rk.flaky_step, tmp_path)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == rk.FLAKY_STEP
    assert f"did not skip step {rk.FLAKY_STEP} (flaky): step {rk.FLAKY_STEP} failed the same way on one replay " \
           "but not on the next (it passed)" in notes
    assert not (tmp_path / "repros" / JOURNAL).exists()


def test_a_failure_that_does_not_recur_on_replay_is_not_skipped(projects, tmp_path):
    import reprokit.inject as inject

    rk = projects("rk_skip")
    once = inject.FaultInjector("transient_nan", steps=[17])
    exc, notes = fails_with(rk, {}, once.wrap(rk.train_step), tmp_path)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 17
    assert "did not skip step 17 (not_reproduced): replayed from the snapshot, step 17 did not fail the same way: " \
           "it passed" in notes


def test_max_skips_within_skip_window_stops_the_next_failure(projects, tmp_path):
    rk = projects("rk_skip")
    bad = [10 * rk.BATCH + 2, 30 * rk.BATCH + 4]
    exc, notes = fails_with(rk, {}, None, tmp_path, bad=bad, max_skips=1, skip_window=50)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 30
    assert "did not skip step 30 (limit): max_skips=1 skips within skip_window=50 steps are used up (steps [10])" in notes
    assert [e["step"] for e in read_journal(tmp_path / "repros")] == [10]


def test_an_attempt_past_its_budget_stops_the_run(projects, tmp_path):
    rk = projects("rk_skip")
    exc, notes = fails_with(rk, {}, None, tmp_path, bad=[10 * rk.BATCH + 2], skip_budget_s=1e-9)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.failure.step == 10
    assert "did not skip step 10 (budget): the replays took longer than skip_budget_s=1e-09 s" in notes


def test_on_failure_raise_is_the_default_and_writes_no_journal(projects, tmp_path):
    rk = projects("rk_skip")
    data = rk.dataset(20 * rk.BATCH, [10 * rk.BATCH])
    with pytest.raises(reprokit.TrainingFailure) as info:
        train(rk, {}, rk.batches(data, 20), tmp_path / "repros")
    assert info.value.failure.step == 10
    assert not any("did not skip" in n for n in getattr(info.value, "__notes__", []))
    assert not (tmp_path / "repros" / JOURNAL).exists()


def test_the_journal_skips_a_line_cut_short_and_refuses_an_edited_one(projects, tmp_path):
    rk = projects("rk_skip")
    bad = [10 * rk.BATCH + 2]
    data = rk.dataset(12 * rk.BATCH, bad)
    train(rk, {}, rk.batches(data, 12), tmp_path / "repros", on_failure="skip")
    journal = tmp_path / "repros" / JOURNAL
    whole = journal.read_text()
    journal.write_text(whole + '{"format": "reprokit-skip", "step": 99, "datas')  # a write cut short by a crash
    assert reprokit.skip_list(tmp_path / "repros") == bad
    journal.write_text(whole + "not json\n")
    with pytest.raises(ReprokitError, match=r"skips.jsonl:2 is not a reprokit skip entry"):
        reprokit.skip_list(tmp_path / "repros")
    assert reprokit.skip_list(tmp_path / "nowhere") == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_on_the_gpu_a_poisoned_sample_is_skipped_and_the_run_ends_as_one_that_never_held_it(projects, tmp_path):
    # The window's CUDA batches come back from their pinned host copies to the GPU; dropout draws from the CUDA
    # generator, restored per step.
    rk = projects("rk_skip")
    cfg = {"device": "cuda"}
    bad = [30 * rk.BATCH + 2]
    data = rk.dataset(60 * rk.BATCH, bad)
    torch.manual_seed(5)
    skipping, _ = train(rk, cfg, rk.batches(data, 60, device="cuda"), tmp_path / "repros", on_failure="skip")
    torch.manual_seed(5)
    clean = train_plain(rk, cfg, rk.batches(data, 60, drop=set(bad), device="cuda"))
    assert_same_state(skipping, clean)
    (entry,) = read_journal(tmp_path / "repros")
    assert entry["dataset_indices"] == bad and entry["evidence"]["window"]["replayed_bit_exact"] is True
