"""common/bench/step_cost.py: bytes read per step, the dtype each linear computes in, floors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from common.bench import step_cost
from common.bench.limits import Limits
from common.kernels import cpu_gemm
from common.model.layers import Linear
from common.model.quant import QuantEmbedding, QuantLinear, TiedQuantHead, quantize_rtn

CONFIG = LlamaConfig(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=1,
    vocab_size=256,
)


class TinyModel(nn.Module):
    """The layout step_cost walks: projections, an embedding, a head tied or not."""

    def __init__(self, quantized: bool, tied: bool) -> None:
        super().__init__()
        self.tie_word_embeddings = tied
        g = torch.Generator().manual_seed(0)
        table = torch.randn(256, 64, generator=g)
        if quantized:
            self.embed_tokens = QuantEmbedding(quantize_rtn(table, 8, 32))
            self.proj = QuantLinear(quantize_rtn(torch.randn(128, 64, generator=g), 4, 32))
            self.lm_head = TiedQuantHead(self.embed_tokens) if tied else Linear(64, 256, False)
        else:
            self.embed_tokens = nn.Embedding(256, 64)
            self.proj = Linear(64, 128, bias=False)
            self.lm_head = Linear(64, 256, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_linears_count_the_head_once(quantized, tied):
    model = TinyModel(quantized, tied)
    names = [name for name, _ in step_cost.linears(model)]
    head = "embed_tokens" if quantized and tied else "lm_head"
    assert names == ["proj", head]


def test_decode_read_bytes():
    model = TinyModel(quantized=False, tied=True).to(torch.bfloat16)
    kv_per_token = 2 * 1 * 2 * 16 * 2  # K and V, 1 layer, 2 heads of 16, bf16
    expected = (128 * 64 + 256 * 64) * 2 + 3 * 10 * kv_per_token
    assert step_cost.decode_read_bytes(model, CONFIG, 3, 10, torch.bfloat16) == expected


def test_float16_scales_count_two_bytes():
    # a GGUF-like int4 weight (float16 scale, zero = a float16 minimum + 8 scale): the a8
    # panels stream its scales and zeros at 2 bytes, and so does the read floor
    qt = quantize_rtn(torch.randn(128, 64, generator=torch.Generator().manual_seed(0)), 4, 32)
    assert step_cost.weight_bytes(QuantLinear(qt)) == qt.nbytes  # float32 scales: as stored
    scale = qt.scale.half().float()
    qt.zero = (qt.zero - 8 * qt.scale).half().float() + 8 * scale
    qt.scale = scale
    assert step_cost.weight_bytes(QuantLinear(qt)) == 128 * 32 + 2 * 2 * 128 * 2


def test_dense_16_bit_layers_compute_in_float32_from_the_tile_batch():
    layer = Linear(64, 128, bias=False).to(torch.bfloat16)
    assert step_cost.compute_dtype(layer, 1, torch.bfloat16) == "bfloat16"
    assert step_cost.compute_dtype(layer, cpu_gemm.MIN_ROWS_DENSE, torch.bfloat16) == "float32"
    assert step_cost.compute_dtype(Linear(64, 128, bias=False), 512, torch.float32) == "float32"
    if torch.backends.mkldnn.is_available():
        layer.pack_for_cpu()
        if layer.packed is not None:  # oneDNN takes every batch, in the weight's dtype
            assert step_cost.compute_dtype(layer, 512, torch.bfloat16) == "bfloat16"


def test_step_floor_takes_each_linears_dtype_rate():
    model = TinyModel(quantized=False, tied=False).to(torch.bfloat16)
    rates = {("bfloat16", 8): 1e9, ("float32", 8): 4e9}
    limits = Limits(read_bytes_per_s=1e9, rates=rates)
    floor = step_cost.step_floor(limits, model, 8, torch.bfloat16, read_bytes=2e6)
    flops = 2 * 8 * (128 * 64 + 256 * 64)
    assert floor.dtypes == ("bfloat16",)
    assert floor.compute_s == pytest.approx(flops / 1e9)
    assert floor.read_s == pytest.approx(2e-3)
    assert floor.limit_s == max(floor.read_s, floor.compute_s)
    # a prefill's head multiplies only the last tokens
    rates = {("bfloat16", 1): 1e9, ("float32", 64): 4e9}
    limits = Limits(read_bytes_per_s=1e9, rates=rates)
    floor = step_cost.step_floor(limits, model, 64, torch.bfloat16, 0, head_rows=1)
    expected = 2 * 64 * 128 * 64 / 4e9 + 2 * 1 * 256 * 64 / 1e9
    assert floor.compute_s == pytest.approx(expected)
    assert set(floor.dtypes) == {"float32", "bfloat16"}


def test_generate_floor_is_the_prefill_then_the_decode_steps():
    model = TinyModel(quantized=False, tied=False).to(torch.bfloat16)
    rates = {("bfloat16", 1): 1e9, ("bfloat16", 8): 2e9, ("float32", 64): 4e9}
    limits = Limits(read_bytes_per_s=1e6, rates=rates)  # slow reads: decode steps read-bound
    weights = (128 * 64 + 256 * 64) * 2
    prefill_s = 2 * 32 * 128 * 64 * 2 / 4e9 + 2 * 2 * 256 * 64 / 2e9  # head on the 2 last tokens
    prefill_s = max(prefill_s, weights / 1e6)
    kv = 2 * 1 * 2 * 16 * 2 * (32 + 1) * 2  # K/V of 2 sequences at the mean context, 33
    decode_s = (weights + kv) / 1e6
    one = step_cost.generate_floor_s(limits, model, CONFIG, torch.bfloat16, 2, 32, 1)
    three = step_cost.generate_floor_s(limits, model, CONFIG, torch.bfloat16, 2, 32, 3)
    assert one == pytest.approx(prefill_s)
    assert three == pytest.approx(prefill_s + 2 * decode_s)


def test_cores_floor_of_a_step_and_of_a_run():
    model = TinyModel(quantized=False, tied=False).to(torch.bfloat16)
    rates = {("bfloat16", 8): 1e9, ("float32", 8): 4e9}
    limits = Limits(
        read_bytes_per_s=2e6,
        rates=rates,
        threads=2,
        one_core_read_bytes_per_s=1e6,
        one_core_rates={"bfloat16": 0.5e9, "float32": 2e9},
    )
    floor = step_cost.step_floor(limits, model, 8, torch.bfloat16, read_bytes=2e6)
    flops = 2 * 8 * (128 * 64 + 256 * 64)
    assert floor.read_s == pytest.approx(1.0) and floor.compute_s == pytest.approx(flops / 1e9)
    assert floor.core_s == pytest.approx((2e6 / 1e6 + flops / 0.5e9) / 2)
    assert floor.cores_limit_s == pytest.approx(max(floor.limit_s, floor.core_s))
    assert floor.core_s > floor.limit_s  # reading takes the cores: the floors add
    plain = step_cost.generate_floor_s(limits, model, CONFIG, torch.bfloat16, 2, 8, 5)
    cores = step_cost.generate_floor_s(limits, model, CONFIG, torch.bfloat16, 2, 8, 5, cores=True)
    assert cores > plain
    # without one-thread figures the cores' floor is absent and changes nothing
    bare = Limits(read_bytes_per_s=2e6, rates=rates)
    assert step_cost.step_floor(bare, model, 8, torch.bfloat16, 2e6).core_s == 0.0
    assert step_cost.generate_floor_s(
        bare, model, CONFIG, torch.bfloat16, 2, 8, 5, cores=True
    ) == pytest.approx(step_cost.generate_floor_s(bare, model, CONFIG, torch.bfloat16, 2, 8, 5))


def test_an_8_bit_cache_reads_its_codes_and_scales():
    """The floors count the cache in its own type: int8 codes plus a float32 scale per (token,
    KV head) row, not the activations' bfloat16."""
    model = TinyModel(quantized=False, tied=False).to(torch.bfloat16)
    limits = Limits(read_bytes_per_s=1e6, rates={("bfloat16", 2): 1e12})
    weights = (128 * 64 + 256 * 64) * 2
    rows = 2 * 1 * 2 * 10 * 2  # K and V, 1 layer, 2 heads, 10 tokens, 2 sequences
    for kv_dtype, row_bytes in ((None, 16 * 2), (torch.bfloat16, 16 * 2), (torch.int8, 16 + 4)):
        floor = step_cost.decode_floor(limits, model, CONFIG, 2, 10, torch.bfloat16, kv_dtype)
        assert floor.read_s == pytest.approx((weights + rows * row_bytes) / 1e6)
    bf16 = step_cost.generate_floor_s(limits, model, CONFIG, torch.bfloat16, 2, 8, 5)
    int8 = step_cost.generate_floor_s(limits, model, CONFIG, torch.bfloat16, 2, 8, 5, torch.int8)
    assert int8 < bf16
