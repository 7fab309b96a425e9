"""Rendering deploy/k8s kustomizations: `kubectl kustomize` when installed, else a tiny renderer.

The manifests use only four kustomize features, and this module implements exactly those:
`resources` (YAML files, and directories holding a kustomization.yaml), `namespace` (set on every
namespaced object; a Namespace object is renamed to it, as kustomize does), `images` (`name` ->
`newName` / `newTag`) and `patches` given as a `path` to a JSON 6902 patch (a list of add / remove /
replace operations) with a `target` of `kind` and `name` (a regex matched whole, as kustomize
does). Anything else in a kustomization.yaml is an error here, so a manifest change that needs more
of kustomize fails loudly instead of rendering differently. JSON 6902 rather than strategic-merge
patches: RFC 6902 is fully specified by the patch itself, where a strategic merge depends on each
field's merge key (containers by name, volumeMounts by mountPath, ...), i.e. on kustomize's copy of
the Kubernetes schemas. tests/deploy/test_k8s.py checks that both renderings agree where kubectl
is installed.

Used by tests/deploy/test_k8s.py and test_k8s_cluster.py.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

Manifest = dict[str, Any]

SUPPORTED_KEYS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}
CLUSTER_SCOPED = {
    "Namespace",
    "PersistentVolume",
    "StorageClass",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "APIService",
    "PriorityClass",
}


def render(directory: Path) -> list[Manifest]:
    """The objects the kustomization in `directory` renders (kubectl if installed, else ours)."""
    if shutil.which("kubectl") is not None:
        return render_kubectl(directory)
    return render_fallback(directory)


def render_kubectl(directory: Path) -> list[Manifest]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def render_fallback(directory: Path) -> list[Manifest]:
    """Our rendering of the kustomization in `directory` (the subset described above)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise ValueError(f"{directory}: kustomize features this renderer lacks: {sorted(unknown)}")
    objects: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render_fallback(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        if set(patch) != {"path", "target"} or set(patch["target"]) - {"kind", "name"}:
            raise ValueError(f"{directory}: only path + target (kind, name) patches: {patch}")
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise ValueError(f"{patch['path']}: not a JSON 6902 patch (a list of operations)")
        matched = [i for i, o in enumerate(objects) if _matches(o, patch["target"])]
        if not matched:
            raise ValueError(f"{directory}: patch {patch} matches nothing")
        for i in matched:
            objects[i] = apply_json_patch(objects[i], ops)
    for image in kustomization.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] == "Namespace":
                obj["metadata"]["name"] = namespace
            elif obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
    return objects


def _matches(obj: Manifest, target: dict[str, str]) -> bool:
    if "kind" in target and obj.get("kind") != target["kind"]:
        return False
    return "name" not in target or re.fullmatch(target["name"], obj["metadata"]["name"]) is not None


# --- JSON 6902 ----------------------------------------------------------------------------------


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _index(container: list, token: str, *, insert: bool) -> int:
    if token == "-" and insert:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token[0] == "0"):
        raise ValueError(f"bad array index {token!r}")
    i = int(token)
    if i > len(container) or (i == len(container) and not insert):
        raise ValueError(f"array index {i} out of range")
    return i


def apply_json_patch(doc: Manifest, ops: list[dict[str, Any]]) -> Manifest:
    """`doc` with the RFC 6902 operations add, remove and replace applied (a new object)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, tokens = op["op"], _pointer(op["path"])
        parent: Any = doc
        for token in tokens[:-1]:
            if isinstance(parent, list):
                parent = parent[_index(parent, token, insert=False)]
            else:
                parent = parent[token]
        last = tokens[-1]
        if kind == "add":
            if isinstance(parent, list):
                parent.insert(_index(parent, last, insert=True), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif kind in ("remove", "replace"):
            if isinstance(parent, list):
                i = _index(parent, last, insert=False)
            elif last not in parent:
                raise ValueError(f"{kind} {op['path']}: no such member")
            else:
                i = last
            if kind == "remove":
                del parent[i]
            else:
                parent[i] = copy.deepcopy(op["value"])
        else:
            raise ValueError(f"JSON patch op {kind!r} is not supported here")
    return doc


# --- images -------------------------------------------------------------------------------------


def _split_image(image: str) -> tuple[str, str]:
    """'reg:5000/name:tag' -> ('reg:5000/name', ':tag'); digests kept as '@sha256:...'."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_image(obj: Manifest, entry: dict[str, str]) -> None:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        name, tag = _split_image(container["image"])
        if name != entry["name"]:
            continue
        name = entry.get("newName", name)
        if "newTag" in entry:
            tag = ":" + str(entry["newTag"])
        container["image"] = name + tag
