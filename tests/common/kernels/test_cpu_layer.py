"""The CPU decode layers (common.kernels.cpu_layer): a decode step's decoder layers in one C call.

It calls the same C functions as the per-op path in the same order, so its hidden states and KV
cache writes must be bit-identical to the per-op path's, for every family (bias, q/k norm, tied
heads, rope scaling), int4 and int8, float32 and bfloat16, a batch of sequences at different
lengths. Agreement of the quantized engine with transformers-side references is covered by
tests/common/model/test_quant.py, whose decode steps now run through this path.
"""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.engine.engine import Engine
from common.kernels import cpu_layer, cpu_ops, cpu_quant
from common.kernels.attention import AttentionMetadata

pytestmark = pytest.mark.skipif(not cpu_layer.available(), reason="no C compiler")

BLOCK = 8
CONTEXTS = [5, 17, 30]  # tokens already cached per sequence (different lengths, partial blocks)


def _runner(
    hf_model, mode: str, dtype: str, kv_cache_dtype: str = "auto", kernel: str = "c",
    activations: str = "float", kv_cache_memory: str = "8MiB",
):  # fmt: skip
    # float activations: with int8 ones (auto) batches of 2+ take cpu_quant's a8, not the C layer;
    # the kernel forced to "c": a measured choice (auto) may pick another on a busy or portable
    # build, and the C decode layers run only where every projection takes "c"
    config = EngineConfig(
        model="tiny", dtype=dtype, kv_cache_memory=kv_cache_memory, block_size=BLOCK,
        quantization=mode,
        cpu_activations=activations, kv_cache_dtype=kv_cache_dtype, kernel_choice=kernel,
    )  # fmt: skip
    return Engine(config, hf_model.config, hf_model.state_dict().items()).runner


