"""common/model/quant.py and common/kernels/cpu_quant.py: RTN quantization, every CPU kernel path
against the dequantize-then-matmul reference, quantized tiny models against their dequantized
twins, the flag's errors, and a quantized model through the engine (prefix cache, n-gram
speculation) and run-batch."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import EngineConfig
from common.engine.engine import Engine
from common.kernels import cpu_quant
from common.model.quant import (
    QuantizedTensor,
    QuantLinear,
    cat_rows,
    quant_matmul_reference,
    quantize_rtn,
    resolve_group_size,
)
from common.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, 256)])
def test_rtn_error_is_at_most_half_a_step(bits: int, group: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    qt = quantize_rtn(w, bits, group)
    err = (qt.dequantize() - w).abs().reshape(48, -1, group)
    # round to nearest: within half a quantization step, plus float32 rounding of scale/zero
    assert (err <= qt.scale[..., None] * 0.5 + 1e-6).all()
    assert qt.nbytes < w.nbytes / (2 if bits == 8 else 4)


def test_int4_packing_is_low_nibble_first() -> None:
    w = torch.arange(32, dtype=torch.float32)[None] % 16  # codes 0..15 twice, scale 1, zero 8
    qt = quantize_rtn(w, 4, 32)
    assert qt.qweight[0, 0].item() == 0 | (1 << 4)
    assert torch.equal(qt.unpack()[0], torch.arange(32) % 16)
    assert torch.equal(qt.dequantize(), w)


def test_cat_rows_needs_one_format() -> None:
    a, b = quantize_rtn(torch.randn(8, 64), 4, 32), quantize_rtn(torch.randn(4, 64), 4, 32)
    fused = cat_rows([a, b])
    assert fused.shape == (12, 64)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    with pytest.raises(ValueError, match="cannot fuse"):
        cat_rows([a, quantize_rtn(torch.randn(4, 64), 4, 64)])


def test_group_size_errors() -> None:
    assert resolve_group_size(576, 4, 0) == 64 and resolve_group_size(1536, 4, 0) == 128
    assert resolve_group_size(576, 8, 0) == 576  # int8 auto: per channel
    with pytest.raises(ValueError, match="does not divide the input dimension 576"):
        resolve_group_size(576, 4, 128)
    with pytest.raises(ValueError, match="does not divide"):
        QuantizedTensor(
            4, 48, torch.zeros(2, 32, dtype=torch.uint8), torch.ones(2, 1), None, (2, 64)
        )
    with pytest.raises(ValueError, match="--quantization must be one of"):
        EngineConfig(quantization="int3").validate()
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(quantization_group_size=48).validate()


# (4, 16): groups the AVX2 loop does not take, so the portable C loop runs
CASES = [(4, 16), (4, 32), (4, 64), (4, 128), (8, 32), (8, 0)]  # group 0: per channel


@pytest.mark.parametrize("path", cpu_quant.PATHS)
@pytest.mark.parametrize("bits, group", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 16, 33])
def test_cpu_kernels_match_reference(monkeypatch, path, bits, group, dtype, m) -> None:
    torch.manual_seed(m)
    n, k = 96, 256
    qt = quantize_rtn(torch.randn(n, k) * 0.1, bits, group or k)
    layer = QuantLinear(qt).to(dtype)
    x = torch.randn(m, k).to(dtype)
    monkeypatch.setattr(cpu_quant, "dense_weights", True)  # else the runner's budget decides
    if not cpu_quant.applies(path, layer.kernel_weight(), x):
        pytest.skip(f"{path} does not apply")
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", path)
    assert cpu_quant.choose(layer.kernel_weight(), x) == path
    got = layer(x)
    assert got.dtype == dtype and got.shape == (m, n)
    # reference: the same (dtype-rounded) scale/zero, dequantized and multiplied in float32
    ref = quant_matmul_reference(x.float(), layer.qt)
    # float32: only the summation order differs (256 terms): 1e-4 relative to the output scale.
    # bfloat16: the output is rounded to bf16 (2^-8 relative) and torch's kernels dequantize to
    # bf16 before multiplying: 2% of the output scale covers both. a8 rounds x to int8 per block
    # of 32 (~0.4% of |x|; its bound is checked in tests/common/kernels/test_cpu_qgemm.py).
    tol = 1e-4 if dtype == torch.float32 and path != "a8" else 2e-2
    scale = ref.abs().max()
    assert (got.float() - ref).abs().max() <= tol * scale


@pytest.mark.parametrize(
    "mode, group, kernels",
    [("int4", 0, "auto"), ("int4", 32, "auto"), ("int8", 0, "auto"), ("int8", 32, "auto"),
     ("int4", 32, "dense")],
)  # fmt: skip
def test_tiny_quantized_engine_matches_dequantized_twin(tiny_model, mode, group, kernels) -> None:
    """Engine logprobs of a quantized tiny model vs a dense model holding its dequantized weights.

    float32 with float activations: the quantized and dense matmuls differ only in summation
    order, so greedy tokens agree and logits agree to 1e-3 (random-init logits are O(1)). With
    the dense path forced, every quantized layer multiplies its kept dequantized copy.
    """
    family, hf_model, _ = tiny_model
    cfg = dict(model="tiny", dtype="float32", kv_cache_memory="8MiB", block_size=8,
               cpu_activations="float")  # fmt: skip
    quant = Engine(
        EngineConfig(
            **cfg, quantization=mode, quantization_group_size=group, kernel_choice=kernels
        ),
        hf_model.config,
        hf_model.state_dict().items(),
    )
    model = quant.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * hf_model.config.num_hidden_layers  # qkv, o, gate_up, down
    assert all(m.bits == int(mode[3:]) for m in layers)
    assert type(model.lm_head).__name__ == "Linear"  # the head stays 16-bit on a dense checkpoint
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
    ps = [[5, 9, 23, 7, 100, 3], [17, 4, 4, 8, 99, 120, 31, 2, 64]]
    if kernels == "dense":  # at every batch size (an engine keeps the C layers' batches off it)
        cpu_quant.set_dense_weights(True)
    got = quant.generate(ps, params)  # before the twin's start resets the process's kernel choice
    twin_weights = []
    for hf_name, tensor in hf_model.state_dict().items():
        twin_weights.append((hf_name, _requantized(hf_name, tensor, mode, group)))
    dense = Engine(EngineConfig(**cfg, quantization="none"), hf_model.config, twin_weights)
    ref = dense.generate(ps, params)
    for a, b in zip(got, ref):
        assert a.output_token_ids == b.output_token_ids, family
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-3)
    if kernels == "dense":
        assert cpu_quant.dense_weights and all(("dense", torch.float32) in m.kernel_weight().derived
                                               for m in layers)  # fmt: skip
        # the MLPs' gate/up layers kept their split and multiplied through the fused SiLU path
        gate_ups = [m for name, m in model.named_modules() if name.endswith("gate_up_proj")]
        inter = hf_model.config.intermediate_size
        assert gate_ups and all(m.split == inter for m in gate_ups)
        copies = [m.kernel_weight().derived[("dense", torch.float32)][1] for m in gate_ups]
        assert all(isinstance(c, tuple) for c in copies) or not torch.backends.mkldnn.is_available()
    cpu_quant.set_kernel_choice("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [3, 70, 300])
def test_fused_gate_up_silu_matches_reference(monkeypatch, dtype, m) -> None:
    """A split (gate/up) weight on the dense path: silu_mul gives SiLU(x Wg) * (x Wu) with the
    SiLU and the product applied by oneDNN's post-ops, and the plain matmul still gives both
    parts; on another path, without a split or with a bias, silu_mul declines (None)."""
    torch.manual_seed(m)
    inter, k = 48, 128
    qt = quantize_rtn(torch.randn(2 * inter, k) * 0.1, 4, 32)
    layer = QuantLinear(qt, split=inter).to(dtype)
    x = torch.randn(m, k).to(dtype)
    monkeypatch.setattr(cpu_quant, "dense_weights", True)
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "dense")
    w = layer.kernel_weight()
    assert w.split == inter and cpu_quant.path_for(w, x) == "dense"
    got = layer.silu_mul(x)
    if got is None:  # no oneDNN packed form for this dtype on this CPU
        assert not isinstance(cpu_quant.copy_for("dense", w, dtype)[1], tuple)
        pytest.skip("oneDNN cannot prepack this dtype here")
    weight = layer.qt.dequantize(dtype).float()  # the copy's values, products in float32
    gate, up = (x.float() @ weight.T).split(inter, dim=1)
    ref = torch.nn.functional.silu(gate) * up
    # float32: summation order and oneDNN's exp (1e-4 of the output scale); bfloat16: x, the
    # SiLU'd gate and the output are each rounded to bfloat16 (2^-8 relative): 2% covers them
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == (m, inter)
    assert (got.float() - ref).abs().max() <= tol * ref.abs().max()
    both = layer(x)  # the plain matmul over the two packed parts
    assert both.shape == (m, 2 * inter)
    plain = x.float() @ weight.T
    assert (both.float() - plain).abs().max() <= tol * plain.abs().max()
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "c")
    assert QuantLinear(qt, split=inter).to(dtype).silu_mul(x) is None  # another path
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "dense")
    assert QuantLinear(qt).to(dtype).silu_mul(x) is None  # no split
    assert QuantLinear(qt, torch.zeros(2 * inter), inter).to(dtype).silu_mul(x) is None  # bias


@pytest.mark.parametrize(
    "budget, available, allowed",
    [("auto", 4 << 20, True), ("auto", 1 << 20, False), ("1MiB", 0, True), ("64KiB", 0, False),
     ("0", 1 << 40, False)],
)  # fmt: skip
def test_dense_copies_only_within_their_budget(monkeypatch, caplog, budget, available, allowed):
    """--dense-weight-memory: the copies (here 4 x 96 x 256 float32 = 384 KiB) are allowed when
    all fit: auto in a quarter of the available memory, a size in itself, 0 never."""
    from common.model import model_runner

    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: available)
    monkeypatch.setattr(cpu_quant, "dense_weights", not allowed)
    weights = [quantize_rtn(torch.randn(96, 256), 4, 32) for _ in range(4)]
    kernel = [QuantLinear(qt).kernel_weight() for qt in weights]
    assert cpu_quant.dense_bytes(kernel, torch.float32) == 384 << 10
    with caplog.at_level("INFO", logger="common.model.model_runner"):
        assert model_runner.allow_dense_weights(budget, kernel, torch.float32) is allowed
    assert cpu_quant.dense_weights is allowed
    assert ("do not fit in: the dense path is off" in caplog.text) is not allowed
    big = torch.randn(cpu_quant.dense_min_rows + 1, 256)
    assert cpu_quant.applies("dense", kernel[0], big) is allowed


def _requantized(hf_name: str, tensor: torch.Tensor, mode: str, group: int) -> torch.Tensor:
    """What --quantization mode does to a projection weight, dequantized back (the twin's input)."""
    projection = any(
        f".{p}." in hf_name for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj")
    )  # fmt: skip
    if not projection or not hf_name.endswith(".weight"):
        return tensor
    bits = int(mode[3:])
    return quantize_rtn(tensor, bits, resolve_group_size(tensor.shape[1], bits, group)).dequantize()


def test_quantized_engine_prefix_cache_and_ngram_speculation(tiny_llama) -> None:
    hf_model, _ = tiny_llama
    base = dict(
        model="tiny", dtype="float32", kv_cache_memory="8MiB", block_size=8, quantization="int4"
    )
    plain = Engine(EngineConfig(**base, enable_prefix_caching=False), hf_model.config,
                   hf_model.state_dict().items())  # fmt: skip
    spec = Engine(
        EngineConfig(**base, speculative="ngram", speculative_disable_by_batch_size=0),
        hf_model.config,
        hf_model.state_dict().items(),
    )
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    ps = [shared + [3, 4] * 6, shared + [30, 40, 50] * 4, [1, 2, 3, 1, 2, 3, 1, 2]]
    want = [s.output_token_ids for s in plain.generate(ps, GREEDY)]
    first = [s.output_token_ids for s in spec.generate(ps, GREEDY)]
    again = [s.output_token_ids for s in spec.generate(ps, GREEDY)]  # prefix cache hits now
    assert first == want and again == want
    assert spec.stats()["prefix_cache_hits_total"] > 0


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory):
    """A 2-layer random Llama over SmolLM2's vocabulary with its tokenizer (run-batch needs one)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from common.model.model_files import resolve_model

    path = tmp_path_factory.mktemp("tiny-smol-quant")
    cfg = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    for f in resolve_model("default").hf_dir.iterdir():
        if f.name != "config.json":
            shutil.copy(f, path)
    return path


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_run_batch_quantized(smol_dir, tmp_path, mode) -> None:
    from common.cli import main

    requests = tmp_path / "in.jsonl"
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": f"Hello number {i}", "max_tokens": 4,
                  "temperature": 0}}
        for i in range(3)
    ]  # fmt: skip
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out.jsonl"
    argv = ["run-batch", "-i", str(requests), "-o", str(out), "--model", str(smol_dir)]
    argv += ["--served-model-name", "tiny", "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    argv += ["--max-model-len", "128", "--quantization", mode]
    assert main(argv) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["r0", "r1", "r2"]
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_default_model_native_q4_1_agrees_with_dequantized() -> None:
    """The default model served natively (Q4_1 projections as int4, Q8_0 embedding and head as
    int8) against the same weights dequantized, float32, greedy, float activations. Only
    summation order differs, so the outputs should agree almost everywhere; measured: 100% of
    tokens (4 x 24). (int8 activations: 83%, the first prompt parts at a near tie after 8.)"""
    from common.api.tokenizer import Tokenizer
    from common.model.model_files import resolve_model

    tok = Tokenizer.from_source(resolve_model("default"))
    texts = [
        "The three primary colors are",
        "def fibonacci(n):\n",
        "Once upon a time, in a small village at the edge of a great forest,",
        "Q: What is 12 times 12?\nA:",
    ]
    ps = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for mode in ("auto", "none"):
        cfg = EngineConfig(
            model="default", dtype="float32", kv_cache_memory="64MiB", max_model_len=256,
            num_threads=1, quantization=mode, cpu_activations="float",
        )  # fmt: skip
        engine = Engine(cfg)
        model = engine.runner.model
        assert isinstance(model.layers[0].mlp.down_proj, QuantLinear) == (mode == "auto")
        outputs[mode] = [s.output_token_ids for s in engine.generate(ps, params)]
        del engine
    same = 0
    for a, b in zip(outputs["auto"], outputs["none"]):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    agreement = same / (len(ps) * params.max_tokens)
    print(f"native Q4_1 vs dequantized: {agreement:.1%} of greedy tokens agree")
    assert agreement >= 0.9


def test_quantized_kv_handoff_matches_single_engine(tiny_llama) -> None:
    """1P1D with int4 on both sides: the KV handed over is the quantized model's, and decoding
    continues exactly as one quantized engine would."""
    from tests.common.engine.test_engine import make_engine
    from tests.common.engine.test_engine_handoff import handoff

    hf_model, _ = tiny_llama
    ps = [[5, 9, 23, 7, 100, 3, 8, 8, 41], list(range(10, 33))]
    single = make_engine(hf_model, quantization="int4")
    expected = [s.output_token_ids for s in single.generate(ps, GREEDY)]
    prefill = make_engine(hf_model, quantization="int4")
    decode = make_engine(hf_model, quantization="int4")
    outputs = {}
    for i, p in enumerate(ps):
        _, first = handoff(prefill, decode, f"r{i}", p, GREEDY)
        outputs[f"r{i}"] = list(first.new_token_ids)
    while decode.has_unfinished():
        for out in decode.step():
            outputs[out.request_id] += out.new_token_ids
    assert [outputs[f"r{i}"] for i in range(len(ps))] == expected


def test_layer_to_dtype_drops_cached_kernel_state() -> None:
    """The C path keeps the weight's pointers and scale dtype on the layer's kernel weight; .to()
    makes a new one over the new buffers (scale/zero become new bfloat16 tensors), or the kernel
    would read the float32 ones."""
    torch.manual_seed(0)
    layer = QuantLinear(quantize_rtn(torch.randn(64, 128) * 0.1, 4, 32))
    x = torch.randn(1, 128)
    first = layer(x)
    old = layer.kernel_weight()
    assert old.derived and old.paths
    layer = layer.to(torch.bfloat16)
    assert layer._kernel_weight is None
    new = layer.kernel_weight()
    assert new is not old and not new.derived and not new.paths and new.scale is layer.scale
    got = layer(x.to(torch.bfloat16)).float()
    ref = quant_matmul_reference(x.to(torch.bfloat16).float(), layer.qt)
    assert (got - ref).abs().max() <= 2e-2 * ref.abs().max()
    assert (first - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 0)])
def test_float32_activations_never_pick_torchs_packed_kernels(monkeypatch, bits, group) -> None:
    """torch's int4pack/int8pack run float32 activations 20-45x slower than the C kernel (a
    float32 engine at batch 16 took 2 s a step): the fixed table (--kernel-choice table) gives
    float32 the C kernel, bf16 may pack."""
    monkeypatch.setattr(cpu_quant, "activations", "float")
    monkeypatch.setattr(cpu_quant, "kernel_choice", "table")
    layer = QuantLinear(quantize_rtn(torch.randn(64, 128) * 0.1, bits, group or 128))
    if not cpu_quant.c_available():
        pytest.skip("no C compiler")
    for m in (1, 8, 64):
        assert cpu_quant.choose(layer.kernel_weight(), torch.randn(m, 128)) == "c"
    packed = "int4pack" if bits == 4 else "int8pack"
    bf16 = layer.to(torch.bfloat16).kernel_weight()
    assert cpu_quant.choose(bf16, torch.randn(64, 128, dtype=torch.bfloat16)) == packed


# (bits, N, K, group): the C kernel's single-row paths run several output columns per pass, int4
# 64 weights per load: odd column counts, an odd group count (K % 64 = 32), groups of 64/128,
# groups the int4 path does not take (96: the older per-group loop); int8 groups of 8 and 24
# (gs % 16 = 8) and per channel; all must agree with the reference, with and without zero points
@pytest.mark.parametrize(
    "bits, n, k, group",
    [(4, 97, 96, 32), (4, 5, 576, 32), (4, 33, 192, 64), (4, 34, 256, 128), (4, 7, 96, 96),
     (4, 3, 640, 640), (4, 1, 32, 32), (8, 97, 96, 32), (8, 5, 40, 8), (8, 7, 48, 24),
     (8, 3, 96, 96)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_zero", [True, False])
def test_c_kernel_single_row_shapes(monkeypatch, bits, n, k, group, dtype, with_zero) -> None:
    if not cpu_quant.c_available():
        pytest.skip("no C compiler")
    torch.manual_seed(n * k)
    qt = quantize_rtn(torch.randn(n, k) * 0.1, bits, group)
    zero = torch.randn_like(qt.scale) * 0.01 if bits == 8 else qt.zero
    # int4 without zero: w = (q - 8) * scale; int8 with one: w = q * scale + zero
    qt = QuantizedTensor(bits, group, qt.qweight, qt.scale, zero if with_zero else None, qt.shape)
    layer = QuantLinear(qt).to(dtype)
    # activations spanning many magnitudes (the int4 path pre-scales x by powers of two)
    x = (torch.randn(1, k) * torch.logspace(-6, 3, k)[torch.randperm(k)]).to(dtype)
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "c")
    got = layer(x)
    ref = quant_matmul_reference(x.float(), layer.qt)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.float() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize(
    "bits, n, k, group",
    [(4, 512, 576, 32), (4, 96, 1536, 64), (4, 33, 96, 32), (8, 512, 576, 32), (8, 7, 96, 96)],
)
def test_bf16_single_row_error_is_within_its_bound(monkeypatch, bits, n, k, group) -> None:
    """With bfloat16 x the single-row kernels sum in int16 fixed point (a power-of-two scale per
    32 columns, quant_matmul.c's gemv4i and gemv8i): each x is exact or off by at most 2^-15 of its
    block's largest |x|, so an output is off the exact product by at most that bound through
    |W| plus its own bf16 rounding; on ordinary activations nearly all outputs are exactly the
    correctly rounded product (outputs near 0 after cancellation are where they differ)."""
    if not cpu_quant.c_available():
        pytest.skip("no C compiler")
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "c")
    torch.manual_seed(k)
    layer = QuantLinear(quantize_rtn(torch.randn(n, k) * 0.1, bits, group)).to(torch.bfloat16)
    w_abs = layer.qt.dequantize(torch.float32).double().abs()
    same = []
    for _ in range(4):
        x = torch.randn(1, k).to(torch.bfloat16)
        got = layer(x).double()
        ref = quant_matmul_reference(x.double(), layer.qt)
        same.append((got == ref.to(torch.bfloat16).double()).double().mean().item())
        block_max = x.double().abs().view(-1, 32).amax(dim=1).repeat_interleave(32)
        bound = w_abs @ (block_max * 2**-15) + 1e-6 * (w_abs @ x.double().abs()[0])
        spacing = torch.ldexp(torch.ones_like(ref), torch.frexp(ref.abs() + bound).exponent - 8)
        assert ((got - ref).abs() <= bound + spacing).all()
    assert sum(same) / len(same) >= 0.97, same


def test_single_row_kernels_carry_nan_and_inf(monkeypatch) -> None:
    """A NaN or inf in x comes out as a non-finite output (never as a finite wrong number)."""
    if not cpu_quant.c_available():
        pytest.skip("no C compiler")
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "c")
    torch.manual_seed(0)
    for bits in (4, 8):
        for dtype in (torch.bfloat16, torch.float32):
            layer = QuantLinear(quantize_rtn(torch.randn(64, 128) * 0.1, bits, 32)).to(dtype)
            for bad in (float("nan"), float("inf")):
                x = torch.randn(1, 128).to(dtype)
                x[0, 77] = bad
                out = layer(x)
                assert not torch.isfinite(out).any(), (bits, dtype, bad)


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 16), (8, 32), (8, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_zero", [True, False])
def test_dequantize_rows_is_the_reference_dequantization(bits, group, dtype, with_zero) -> None:
    """The f32tiles path's C dequantization writes exactly `QuantizedTensor.dequantize`'s floats
    (a multiply then an add, no FMA), for any run of rows."""
    if not cpu_quant.c_available():
        pytest.skip("no C compiler")
    torch.manual_seed(bits + group)
    layer = QuantLinear(quantize_rtn(torch.randn(70, 192), bits, group or 192)).to(dtype)
    if not with_zero:
        layer.zero = None
    ref = layer.qt.dequantize(torch.float32)
    bits_, group_, qweight, scale, zero, sdtype = cpu_quant.c_weights(layer.kernel_weight())
    for n0, n1 in [(0, 70), (13, 14), (5, 61)]:
        out = torch.full((n1 - n0, 192), float("nan"))
        rc = cpu_quant._LIB.get().dequantize_rows(
            n0, n1, 192, bits_, group_, qweight, scale, zero, sdtype, out.data_ptr(), 2
        )
        assert rc == 0 and torch.equal(out, ref[n0:n1])


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_f32tiles_over_several_tiles_with_bias(monkeypatch, bits, group, dtype) -> None:
    """Tiles of 7 rows over 30 (the last one short): the float32 product of the dequantized
    weights, rounded once to x's dtype, with the bias."""
    if not cpu_quant.c_available():
        pytest.skip("no C compiler")
    from common.kernels import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "TILE_BYTES", 7 * 4 * 64)
    torch.manual_seed(0)
    layer = QuantLinear(quantize_rtn(torch.randn(30, 64), bits, group or 64), torch.randn(30))
    layer = layer.to(dtype)
    x = torch.randn(cpu_gemm.MIN_ROWS, 64).to(dtype)
    monkeypatch.setenv("PDSERVE_CPU_QUANT_KERNEL", "f32tiles")
    got = layer(x)
    ref = (x.float() @ layer.qt.dequantize(torch.float32).t()).to(dtype) + layer.bias
    assert got.dtype == dtype
    # float32 GEMMs of a tile or of the whole weight may sum in another order: 1e-5 relative
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    assert (got.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 32), (8, 0)])
def test_batches_from_min_rows_take_f32tiles(monkeypatch, bits: int, group: int) -> None:
    """Prefill-sized batches take the float32 GEMM over dequantized tiles; decode batches don't
    (with float activations: int8 ones take the a8 path at every batch from 2), in the fixed table
    (--kernel-choice table; auto measures: tests/common/kernels/test_tune.py)."""
    monkeypatch.setattr(cpu_quant, "activations", "float")
    monkeypatch.setattr(cpu_quant, "kernel_choice", "table")
    if not cpu_quant.c_available():
        pytest.skip("no C compiler")
    from common.kernels.cpu_gemm import MIN_ROWS

    layer = QuantLinear(quantize_rtn(torch.randn(64, 128), bits, group or 128))
    for dtype in (torch.float32, torch.bfloat16):
        lay = layer.to(dtype)
        for m, want in [(1, False), (8, False), (MIN_ROWS - 1, False), (MIN_ROWS, True)]:
            path = cpu_quant.choose(lay.kernel_weight(), torch.randn(m, 128, dtype=dtype))
            assert (path == "f32tiles") == want, (dtype, m, path)


