"""A bundle never chooses what code runs: not through an integration's config (the class a Lightning or Hugging
Face build imports), nor by a snapshot file named like an installed package that replay would import in its place.

Each hostile bundle is a real recorded one, edited and re-sealed as a sender would (checksums cannot catch it).
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from rk_testing import bundle_of, cli, entries, reseal

from reprokit import bundle as B
from reprokit.errors import BundleError


def plant(bundle: Path, files: dict[str, str], edit_run=None) -> None:
    """Add ``files`` to the bundle, edit its run.json, and re-seal the manifest over all of it."""
    for rel, text in files.items():
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_text(text)
    if edit_run is not None:
        run = json.loads((bundle / B.RUN).read_text())
        edit_run(run)
        (bundle / B.RUN).write_text(json.dumps(run))
    reseal(bundle, lambda m: m["files"].update(
        {rel: {"sha256": B.sha256_file(bundle / rel), "size": (bundle / rel).stat().st_size} for rel in files}))
    assert B.verify(bundle) == []


def side_effect(marker: Path, body: str) -> str:
    """Module source whose top-level code leaves ``marker``: it exists once the module was imported."""
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n{body}"


# --- F1: the class an integration's build imports comes from refs.objects, never from the config alone -----------

def _lightning_bundle(projects, tmp_path) -> Path:
    from reprokit.integrations.lightning import ReprokitCallback

    L = projects("rk_lightning")
    cb = ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=3)
    with pytest.raises(Exception) as info:
        L.trainer([cb]).fit(L.TinyLit(), L.loader(L.Tokens(oov=21), 4))
    return bundle_of(info.value)


@pytest.mark.slow
# Lightning's own warnings (a DataLoader without workers, its pytree shim on torch 2.13): not reprokit's. On this test
# alone: a filter naming Lightning's warning class imports Lightning (seconds) for every test it applies to.
@pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
@pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning")
def test_a_lightning_config_cannot_pick_a_module_of_the_snapshot_or_of_the_users_checkout(projects, tmp_path):
    """config.module naming a module refs.objects does not list (``deploy``, with import-time effects) is refused
    (exit 3) before anything is imported: from the bundle's snapshot, and from a --code checkout whose --entry
    confirms only the recorded LightningModule. It used to be imported first (its code ran), then refused (125)."""
    bundle = _lightning_bundle(projects, tmp_path)
    run = json.loads((bundle / B.RUN).read_text())
    assert run["config"]["module"] == {"module": "rk_lightning", "qualname": "TinyLit"} == run["refs"]["objects"][0]
    marker = tmp_path / "DEPLOY_RAN"
    deploy = side_effect(marker, "def main():\n    pass\n")
    plant(bundle, {"code/deploy.py": deploy},
          lambda r: r["config"].__setitem__("module", {"module": "deploy", "qualname": "main"}))

    r = cli("replay", str(bundle))
    assert not marker.exists(), "deploy.py of the snapshot was imported"
    assert r.exit_code == 3, r.output
    assert "config.module = deploy:main is not among the classes the bundle lists under refs.objects " \
           "(rk_lightning:TinyLit)" in r.output

    checkout = Path(shutil.copytree(bundle / "code", tmp_path / "checkout"))
    assert entries(bundle) == ["--entry", "object=rk_lightning:TinyLit"]
    r = cli("replay", str(bundle), "--code", str(checkout), *entries(bundle))
    assert not marker.exists(), "deploy.py of the user's checkout was imported"
    assert r.exit_code == 3, r.output
    assert "config.module = deploy:main is not among" in r.output

    # Listing it under refs.objects too makes it an entry point the user must confirm (exit 2), still unimported.
    plant(bundle, {}, lambda r: r["refs"]["objects"].append({"module": "deploy", "qualname": "main"}))
    r = cli("replay", str(bundle), "--code", str(checkout), "--entry", "object=rk_lightning:TinyLit")
    assert not marker.exists()
    assert r.exit_code == 2 and "not confirmed with --entry: object = deploy:main" in r.output, r.output


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\).*:FutureWarning")
def test_a_transformers_config_cannot_pick_a_module_refs_objects_does_not_list(projects, tmp_path):
    """The Hugging Face build imports the project's model class named in config.model.class: one that refs.objects
    does not list is refused (exit 3) before its module is imported (it used to run, then fail the subclass check)."""
    import rk_hf_guard  # noqa: F401 - skips where transformers has no torch half
    from rk_hf_data import SEQ, VOCAB, D, Embeds
    from transformers import GPT2Config, TrainingArguments

    from reprokit import TrainingFailure
    from reprokit.integrations.transformers import ReprokitCallback

    own = projects("rk_hf_model")
    torch.manual_seed(0)
    model = own.ScaledGPT2(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, max_steps=6, seed=3,
                             report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True, use_cpu=True,
                             remove_unused_columns=False)  # the model takes inputs_embeds through **kwargs
    trainer = own.MaskedMeanTrainer(model=model, args=args, train_dataset=Embeds(6, bad=3),
                                    callbacks=[ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=4)])
    with pytest.raises(TrainingFailure) as info:
        trainer.train()
    bundle = info.value.bundle
    run = json.loads((bundle / B.RUN).read_text())
    assert {"module": "rk_hf_model", "qualname": "ScaledGPT2"} in run["refs"]["objects"]
    marker = tmp_path / "MODEL_MODULE_RAN"
    plant(bundle, {"code/other_model.py": side_effect(marker, "class Model:\n    pass\n")},
          lambda r: r["config"]["model"].__setitem__("class", {"module": "other_model", "qualname": "Model"}))
    r = cli("replay", str(bundle))
    assert not marker.exists(), "other_model.py was imported"
    assert r.exit_code == 3, r.output
    assert "config.model.class = other_model:Model is not among the classes the bundle lists under refs.objects" \
        in r.output


# --- F8: a snapshot name an installed distribution provides, imported yet or not -------------------------------

def _unimported_installed_name() -> str:
    """A top-level module an installed distribution provides from site-packages and this process has not imported:
    what the old check (already imported modules only) let a snapshot shadow."""
    for top in sorted(importlib.metadata.packages_distributions()):
        if top.isidentifier() and not top.startswith("_") and top not in sys.modules and \
                top not in sys.stdlib_module_names and "." not in top:
            spec = importlib.machinery.PathFinder.find_spec(top)
            if spec is not None and "site-packages" in str(spec.origin or list(spec.submodule_search_locations or [])):
                return top
    pytest.fail("no installed, unimported distribution found to plant")


def test_a_snapshot_module_named_like_an_installed_package_not_imported_yet_is_refused(nan_bundle, tmp_path):
    name = _unimported_installed_name()
    marker = tmp_path / "SHADOW_RAN"
    plant(nan_bundle, {f"code/{name}.py": side_effect(marker, "")})
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 3, r.output
    assert f"the code snapshot holds {name}.py, which would shadow {name} of " in r.output
    assert not marker.exists() and name not in sys.modules


@pytest.mark.slow
def test_the_folder_a_script_ref_puts_on_the_import_path_is_checked_too(nan_bundle, tmp_path):
    """A script ref ``tools/run.py`` puts ``code/tools`` on the import path: a module there named like an installed
    package would shadow it as well."""
    name = _unimported_installed_name()
    marker = tmp_path / "SHADOW_RAN"
    script = (nan_bundle / "code" / "rk_mlp.py").read_text()

    def to_script(run):
        run["refs"]["build"] = {"script": "tools/run.py", "qualname": "build"}
        run["refs"]["step"] = {"script": "tools/run.py", "qualname": "train_step"}

    plant(nan_bundle, {"code/tools/run.py": script}, to_script)
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 1, r.output  # the script's folder alone is fine: the failure reproduces from it
    plant(nan_bundle, {f"code/tools/{name}.py": side_effect(marker, "")})
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 3, r.output
    assert f"the code snapshot holds tools/{name}.py, which would shadow {name} of " in r.output
    assert not marker.exists()


@pytest.mark.parametrize("editable", [False, True, "own"])
def test_a_distribution_installed_outside_site_packages_counts_unless_it_is_an_editable_project(
        tmp_path, monkeypatch, editable):
    """``pip install --target DIR`` on the import path is an installed package a snapshot must not shadow; an
    editable install (``pip install -e .``) is the project's own source, which the snapshot stands in for. So is
    the package the build and step refs live in ("own": the project installed with ``pip install .`` and run from
    its checkout as ``python -m rk_shadow_lib``), whatever the install."""
    from reprokit import code

    target = tmp_path / "target"
    info = target / "rk_shadow_lib-1.0.dist-info"
    info.mkdir(parents=True)
    (target / "rk_shadow_lib.py").write_text("VALUE = 1\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rk-shadow-lib\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("rk_shadow_lib\n")
    if editable is True:
        (info / "direct_url.json").write_text(json.dumps({"url": f"file://{target}", "dir_info": {"editable": True}}))
    snapshot = tmp_path / "code"
    snapshot.mkdir()
    (snapshot / "rk_shadow_lib.py").write_text("VALUE = 2\n")
    refs = {"build": {"module": "reprokit.demo", "qualname": "build"},
            "step": {"module": "reprokit.demo", "qualname": "train_step"}}
    if editable == "own":
        refs = {"build": {"module": "rk_shadow_lib", "qualname": "build"},
                "step": {"module": "rk_shadow_lib", "qualname": "train_step"}}
    monkeypatch.syspath_prepend(str(target))
    code._distributions.cache_clear()  # read again with DIR on the path (and again after, without it)
    try:
        if editable:
            code.check_refs(refs, snapshot=snapshot, code=None)
        else:
            with pytest.raises(BundleError, match="holds rk_shadow_lib.py, which would shadow rk_shadow_lib of the "
                                                    "installed distribution rk-shadow-lib"):
                code.check_refs(refs, snapshot=snapshot, code=None)
    finally:
        code._distributions.cache_clear()
    assert "rk_shadow_lib" not in sys.modules
