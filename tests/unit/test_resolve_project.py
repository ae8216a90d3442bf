"""code.resolve_project: an integration's build imports a class named in run.json's config, vetted like refs."""

from __future__ import annotations

import pytest

from reprokit.code import check_refs, imported, resolve_project
from reprokit.errors import BundleError, CodeLoadError


@pytest.fixture
def code_dir(tmp_path):
    d = tmp_path / "code"
    d.mkdir()
    (d / "proj_model_rp.py").write_text("class Model:\n    pass\n")
    return d


def test_a_project_class_in_the_replayed_code_is_imported(code_dir):
    with imported(code_dir):
        cls = resolve_project({"module": "proj_model_rp", "qualname": "Model"}, "module")
    assert cls.__name__ == "Model" and cls.__module__ == "proj_model_rp"


@pytest.mark.parametrize("ref, why", [
    ({"module": "os", "qualname": "system"}, "standard library"),
    ({"module": "torch", "qualname": "load"}, "installed package"),
    ({"module": "reprokit.cli", "qualname": "main"}, "reprokit itself"),
    ({"script": "../proj_model_rp.py", "qualname": "Model"}, "no '..'"),
    ({"module": "elsewhere", "qualname": "Model"}, "not in"),
    ({"module": "proj_model_rp", "qualname": "__class__"}, "dotted Python identifiers"),
    ("proj_model_rp:Model", "must be"),
])
def test_refs_outside_the_replayed_code_are_refused_before_any_import(code_dir, ref, why):
    with imported(code_dir), pytest.raises(BundleError, match=why):
        resolve_project(ref, "module")


def test_without_a_replayed_code_folder_nothing_is_imported():
    with pytest.raises(CodeLoadError, match="no code folder"):
        resolve_project({"module": "proj_model_rp", "qualname": "Model"}, "module")
    with imported(None), pytest.raises(CodeLoadError, match="no code folder"):
        resolve_project({"module": "proj_model_rp", "qualname": "Model"}, "module")


def test_check_refs_vets_refs_objects_too(code_dir):
    refs = {"build": {"module": "reprokit.demo", "qualname": "build"},
            "step": {"module": "reprokit.demo", "qualname": "train_step"}, "predicates": []}
    check_refs({**refs, "objects": [{"module": "proj_model_rp", "qualname": "Model"}]}, snapshot=code_dir, code=None)
    with pytest.raises(BundleError, match="refs.objects"):
        check_refs({**refs, "objects": [{"module": "os", "qualname": "system"}]}, snapshot=code_dir, code=None)
    with pytest.raises(BundleError, match="refs.objects"):
        check_refs({**refs, "objects": {"module": "os"}}, snapshot=code_dir, code=None)