def _prefill_then_decode_inputs(runner, new_tokens: int = 1, contexts=CONTEXTS):
    """Prefill every sequence's context (per-op path), then the inputs of the next step:
    `new_tokens` per sequence (1: a decode step; more: as a verify step has)."""
    gen = torch.Generator().manual_seed(0)
    rows, decode = [], []
    next_block = 0
    for ctx in contexts:
        blocks = list(range(next_block, next_block + (ctx + new_tokens) // BLOCK + 1))
        next_block += len(blocks)
        tokens = torch.randint(0, 250, (ctx + new_tokens,), generator=gen).tolist()
        rows.append((tokens[:ctx], 0, blocks))
        decode.append((tokens[ctx:], ctx, blocks))
    with torch.inference_mode():
        ids, pos, meta = runner.prepare_rows(rows)
        runner.model(ids, pos, meta)
    return runner.prepare_rows(decode)


def _forward(runner, inputs, fused: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setattr(cpu_layer, "enabled", fused)
    ids, pos, meta = inputs
    with torch.inference_mode():
        return runner.model(ids, pos, meta)


def _stack_in_use(runner) -> bool:
    return runner.model.cpu_layers is not None and runner.model.cpu_layers.num_stacks() > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_decode_layer_equals_per_op_path(tiny_model, mode, dtype, monkeypatch) -> None:
    family, hf_model, _ = tiny_model
    # bfloat16 int4 at batch > 1 otherwise picks torch's packed kernel, which the C layer leaves
    # to the per-op path; forcing the C kernel gives both paths the same matmul
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "c")
    runner = _runner(hf_model, mode, dtype)
    inputs = _prefill_then_decode_inputs(runner)
    per_op = _forward(runner, inputs, False, monkeypatch)
    assert not _stack_in_use(runner)
    caches = [(a.k_cache.clone(), a.v_cache.clone()) for a in _attns(runner)]
    layers_run = runner.model.layers_run
    fused = _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner), family  # the C layers really ran, all in one call
    assert runner.model.layers_run == layers_run + len(runner.model.layers)  # liveness counts
    assert torch.equal(fused, per_op), (family, (fused.float() - per_op.float()).abs().max())
    for attn, (k, v) in zip(_attns(runner), caches):  # the same K/V written to the same slots
        assert torch.equal(attn.k_cache, k) and torch.equal(attn.v_cache, v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_decode_layer_with_8bit_kv_equals_per_op_path(
    tiny_llama, kv_cache_dtype, dtype, monkeypatch
) -> None:
    # the C layers quantize new K/V themselves: the same bytes and scales as kv_quant.write
    from common.kernels import kv_quant

    if kv_cache_dtype == "fp8" and kv_quant.FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    hf_model, _ = tiny_llama
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "c")
    runner = _runner(hf_model, "int8", dtype, kv_cache_dtype)
    inputs = _prefill_then_decode_inputs(runner)
    per_op = _forward(runner, inputs, False, monkeypatch)
    saved = [runner.kv_cache.view(torch.uint8).clone(), runner.kv_scales.clone()]
    slots = inputs[2].slot_mapping  # wiped: the C layers must write them again
    runner.kv_cache.view(torch.uint8).flatten(2, 3)[:, :, slots] = 0
    runner.kv_scales.flatten(2, 3)[:, :, slots] = 0
    fused = _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner)
    assert torch.equal(fused, per_op), (fused.float() - per_op.float()).abs().max()
    assert torch.equal(runner.kv_cache.view(torch.uint8), saved[0])
    assert torch.equal(runner.kv_scales, saved[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_layer_with_float16_kv_equals_per_op_path(tiny_llama, dtype, monkeypatch) -> None:
    """A float16 cache beside other activations: the C layers convert new K/V themselves (round
    to nearest even, as torch's cast) and read it converting in registers."""
    hf_model, _ = tiny_llama
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "c")
    runner = _runner(hf_model, "int8", dtype, "float16")
    inputs = _prefill_then_decode_inputs(runner)
    per_op = _forward(runner, inputs, False, monkeypatch)
    saved = runner.kv_cache.clone()
    runner.kv_cache.flatten(2, 3)[:, :, inputs[2].slot_mapping] = 0  # the C layers write them
    fused = _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner)
    assert torch.equal(fused, per_op), (fused.float() - per_op.float()).abs().max()
    assert torch.equal(runner.kv_cache.view(torch.int16), saved.view(torch.int16))


def _attns(runner):
    return [layer.self_attn for layer in runner.model.layers]


def test_prefill_steps_and_dense_models_take_the_per_op_path(tiny_llama, monkeypatch) -> None:
    hf_model, _ = tiny_llama
    calls = []
    real_run = cpu_layer.DecodeLayers.run

    def counting_run(self, *args):
        out = real_run(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_layer.DecodeLayers, "run", counting_run)
    runner = _runner(hf_model, "int4", "float32")
    # a prefill step of more rows than the C layers take (52 > MAX_MULTI_ROWS)
    assert sum(CONTEXTS) > cpu_layer.MAX_MULTI_ROWS
    _prefill_then_decode_inputs(runner)
    assert not any(calls) and runner.model.cpu_layers is None  # not even described
    dense = _runner(hf_model, "none", "float32")
    calls.clear()
    inputs = _prefill_then_decode_inputs(dense)
    _forward(dense, inputs, True, monkeypatch)
    assert calls and not any(calls)  # dense projections: no C layer


def test_switches_are_read_per_call_and_to_drops_plans(tiny_llama, monkeypatch) -> None:
    hf_model, _ = tiny_llama
    runner = _runner(hf_model, "int4", "float32")
    inputs = _prefill_then_decode_inputs(runner)
    _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner)
    model = runner.model
    ids, pos, meta = inputs
    x = torch.randn(len(CONTEXTS), hf_model.config.hidden_size)
    monkeypatch.setattr(cpu_ops, "enabled", False)  # a plan made earlier must not override it
    rotary = runner.model.rotary
    rotary.set_positions(pos, x.dtype)
    run = (len(model.layers), x, meta, rotary.positions, rotary.cos, rotary.sin)
    assert model.cpu_decode_layers().run(*run) is None
    monkeypatch.setattr(cpu_ops, "enabled", True)
    assert model.cpu_decode_layers().run(*run) is not None
    model.to(torch.float32)  # may move weights: the raw pointers must go
    assert model.cpu_layers is None


