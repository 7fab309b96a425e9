"""tests/deploy/kustomize.py, the fallback renderer: JSON 6902, images, namespace, and refusing
what it does not implement (its agreement with kubectl on deploy/k8s is in test_k8s.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.deploy.kustomize import apply_json_patch, render_fallback, render_kubectl

DOC = {"spec": {"list": [{"a": 1}, {"b": 2}], "map": {"x/y": 1, "k": "v"}}}


def test_json_patch_add_remove_replace() -> None:
    out = apply_json_patch(
        DOC,
        [
            {"op": "add", "path": "/spec/list/-", "value": {"c": 3}},
            {"op": "add", "path": "/spec/list/0", "value": {"z": 0}},
            {"op": "remove", "path": "/spec/map/x~1y"},
            {"op": "replace", "path": "/spec/map/k", "value": "w"},
            {"op": "add", "path": "/spec/new", "value": [1]},
        ],
    )
    assert out == {
        "spec": {"list": [{"z": 0}, {"a": 1}, {"b": 2}, {"c": 3}], "map": {"k": "w"}, "new": [1]}
    }
    assert DOC["spec"]["list"] == [{"a": 1}, {"b": 2}]  # the input is untouched


@pytest.mark.parametrize(
    "op",
    [
        {"op": "remove", "path": "/spec/missing"},
        {"op": "replace", "path": "/spec/missing", "value": 1},
        {"op": "remove", "path": "/spec/list/2"},
        {"op": "add", "path": "/spec/list/01", "value": 1},
        {"op": "move", "from": "/spec/map", "path": "/spec/m"},
        {"op": "add", "path": "spec", "value": 1},
    ],
)
def test_json_patch_errors(op: dict) -> None:
    with pytest.raises((ValueError, KeyError)):
        apply_json_patch(DOC, [op])


def _write(directory: Path, files: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        text = content if isinstance(content, str) else yaml.safe_dump_all(content)
        (directory / name).write_text(text)
    return directory


def _deployment(image: str) -> dict:
    spec = {"containers": [{"name": "c", "image": image}], "initContainers": []}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {"template": {"spec": spec}},
    }


def test_images_namespace_and_overlays(tmp_path: Path) -> None:
    _write(
        tmp_path / "base",
        {
            "kustomization.yaml": "namespace: ns\nresources: [objs.yaml]\n"
            "images: [{name: reg:5000/app, newTag: v1}]\n",
            "objs.yaml": [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}},
                _deployment("reg:5000/app:old"),
            ],
        },
    )
    overlay = _write(
        tmp_path / "overlay",
        {
            "kustomization.yaml": "resources: [../base]\nimages: [{name: reg:5000/app, newName: "
            "x/app}]\npatches: [{path: p.yaml, target: {kind: Deployment, name: 'd|e'}}]\n",
            "p.yaml": "- {op: add, path: /spec/replicas, value: 2}\n",
        },
    )
    namespace, deployment = render_fallback(overlay)
    assert namespace["metadata"] == {"name": "ns"}  # kustomize renames a Namespace object
    assert deployment["metadata"]["namespace"] == "ns"
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "x/app:v1"
    assert deployment["spec"]["replicas"] == 2
    if shutil.which("kubectl") is not None:  # kustomize itself agrees
        assert render_kubectl(overlay) == [namespace, deployment]


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [objs.yaml]\ncommonLabels: {a: b}\n",  # a feature it does not implement
        "resources: [objs.yaml]\npatches: [{path: p.yaml, target: {kind: Service}}]\n",  # no match
        "resources: [objs.yaml]\npatches: [{patch: 'x', target: {kind: Deployment}}]\n",
    ],
)
def test_refuses_what_it_does_not_implement(kustomization: str, tmp_path: Path) -> None:
    d = _write(
        tmp_path,
        {
            "kustomization.yaml": kustomization,
            "objs.yaml": [_deployment("app")],
            "p.yaml": "- {op: add, path: /x, value: 1}\n",
        },
    )
    with pytest.raises(ValueError):
        render_fallback(d)