@pytest.mark.parametrize(
    "cgroup, want_gib",
    [(None, 8), (("max", "1073741824"), 8), (("4294967296", "1073741824"), 3),
     (("1073741824", "2147483648"), 0)],
)  # fmt: skip
def test_available_memory_counts_a_cgroup_limit(tmp_path, cgroup, want_gib):
    """auto's budget reads MemAvailable, or a container's room under its cgroup limit when that
    is less ("max": no limit; usage past the limit: no room)."""
    from common.model.model_runner import available_memory_bytes

    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    if cgroup is not None:
        (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
        (tmp_path / "sys/fs/cgroup/memory.max").write_text(cgroup[0] + "\n")
        (tmp_path / "sys/fs/cgroup/memory.current").write_text(cgroup[1] + "\n")
    assert available_memory_bytes(str(tmp_path)) == want_gib << 30


def test_an_engine_makes_its_weight_copies_at_load_not_in_its_steps(tiny_llama) -> None:
    """The model runner makes every copy its batch sizes will use when it loads (up to the step's
    token budget; the LM head up to its logits rows): prompts of all sizes and a batch of
    decoding sequences then make none."""
    from common.model.quant import kernel_weights

    hf_model, _ = tiny_llama
    eng = Engine(
        EngineConfig(model="tiny", dtype="bfloat16", kv_cache_memory="8MiB", block_size=8,
                     quantization="int4", max_num_batched_tokens=256, max_num_seqs=24,
                     dense_weight_memory="1GiB"),
        hf_model.config, hf_model.state_dict().items(),
    )  # fmt: skip
    weights = [w for _, w in kernel_weights([eng.runner.model])]
    made = [set(w.derived) for w in weights]
    assert any(made)  # some paths keep copies (a8, dense, amxbf16: whichever the tune picks)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([200, 5] + [9] * 22)]
    eng.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [set(w.derived) for w in weights] == made
    cpu_quant.set_kernel_choice("auto")