def test_rebound_kv_caches_are_written_even_at_the_old_address(tiny_llama, monkeypatch) -> None:
    """The runner binds new KV caches: layer 0's a new tensor at the old one's address (as a
    freed cache's memory may be handed out again), the others elsewhere. Layer arrays cached by
    that address, as they were, would still point into the old caches of the other layers; made
    anew from the new tensors, the step writes its K/V into the new caches, as the per-op path
    does."""
    hf_model, _ = tiny_llama
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "c")
    runner = _runner(hf_model, "int4", "float32")
    inputs = _prefill_then_decode_inputs(runner)
    per_op = _forward(runner, inputs, False, monkeypatch)
    per_op_kv = [(a.k_cache.clone(), a.v_cache.clone()) for a in _attns(runner)]
    _forward(runner, inputs, True, monkeypatch)  # arrays made for the old caches
    assert _stack_in_use(runner)
    old = runner.kv_cache
    new = old.clone()  # the state before this step's writes: undo them
    slots = inputs[2].slot_mapping
    new.flatten(2, 3)[:, :, slots] = 0
    for i, attn in enumerate(_attns(runner)):
        attn.k_cache = old[i, 0].view_as(old[i, 0]) if i == 0 else new[i, 0]
        attn.v_cache = new[i, 1]
        if i == 0:
            attn.k_cache.flatten(0, 1)[slots] = 0
    first = _attns(runner)[0].k_cache
    assert first is not old[0, 0] and first.data_ptr() == old[0, 0].data_ptr()
    fused = _forward(runner, inputs, True, monkeypatch)
    assert torch.equal(fused, per_op)
    for attn, (k, v) in zip(_attns(runner), per_op_kv):
        assert torch.equal(attn.k_cache, k) and torch.equal(attn.v_cache, v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_a8_projections_run_inside_the_c_layers(tiny_llama, mode, dtype, monkeypatch) -> None:
    """int8 activations: the C layers call the a8 GEMM themselves (the measured choice at small
    batches), with the per-op path's rounding: bit-identical."""
    hf_model, _ = tiny_llama
    runner = _runner(hf_model, mode, dtype, kernel="a8", activations="int8")
    inputs = _prefill_then_decode_inputs(runner)
    per_op = _forward(runner, inputs, False, monkeypatch)
    fused = _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner)
    assert torch.equal(fused, per_op), (fused.float() - per_op.float()).abs().max()


