"""common/kernels/cpu_quant.py's activation mode: which path each mode picks, the a8 path through a
QuantLinear, the setting from EngineConfig / --cpu-activations, and a tiny quantized model's greedy
output with int8 activations against float ones. (Every path against the reference:
tests/common/model/test_quant.py; the int8-activation kernel itself: test_cpu_qgemm.py.)"""

from __future__ import annotations

import argparse

import pytest
import torch

from common.config import EngineConfig, add_engine_args, config_from_args
from common.engine.engine import Engine
from common.kernels import cpu_qgemm, cpu_quant, weight_copies
from common.model.quant import QuantLinear, quantize_rtn
from common.sampling_params import SamplingParams

if not (cpu_quant.c_available() and cpu_qgemm.available()):
    pytest.skip("the C kernels could not be built", allow_module_level=True)
SIMD = cpu_qgemm.isa() != "portable"


@pytest.fixture(autouse=True)
def fixed_table(monkeypatch):
    """Which path each mode picks, in the fixed table (--kernel-choice table): what auto picks is
    measured (tests/common/kernels/test_tune.py)."""
    monkeypatch.setattr(cpu_quant, "kernel_choice", "table")


def layer(bits: int = 4, group: int = 32, n: int = 80, k: int = 192) -> QuantLinear:
    qt = quantize_rtn(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), bits, group)
    return QuantLinear(qt, bias=torch.randn(n))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_mode_picks(monkeypatch, bits, dtype):
    lay = layer(bits).to(dtype).kernel_weight()
    x = {m: torch.randn(m, 192, dtype=dtype) for m in (1, 2, 16, 128, 300)}
    monkeypatch.setattr(cpu_quant, "activations", "float")
    assert all(cpu_quant.choose(lay, x[m]) != "a8" for m in x)
    if dtype == torch.float32:  # the float table as it was: the C kernel, then the tiles
        assert [cpu_quant.choose(lay, x[m]) for m in x] == ["c"] * 3 + ["f32tiles"] * 2
    monkeypatch.setattr(cpu_quant, "activations", "auto")
    assert cpu_quant.choose(lay, x[1]) == "c"  # batch 1: the C decode layers' kernel
    assert all((cpu_quant.choose(lay, x[m]) == "a8") == SIMD for m in (2, 16, 128, 300))
    monkeypatch.setattr(cpu_quant, "activations", "int8")
    assert all(cpu_quant.choose(lay, x[m]) == "a8" for m in x)


def test_a8_formats_it_does_not_take_fall_through(monkeypatch):
    monkeypatch.setattr(cpu_quant, "activations", "int8")
    lay = QuantLinear(quantize_rtn(torch.randn(16, 96), 4, 16))  # groups of 16
    assert cpu_quant.choose(lay.kernel_weight(), torch.randn(8, 96)) == "c"


def test_a8_path_is_the_kernel_plus_bias(monkeypatch):
    monkeypatch.setattr(cpu_quant, "activations", "int8")
    lay = layer()
    x = torch.randn(9, 192)
    want = cpu_qgemm.matmul_a8(x, cpu_qgemm.pack(lay.kernel_weight())) + lay.bias
    assert torch.equal(lay(x), want)
    assert ("a8", None) in lay.kernel_weight().derived
    lay = lay.to(torch.bfloat16)  # scale converted: the packed copy is dropped and remade
    assert ("a8", None) not in lay.kernel_weight().derived
    got = lay(x.bfloat16())
    assert got.dtype == torch.bfloat16 and ("a8", None) in lay.kernel_weight().derived


def test_cached_choices_follow_the_mode(monkeypatch):
    lay = layer()
    x = torch.randn(8, 192)
    monkeypatch.setattr(cpu_quant, "activations", "float")
    assert cpu_quant.path_for(lay.kernel_weight(), x) == "c"
    cpu_quant.set_activations("int8")
    assert cpu_quant.path_for(lay.kernel_weight(), x) == "a8"
    cpu_quant.set_activations("float")
    assert cpu_quant.path_for(lay.kernel_weight(), x) == "c"
    with pytest.raises(ValueError, match="cpu activations must be one of"):
        cpu_quant.set_activations("int4")


