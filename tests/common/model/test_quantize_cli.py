"""`pdserve quantize`: argument defaults, the errors it reports, and (when the optional
llm-compressor extra is installed) a GPTQ run on a tiny model that pdserve then loads.

Tests `common/model/quantize.py` through `common.cli.main`; the RTN round trip itself is in
test_compressed_tensors.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig

from common.cli import build_parser, main
from common.model.compressed_tensors import iter_compressed_tensors
from common.model.quant import QuantizedTensor
from common.model.quantize import default_calibration
from tests.conftest import build_tiny_model

HAVE_LLMCOMPRESSOR = importlib.util.find_spec("llmcompressor") is not None


def test_defaults_follow_llm_compressor_presets():
    args = build_parser().parse_args(["quantize", "--model", "m", "--scheme", "W4A16", "-o", "o"])
    assert (args.method, args.group_size, args.asymmetric, args.ignore) == (
        "rtn", None, False, ["lm_head"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", "--model", "m", "--scheme", "W8A8", "-o", "o"])


def test_shipped_calibration_text_is_found():
    text = default_calibration().read_text()
    assert len(text) > 4000


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("quantize-src")
    build_tiny_model("llama", path)
    return path


def _quantize(src, out, *extra) -> int:
    return main(["quantize", "--model", str(src), "--scheme", "W4A16", "-o", str(out), *extra])


def test_group_size_that_does_not_divide_k_is_an_error(tiny_dir, tmp_path, capsys):
    assert _quantize(tiny_dir, tmp_path / "o", "--group-size", "48") == 1
    err = capsys.readouterr().err
    assert "group size 48 does not divide the input dimension" in err
    assert "model.layers.0." in err  # names the tensor


def test_odd_group_size_is_an_error(tiny_dir, tmp_path, capsys):
    assert _quantize(tiny_dir, tmp_path / "o", "--group-size", "3") == 1
    assert "--group-size 3" in capsys.readouterr().err


def test_refuses_a_non_empty_output_dir_and_a_quantized_input(tiny_dir, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert _quantize(tiny_dir, out, "--group-size", "32") == 1
    assert "not empty" in capsys.readouterr().err
    done = tmp_path / "done"
    assert _quantize(tiny_dir, done, "--group-size", "32") == 0
    assert _quantize(done, tmp_path / "again", "--group-size", "32") == 1
    assert "already a compressed-tensors checkpoint" in capsys.readouterr().err


@pytest.mark.skipif(HAVE_LLMCOMPRESSOR, reason="llm-compressor is installed")
def test_gptq_without_the_extra_says_how_to_install_it(tiny_dir, tmp_path, capsys):
    assert _quantize(tiny_dir, tmp_path / "o", "--method", "gptq", "--group-size", "32") == 1
    err = capsys.readouterr().err
    assert "needs llm-compressor" in err and "[quantize]" in err


def _byte_tokenizer(path) -> None:
    """A 256-token byte-level tokenizer (the tiny model's vocabulary size), saved into path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=sorted(alphabet)[255]).save_pretrained(
        path)


def _decompressed_by_transformers(path) -> dict[str, torch.Tensor]:
    """The checkpoint as transformers + compressed-tensors decompress it (what vLLM's users see)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True))
    return model.state_dict()


@pytest.mark.skipif(not HAVE_LLMCOMPRESSOR, reason="needs the [quantize] extra (llm-compressor)")
@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_checkpoint_matches_compressed_tensors_decompression(tmp_path, method):
    """pdserve reads llm-compressor's GPTQ output, and compressed-tensors reads pdserve's RTN
    output, to the same bf16 weights bit for bit (asymmetric int4: packed zero points too)."""
    src, out = tmp_path / "src", tmp_path / "out"
    model = build_tiny_model("llama", src)
    _byte_tokenizer(src)
    assert _quantize(src, out, "--method", method, "--group-size", "32", "--asymmetric",
                     "--dtype", "bfloat16", "--num-samples", "8", "--max-seq-len", "64") == 0
    original = model.state_dict()
    loaded = dict(iter_compressed_tensors(out, AutoConfig.from_pretrained(out)))
    quantized = {k: v for k, v in loaded.items() if isinstance(v, QuantizedTensor)}
    assert len(quantized) == 14 and not isinstance(loaded["lm_head.weight"], QuantizedTensor)
    reference = _decompressed_by_transformers(out)
    for name, qt in quantized.items():
        assert qt.bits == 4 and qt.group_size == 32 and qt.zero is not None
        assert torch.equal(qt.dequantize(torch.bfloat16), reference[name]), name
        # GPTQ trades rounding error between columns, so bound the whole matrix: 4-bit group-32
        # quantization of these Gaussian weights is about 10% relative error either way.
        w = original[name].float()
        rel = (qt.dequantize() - w).norm() / w.norm()
        assert rel < 0.25, (name, rel.item())