@pytest.mark.parametrize(
    "kernel, mode", [("amxbf16", "int4"), ("amxbf16", "int8"), ("amx4", "int4")]
)
def test_amx_projections_run_inside_the_c_layers(tiny_llama, kernel, mode, monkeypatch) -> None:
    """The AMX bfloat16 matmuls (cpu_quant's amxbf16 over dense copies, amx4 over the 4-bit
    codes): the C layers call those kernels themselves, bit-identical to the per-op path and
    close to the float reference; amx4's bits are amxbf16's."""
    from common.kernels import cpu_dense

    if not cpu_dense.available():
        pytest.skip("no AMX-BF16 here")
    hf_model, _ = tiny_llama
    monkeypatch.setattr(cpu_dense, "MIN_ROWS", 0)  # they serve 17+ rows: here 3
    runner = _runner(hf_model, mode, "bfloat16", kernel=kernel)
    if kernel == "amxbf16":
        assert cpu_quant.dense_weights  # the tiny model's copies fit the auto budget
    inputs = _prefill_then_decode_inputs(runner)
    per_op = _forward(runner, inputs, False, monkeypatch)
    fused = _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner)
    weight = runner.model.layers[0].mlp.gate_up_proj.kernel_weight()
    rows = torch.zeros(len(CONTEXTS), weight.k, dtype=torch.bfloat16)
    assert cpu_quant.path_for(weight, rows) == kernel
    assert torch.equal(fused, per_op), (fused.float() - per_op.float()).abs().max()
    plain = _runner(hf_model, mode, "bfloat16", kernel="dequant")  # the reference
    reference = _forward(plain, _prefill_then_decode_inputs(plain), False, monkeypatch)
    torch.testing.assert_close(fused.float(), reference.float(), rtol=0.05, atol=0.05)
    if kernel == "amx4":
        dense = _runner(hf_model, mode, "bfloat16", kernel="amxbf16")
        copies = _forward(dense, _prefill_then_decode_inputs(dense), True, monkeypatch)
        assert torch.equal(fused, copies)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_half_scale_a8_panels_inside_the_c_layers(tiny_llama, dtype, monkeypatch) -> None:
    """Scales and zeros as a GGUF Q4_1 weight has them (float16 scale and minimum; a bfloat16
    model's are bfloat16): the a8 panels keep them in 16 bits and the C layers read them so,
    bit-identical to the per-op path."""
    hf_model, _ = tiny_llama
    runner = _runner(hf_model, "int4", dtype, kernel="a8", activations="int8")
    with torch.no_grad():
        for module in runner.model.modules():
            zero = getattr(module, "zero", None)
            if isinstance(zero, torch.Tensor) and getattr(module, "bits", None) == 4:
                scale = module.scale.float().half().float()
                low = (zero.float() - 8 * module.scale.float()).half().float()
                module.scale.copy_(scale)
                module.zero.copy_(low + 8 * scale)
    inputs = _prefill_then_decode_inputs(runner)
    per_op = _forward(runner, inputs, False, monkeypatch)
    fused = _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner)
    proj = runner.model.layers[0].self_attn.o_proj
    form = cpu_quant.a8_weights(proj.kernel_weight()).scale_format
    assert form == (1 if dtype == "float32" else 2)  # float16 minimums; a bfloat16 model's own
    assert torch.equal(fused, per_op), (fused.float() - per_op.float()).abs().max()


def test_the_c_layers_keep_the_a8_panels_they_point_into(tiny_llama, monkeypatch) -> None:
    """A weight written in place gets new a8 panels (its derived copy is keyed by the tensors'
    versions) and drops the old ones: the C structs made earlier point into those, so they keep
    them alive (a freed panel's memory could be handed to another tensor)."""
    import gc
    import weakref

    hf_model, _ = tiny_llama
    runner = _runner(hf_model, "int4", "float32", kernel="a8", activations="int8")
    inputs = _prefill_then_decode_inputs(runner)
    _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner)
    proj = runner.model.layers[0].self_attn.o_proj
    w = proj.kernel_weight()
    old = weakref.ref(cpu_quant.a8_weights(w).codes)
    with torch.no_grad():
        proj.scale.mul_(1.0)  # an in-place write: the version moves, the values stay
    assert cpu_quant.a8_weights(w).codes is not old()  # new panels for the per-op path
    gc.collect()
    assert old() is not None  # still held by the C structs that point into it
    runner.model.cpu_layers = None  # the model drops the structs: the old panels go with them
    gc.collect()
    assert old() is None