def test_config_and_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).cpu_activations == "auto"
    args = parser.parse_args(["--cpu-activations", "int8"])
    assert config_from_args(args).cpu_activations == "int8"
    with pytest.raises(ValueError, match="--cpu-activations must be auto, int8 or float"):
        EngineConfig(cpu_activations="int4").validate()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_int8_activations_agree_with_float_greedy(tiny_llama, mode):
    """A tiny random int4 / int8 model, float32, greedy, 8 prompts x 16 tokens: int8
    activations against float ones. Rounding x per block of 32 moves each matmul output by
    ~0.5% of its size and the logits by up to ~0.2 here (random-init logits over 256 tokens
    have near ties), so greedy output diverges now and then: measured 87% of tokens before each
    prompt's first divergence (int4 and int8), logprobs before it within 0.2."""
    hf_model, _ = tiny_llama
    cfg = dict(model="tiny", dtype="float32", kv_cache_memory="8MiB", block_size=8,
               quantization=mode)  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 20, (8,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    outputs = {}
    for act in ("float", "int8"):
        engine = Engine(EngineConfig(**cfg, cpu_activations=act), hf_model.config,
                        hf_model.state_dict().items())  # fmt: skip
        assert cpu_quant.activations == act  # the model runner set it
        outputs[act] = engine.generate(prompts, params)
    same = 0
    for a, b in zip(outputs["float"], outputs["int8"]):
        pairs = list(zip(a.output_token_ids, b.output_token_ids))
        n = next((i for i, (x, y) in enumerate(pairs) if x != y), len(pairs))
        same += n
        assert b.output_logprobs[:n] == pytest.approx(a.output_logprobs[:n], abs=0.3)
    assert same >= 0.75 * params.max_tokens * len(prompts)


@pytest.mark.parametrize("path", ["a8", "int4pack", "c", "f32tiles", "dequant"])
def test_a_weight_written_in_place_is_never_served_from_an_old_copy(monkeypatch, path):
    """The same tensors (so the same data_ptr) with new values: a repacked copy keyed by the
    address, as it was, would serve the old weight; keyed by the tensors' versions it is made
    again, and the C kernel's pointers read the new values in place."""
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", path)
    monkeypatch.setattr(cpu_quant, "activations", "int8" if path == "a8" else "float")
    lay, other = layer(), layer(n=80, k=192)
    with torch.no_grad():
        other.scale.mul_(3)
    x = torch.randn(4, 192, dtype=torch.bfloat16)
    lay = lay.to(torch.bfloat16)
    other = other.to(torch.bfloat16)
    w = lay.kernel_weight()
    if not cpu_quant.applies(path, w, x):
        pytest.skip(f"{path} does not apply here")
    before = lay(x)
    ptrs = (lay.qweight.data_ptr(), lay.scale.data_ptr(), lay.zero.data_ptr())
    with torch.no_grad():  # as load_weights does: copy into the buffers
        lay.qweight.copy_(other.qweight)
        lay.scale.copy_(other.scale)
        lay.zero.copy_(other.zero)
        lay.bias.copy_(other.bias)
    assert (lay.qweight.data_ptr(), lay.scale.data_ptr(), lay.zero.data_ptr()) == ptrs
    assert lay.kernel_weight() is w  # same tensors, same description
    assert torch.equal(lay(x), other(x)) and not torch.equal(before, other(x))


def test_a_replaced_buffer_makes_a_new_weight_description(monkeypatch):
    """A buffer assigned anew (not through .to()): the C kernel's cached pointers were into the
    old tensor, which a new one may reuse the address of; the layer describes its new buffers
    and the kernel reads those."""
    monkeypatch.setattr(cpu_quant, "activations", "float")
    lay, other = layer(), layer(n=80, k=192)
    with torch.no_grad():
        other.scale.mul_(3)
    x = torch.randn(1, 192)
    old = lay.kernel_weight()
    assert cpu_quant.path_for(old, x) == "c" and not torch.equal(lay(x), other(x))
    lay.qweight, lay.scale, lay.zero, lay.bias = other.qweight, other.scale, other.zero, other.bias
    assert lay.kernel_weight() is not old and torch.equal(lay(x), other(x))


def test_the_copies_every_batch_size_uses_are_made_ahead(monkeypatch):
    """prepare_copies makes the copy of each path that some batch size up to the given one
    takes, and only those: a step of any size then makes none (the first steps of each size
    used to pay for them)."""
    monkeypatch.setattr(cpu_quant, "activations", "auto" if SIMD else "float")
    monkeypatch.setattr(cpu_quant, "dense_weights", True)
    monkeypatch.setattr(cpu_quant, "dense_min_rows", 64)
    monkeypatch.setattr(cpu_quant, "kernel_choice", "auto")  # a tuned table, as measured
    orders = [["c", "a8"], ["a8", "c"], ["dense", "a8", "c"], ["dense", "c"]]
    key = (4, torch.bfloat16, cpu_quant.activations)
    monkeypatch.setattr(cpu_quant, "tuned", {key: ([1, 16, 128, 256], orders)})
    lay = layer().to(torch.bfloat16)
    w = lay.kernel_weight()
    rows = weight_copies.switch_rows(300)
    assert rows[0] == 1 and rows[-1] == 300 and {16, 17, 64, 65, 128, 129, 256, 257} <= set(rows)
    assert all(m <= 300 for m in rows) and rows == sorted(set(rows))
    serves = weight_copies.prepare_copies([(w, 300)], torch.bfloat16)
    want = {cpu_quant.path_for(w, torch.empty(m, 192, dtype=torch.bfloat16)) for m in range(1, 301)}
    assert set(serves) == want and all(n == 1 for n in serves.values())
    assert "dense" in want and "c" in want  # dense past 64 rows, where its copies may serve
    made = set(w.derived)
    for m in (1, 2, 16, 64, 65, 200, 300):
        lay(torch.randn(m, 192, dtype=torch.bfloat16))
    assert set(w.derived) == made  # nothing new made by a step
    small = layer().to(torch.bfloat16).kernel_weight()
    weight_copies.prepare_copies([(small, 16)], torch.bfloat16)  # up to 16 rows: no dense copy
    assert not any(key[0] == "dense" for key in small.derived)
