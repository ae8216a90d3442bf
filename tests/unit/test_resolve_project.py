"""code.resolve_project: an integration's build imports a class named in run.json's config, vetted like refs and
only if the bundle lists it under refs.objects (given to ``imported``)."""

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


MODEL = {"module": "proj_model_rp", "qualname": "Model"}


def test_a_project_class_in_the_replayed_code_is_imported(code_dir):
    with imported(code_dir, [MODEL]):
        cls = resolve_project(dict(MODEL), "module")
    assert cls.__name__ == "Model" and cls.__module__ == "proj_model_rp"


@pytest.mark.parametrize("objects", [[], [{"module": "proj_model_rp", "qualname": "Other"}]])
def test_a_class_refs_objects_does_not_list_is_refused_before_its_module_is_imported(code_dir, objects):
    """The config is the sender's: it picks nothing that refs.objects (vetted, confirmed by --entry) does not list."""
    marker = code_dir / "RAN"
    (code_dir / "proj_model_rp.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
                                               "class Model:\n    pass\n")
    with imported(code_dir, objects), pytest.raises(BundleError, match="is not among the classes the bundle lists "
                                                                       "under refs.objects"):
        resolve_project(MODEL, "module")
    assert not marker.exists()


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
    # Listed under refs.objects too (check_refs would refuse those first): still refused here, before any import.
    with imported(code_dir, [ref]), pytest.raises(BundleError, match=why):
        resolve_project(ref, "module")


def test_without_a_replayed_code_folder_nothing_is_imported():
    with pytest.raises(CodeLoadError, match="no code folder"):
        resolve_project({"module": "proj_model_rp", "qualname": "Model"}, "module")
    with imported(None, [MODEL]), pytest.raises(CodeLoadError, match="no code folder"):
        resolve_project({"module": "proj_model_rp", "qualname": "Model"}, "module")


def test_check_refs_vets_refs_objects_too(code_dir):
    refs = {"build": {"module": "reprokit.demo", "qualname": "build"},
            "step": {"module": "reprokit.demo", "qualname": "train_step"}, "predicates": []}
    check_refs({**refs, "objects": [{"module": "proj_model_rp", "qualname": "Model"}]}, snapshot=code_dir, code=None)
    with pytest.raises(BundleError, match="refs.objects"):
        check_refs({**refs, "objects": [{"module": "os", "qualname": "system"}]}, snapshot=code_dir, code=None)
    with pytest.raises(BundleError, match="refs.objects"):
        check_refs({**refs, "objects": {"module": "os"}}, snapshot=code_dir, code=None)