def test_verify_steps_of_many_sequences_take_the_c_layers() -> None:
    """Verify-shaped steps (at most VERIFY_QUERY_LEN new tokens per sequence) take the C layers up
    to MAX_VERIFY_ROWS rows, 64 sequences x 8 included (the per-op path took 2.3-2.5x as long at
    16-64 x 5 rows); a longer chunk does not, beyond MAX_MULTI_ROWS rows."""

    def meta(query_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(1, dtype=torch.long),
            query_start_loc=torch.zeros(2, dtype=torch.int32),
            seq_lens=torch.ones(1, dtype=torch.int32),
            block_tables=torch.zeros(1, 1, dtype=torch.int32),
            query_lens_cpu=[query_len],
            seq_lens_cpu=[query_len],
        )

    assert cpu_layer.MAX_VERIFY_ROWS >= 64 * cpu_layer.VERIFY_QUERY_LEN
    for rows, query_len, takes in [
        (64 * 5, 5, True),
        (64 * cpu_layer.VERIFY_QUERY_LEN, cpu_layer.VERIFY_QUERY_LEN, True),
        (cpu_layer.MAX_VERIFY_ROWS + 5, 5, False),
        (cpu_layer.MAX_MULTI_ROWS + 1, cpu_layer.VERIFY_QUERY_LEN + 1, False),
        (cpu_layer.MAX_MULTI_ROWS, cpu_layer.VERIFY_QUERY_LEN + 1, True),
    ]:
        x = torch.zeros(rows, 8)
        assert cpu_layer.step_applies(x, meta(query_len)) == takes, (rows, query_len)


@pytest.mark.parametrize("new_tokens", [3, cpu_layer.VERIFY_QUERY_LEN])
@pytest.mark.parametrize("kernel,activations", [("c", "float"), ("a8", "int8")])
def test_a_few_rows_per_sequence_attend_causally_in_the_c_layers(
    tiny_llama, kernel, activations, new_tokens, monkeypatch
) -> None:
    """A step with 3 (9 rows in all) or VERIFY_QUERY_LEN (24 rows: more than MAX_MULTI_ROWS,
    taken as a verify step) new tokens for each of 3 sequences: each row attends to the
    positions up to its own through the decode kernel; the per-op path uses its prefill
    attention and rotary (another summation order), so float32 agreement within 1e-4 of the
    activations' scale and the K/V written within 1e-5 (float32 rounding: ~1e-7 relative per
    op, a few hundred ops deep)."""
    hf_model, _ = tiny_llama
    runner = _runner(hf_model, "int4", "float32", kernel=kernel, activations=activations)
    inputs = _prefill_then_decode_inputs(runner, new_tokens=new_tokens)
    rows = inputs[0].shape[0]
    assert rows == new_tokens * len(CONTEXTS) <= cpu_layer.MAX_VERIFY_ROWS
    assert (rows <= cpu_layer.MAX_MULTI_ROWS) == (new_tokens == 3)
    per_op = _forward(runner, inputs, False, monkeypatch)
    caches = [(a.k_cache.clone(), a.v_cache.clone()) for a in _attns(runner)]
    fused = _forward(runner, inputs, True, monkeypatch)
    assert _stack_in_use(runner)
    scale = per_op.abs().max()
    assert (fused - per_op).abs().max() <= 1e-4 * scale
    for attn, (k, v) in zip(_attns(runner), caches):  # rotary in C vs the per-op prefill's
        assert torch.allclose(attn.k_cache, k, atol=1e-5)
        assert torch.allclose(attn.v_cache, v, atol=1e-5)


# ---- the team: a step's layers in one OpenMP region (csrc/decode_layer.c, "The team") ----


