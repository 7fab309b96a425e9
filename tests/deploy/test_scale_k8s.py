"""scripts/scale.sh --k8s: `kubectl scale` of the Deployments deploy/k8s defines, against a fake
kubectl that records its calls (the compose mode is tested in test_compose.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deploy import kustomize
from tests.deploy.test_compose import SCALE, _write_exe

ROOT = SCALE.parents[1]


def _kubectl_dir(tmp_path: Path, *, hpa: bool = False) -> Path:
    """A PATH directory with a kubectl that logs its argv; `get hpa/...` succeeds iff `hpa`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    _write_exe(
        bin_dir / "kubectl",
        f'#!/bin/sh\nprintf "%s\\n" "kubectl $*" >> "{log}"\n'
        f'case "$3" in get) exit {0 if hpa else 1} ;; esac\nexit 0\n',
    )
    for tool in ("dirname", "basename"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return bin_dir


def _scale(args: list[str], path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shutil.which("bash"), str(SCALE), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": str(path)},
    )


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize(
    "args, namespace, stage, n",
    [
        (["--k8s", "decode", "3"], "pdserve", "decode", 3),
        (["--kubernetes", "-n", "prod", "prefill", "0"], "prod", "prefill", 0),
        (["--k8s", "--namespace", "llm", "--", "prefill", "07"], "llm", "prefill", 7),
        (["--k8s", "router", "3"], "pdserve", "router", 3),
    ],
)
def test_scale_k8s_runs_kubectl_scale(args, namespace, stage, n, tmp_path: Path) -> None:
    result = _scale(args, _kubectl_dir(tmp_path))
    assert result.returncode == 0, result.stderr
    assert _calls(tmp_path)[-1] == (
        f"kubectl -n {namespace} scale deployment/pdserve-{stage} --replicas={n}"
    )
    assert "hpa" not in result.stderr


def test_scale_k8s_names_deployments_the_manifests_define() -> None:
    objects = kustomize.render(ROOT / "deploy" / "k8s" / "base")
    deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert {"pdserve-prefill", "pdserve-decode", "pdserve-router"} <= deployments
    namespaces = {o["metadata"]["namespace"] for o in objects if o["kind"] == "Deployment"}
    assert namespaces == {"pdserve"}  # scale.sh's default namespace


def test_scale_k8s_warns_when_an_hpa_manages_the_stage(tmp_path: Path) -> None:
    result = _scale(["--k8s", "decode", "2"], _kubectl_dir(tmp_path, hpa=True))
    assert result.returncode == 0, result.stderr
    assert "hpa/pdserve-decode" in result.stderr
    assert _calls(tmp_path)[-1] == "kubectl -n pdserve scale deployment/pdserve-decode --replicas=2"


@pytest.mark.parametrize(
    "args",
    [
        ["--k8s", "decode", "0"],
        ["--k8s", "router", "0"],
        ["--k8s", "api", "1"],
        ["--k8s", "-n"],
        ["--k8s", "-n", "", "decode", "1"],
        ["-n", "prod", "decode", "1"],  # a namespace without --k8s
        ["--k8s", "--bogus", "decode", "1"],
        ["--k8s", "decode", "1", "extra"],
    ],
)
def test_scale_k8s_rejects_bad_arguments(args: list[str], tmp_path: Path) -> None:
    result = _scale(args, _kubectl_dir(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "usage:" in result.stderr
    assert _calls(tmp_path) == []


def test_scale_k8s_one_router_warns(tmp_path: Path) -> None:
    result = _scale(["--k8s", "router", "1"], _kubectl_dir(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "PodDisruptionBudget" in result.stderr
    assert _calls(tmp_path)[-1] == "kubectl -n pdserve scale deployment/pdserve-router --replicas=1"


def test_scale_k8s_without_kubectl(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "basename"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    result = _scale(["--k8s", "decode", "2"], bin_dir)
    assert result.returncode == 1
    assert "kubectl not found" in result.stderr


def test_scale_help_shows_both_modes() -> None:
    result = subprocess.run([shutil.which("bash"), str(SCALE), "--help"], capture_output=True)
    assert result.returncode == 0
    assert b"--k8s" in result.stdout and b"[--compose]" in result.stdout