@pytest.fixture
def two_threads():
    """The team needs threads to share the work: two, whatever the host has (a one-core host
    oversubscribes, which the barrier's short spin then sleeps through)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _team_steps() -> int:
    return cpu_layer._LIB.get().decode_layers_team_steps()


def _team_and_regions(runner, inputs, monkeypatch):
    """(output, K/V caches, team steps run) with the team, then the same without: each time
    from the caches as they were (the step writes the same slots)."""
    monkeypatch.setattr(cpu_layer, "enabled", True)
    results = []
    for rows in (cpu_layer.TEAM_ROWS, 0):
        monkeypatch.setattr(cpu_layer, "team_rows", rows)
        before = _team_steps()
        with torch.inference_mode():
            out = runner.model(*inputs)
        caches = [(a.k_cache.clone(), a.v_cache.clone()) for a in _attns(runner)]
        results.append((out, caches, _team_steps() - before))
    return results


# (contexts, new tokens per sequence): 3 sequences' decode step, a lone sequence's 5-row verify
# (both: the row-wise steps shared out by rows) and one row (every thread does them itself)
TEAM_SHAPES = [(CONTEXTS, 1), ([40], 5), ([300], 1)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_the_team_gives_the_bits_of_one_region_per_op(
    tiny_model, mode, dtype, two_threads, monkeypatch
) -> None:
    """Every family (bias, q/k norm, rope scaling, tied heads), int4 and int8, float32 and
    bfloat16, at 1, 3 and 5 rows: the team's hidden states and K/V writes equal, to the bit,
    those of the C layers with a region per projection and attention (which the tests above hold
    equal to the per-op path), and the team really ran them."""
    family, hf_model, _ = tiny_model
    runner = _runner(hf_model, mode, dtype, kernel="a8", activations="int8")
    for contexts, new_tokens in TEAM_SHAPES:
        inputs = _prefill_then_decode_inputs(runner, new_tokens, contexts)
        assert inputs[0].shape[0] <= cpu_layer.TEAM_ROWS
        (team, team_kv, ran), (regions, regions_kv, none) = _team_and_regions(
            runner, inputs, monkeypatch
        )
        assert (ran, none) == (1, 0), (family, contexts)
        assert torch.equal(team, regions), (family, contexts, (team - regions).abs().max())
        for (k, v), (k2, v2) in zip(team_kv, regions_kv):
            assert torch.equal(k, k2) and torch.equal(v, v2), (family, contexts)


@pytest.fixture(scope="module")
def long_llama():
    """A tiny Llama with positions past the attention's 512-token parts."""
    from tests.tiny_models import random_model, tiny_config

    return random_model(tiny_config("llama", max_position_embeddings=1024), 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_the_team_merges_long_attention_and_writes_8bit_caches_as_the_regions(
    long_llama, kv_cache_dtype, dtype, two_threads, monkeypatch
) -> None:
    """Sequences past 512 tokens (the attention's parts merged after a barrier of the team's),
    one row and two sequences, with the cache in the activations' dtype or 8-bit (quantized by
    the rows' threads): the same bits as one region per op."""
    from common.kernels import kv_quant

    if kv_cache_dtype == "fp8" and kv_quant.FP8 is None:
        pytest.skip("no float8_e4m3fn in this torch")
    runner = _runner(
        long_llama, "int4", dtype, kv_cache_dtype, kernel="a8", activations="int8",
        kv_cache_memory="32MiB",
    )  # fmt: skip
    for contexts in ([700], [600, 40]):
        inputs = _prefill_then_decode_inputs(runner, 1, contexts)
        (team, team_kv, ran), (regions, regions_kv, _) = _team_and_regions(
            runner, inputs, monkeypatch
        )
        assert ran == 1
        assert torch.equal(team, regions), (contexts, (team - regions).abs().max())
        for (k, v), (k2, v2) in zip(team_kv, regions_kv):
            assert torch.equal(k.view(torch.uint8), k2.view(torch.uint8))
            assert torch.equal(v.view(torch.uint8), v2.view(torch.uint8))
        if kv_cache_dtype != "auto":
            assert runner.kv_scales is not None


def test_the_team_runs_only_where_it_applies(tiny_llama, two_threads, monkeypatch) -> None:
    """Up to TEAM_ROWS rows with every projection on the a8 GEMM; not past TEAM_ROWS, not with
    float activations (the C kernel's projections), not on one thread, not switched off."""
    hf_model, _ = tiny_llama
    monkeypatch.setattr(cpu_layer, "enabled", True)
    # whatever PDSERVE_CPU_TEAM says
    monkeypatch.setattr(cpu_layer, "team_rows", cpu_layer.TEAM_ROWS)

    def ran(runner, contexts, new_tokens=1) -> int:
        inputs = _prefill_then_decode_inputs(runner, new_tokens, contexts)
        before = _team_steps()
        with torch.inference_mode():
            runner.model(*inputs)
        assert _stack_in_use(runner)
        return _team_steps() - before

    a8 = _runner(hf_model, "int4", "float32", kernel="a8", activations="int8")
    assert ran(a8, [20] * cpu_layer.TEAM_ROWS) == 1
    assert ran(a8, [20] * (cpu_layer.TEAM_ROWS + 1)) == 0
    monkeypatch.setattr(cpu_layer, "team_rows", 0)
    assert ran(a8, [20]) == 0
    monkeypatch.setattr(cpu_layer, "team_rows", cpu_layer.TEAM_ROWS)
    torch.set_num_threads(1)
    assert ran(a8, [20]) == 0
    torch.set_num_threads(2)
    c = _runner(hf_model, "int4", "float32", kernel="c", activations="float")
    assert ran(c, [20]) == 0


def test_a_failure_on_one_thread_stops_the_whole_team(tiny_llama, two_threads, monkeypatch):
    """A slot past the cache on the last row only (the second thread's, rows shared out): every
    thread leaves at the same barrier (no hang) and the call fails as the regions' path does,
    with the same layer and code."""
    hf_model, _ = tiny_llama
    runner = _runner(hf_model, "int4", "float32", kernel="a8", activations="int8")
    ids, pos, meta = _prefill_then_decode_inputs(runner)
    meta.slot_mapping[-1] = runner.kv_cache.shape[2] * 10**6  # past every layer's slots
    monkeypatch.setattr(cpu_layer, "enabled", True)
    messages = []
    for rows in (cpu_layer.TEAM_ROWS, 0):
        monkeypatch.setattr(cpu_layer, "team_rows", rows)
        before = _team_steps()
        with torch.inference_mode(), pytest.raises(RuntimeError) as failed:
            runner.model(ids, pos, meta)
        assert _team_steps() - before == (1 if rows else 0)
        messages.append(str(failed.value))
    assert messages[0] == messages[1]
    assert "layer 0 (code 4" in messages[0]


_SLEEPING_TEAM = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.common.kernels import test_cpu_layer as t
from tests.tiny_models import random_model, tiny_config
from common.kernels import cpu_layer
torch.set_num_threads(2)
runner = t._runner(random_model(tiny_config("llama"), 0), "int4", "float32", kernel="a8",
                   activations="int8")
inputs = t._prefill_then_decode_inputs(runner, 5, [40])
outs = []
for rows in (cpu_layer.TEAM_ROWS, 0, cpu_layer.TEAM_ROWS):
    cpu_layer.team_rows = rows
    for _ in range(20):
        with torch.inference_mode():
            out = runner.model(*inputs)
    outs.append(out)
assert t._team_steps() == 40, t._team_steps()
assert all(torch.equal(o, outs[1]) for o in outs)
print("ok")
"""


def test_a_team_that_never_spins_sleeps_and_wakes_on_its_futex(tmp_path) -> None:
    """GOMP_SPINCOUNT=0 (as libgomp, the team's barrier then sleeps at once): every wait goes
    through the futex and its wake, in a process of its own (the count is read once). 40 steps,
    the same bits as the regions'."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).parents[3])
    env = {**os.environ, "GOMP_SPINCOUNT": "0", "PYTHONPATH": root}
    run = subprocess.run(
        [sys.executable, "-c", _SLEEPING_TEAM.format(root=root)], env=env, capture_output=True,
        text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
