"""common/kernels/cpu_qgemm.py: the int8-activation GEMM against two references.

1. Exact: x quantized the kernel's way (`quantize_activations`), each block's integer sum in
   float64 (exact: |sum| < 2^24), then the scales: the kernel's float32 steps differ from it by
   rounding only: a product of three (scale, scale, sum) per block term and a running sum over
   the K / 32 blocks, so at most (K / 32 + 4) * 2^-24 of the sum of the terms' magnitudes
   (measured: 2.7e-7 of it here, the bound 9.5e-7). One activation code rounded the other way
   would already be ~1e-6: the check also pins the kernel's rounding of x to torch's.
2. Float: F.linear(x, the dequantized weight). Rounding x to xs * xq moves each x_j by at most
   xs_b / 2 (xs_b = max_b |x| / 127), so the outputs differ by at most
   sum_b xs_b / 2 * sum_{j in b} |w_j|, plus float32 rounding (and bfloat16 output rounding).
Every ISA section the host runs is built (through $PDSERVE_CPU_ISA) and checked the same way.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.kernels import cpu_qgemm
from common.model.quant import QuantizedTensor, quantize_rtn

if not cpu_qgemm.available():
    pytest.skip("the int8-activation GEMM could not be built", allow_module_level=True)

K, N = 384, 40  # N: two whole panels and a part one
FORMATS = [(4, 32, True), (4, 64, True), (4, 128, True), (4, 32, False), (4, 128, False),
           (8, K, False), (8, 32, False), (8, 32, True)]  # fmt: skip
ROWS = (1, 3, 16, 64, 130)


def weight(bits: int, group: int, zero: bool, n: int = N, k: int = K) -> QuantizedTensor:
    qt = quantize_rtn(
        torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)), bits, group
    )
    if zero and qt.zero is None:
        qt.zero = 0.01 * torch.randn(qt.scale.shape, generator=torch.Generator().manual_seed(1))
    if not zero:
        qt.zero = None
    return qt


def pack(qt: QuantizedTensor) -> cpu_qgemm.PackedWeight:
    return cpu_qgemm.pack(qt.kernel_weight())


def activations(m: int, dtype: torch.dtype, k: int = K) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[:, 7] *= 20  # an outlier channel, as LLM activations have
    return x.to(dtype)


def exact_reference(x: torch.Tensor, qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, magnitude): out from the kernel's activation rounding in float64, magnitude the sum
    of its block terms' absolute values (the scale of the kernel's float32 rounding)."""
    m, k = x.shape
    n = qt.shape[0]
    codes, xs = cpu_qgemm.quantize_activations(x)
    kb = k // cpu_qgemm.BLOCK
    w = qt.unpack().to(torch.float64) - (8 if qt.bits == 4 else 0)
    isum = torch.einsum("mbj,nbj->mnb", codes.double().view(m, kb, -1), w.view(n, kb, -1))
    per_block = qt.group_size // cpu_qgemm.BLOCK
    scale = qt.scale.double().repeat_interleave(per_block, dim=1)
    terms = isum * xs.double()[:, None, :] * scale[None]
    if qt.zero is not None:
        xsum = codes.double().view(m, kb, -1).sum(-1) * xs.double()
        zero = qt.zero.double().repeat_interleave(per_block, dim=1)
        terms = terms + xsum[:, None, :] * zero[None]
    return terms.sum(-1), terms.abs().sum(-1)


def float_bound(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """max over the rounding of x: sum_b xs_b / 2 * sum_{j in b} |w_j| per output."""
    _, xs = cpu_qgemm.quantize_activations(x)
    half_step = (xs / 2).repeat_interleave(cpu_qgemm.BLOCK, dim=1).double()
    return half_step @ qt.dequantize().abs().double().T


def check(out: torch.Tensor, x: torch.Tensor, qt: QuantizedTensor) -> None:
    assert out.dtype == x.dtype and out.shape == (x.shape[0], qt.shape[0])
    got = out.double()
    bf16 = 2.0**-8 if x.dtype == torch.bfloat16 else 0.0  # the output's own rounding
    ref, magnitude = exact_reference(x, qt)
    float32 = (x.shape[1] // cpu_qgemm.BLOCK + 4) * 2.0**-24
    tol = float32 * magnitude + bf16 * ref.abs() + 1e-30
    assert ((got - ref).abs() <= tol).all(), (got - ref).abs().max()
    dense = F.linear(x.float(), qt.dequantize()).double()
    size = x.float().abs().double() @ qt.dequantize().abs().double().T
    bound = float_bound(x, qt) + 1e-5 * size + bf16 * dense.abs()
    assert ((got - dense).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bits,group,zero", FORMATS)
def test_matches_both_references(bits, group, zero, m, dtype):
    qt = weight(bits, group, zero)
    x = activations(m, dtype)
    check(cpu_qgemm.matmul_a8(x, pack(qt)), x, qt)


SECTIONS = {"portable": "portable", "avx2": "avx2", "avxvnni": "avxvnni",
            "avx512vnni": "avx512vnni", "amx": "amx"}  # fmt: skip


@pytest.mark.parametrize("level", SECTIONS)
@pytest.mark.parametrize("bits,group,zero", [(4, 32, True), (4, 128, False), (8, K, False)])
def test_each_isa_section(level, bits, group, zero, monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_ISA", level)
    lib = cpu_qgemm.new_library()
    if not lib.available() or cpu_qgemm.isa(lib) != SECTIONS[level]:
        pytest.skip(f"no {level} build on this host")
    qt = weight(bits, group, zero)
    packed = pack(qt)
    for m in (1, 5, 9, 35, 130):  # every row tail of the 8-, 6- (two-panel) and 4-row tiles
        for dtype in (torch.float32, torch.bfloat16):
            x = activations(m, dtype)
            check(cpu_qgemm.matmul_a8(x, packed, lib), x, qt)


@pytest.mark.parametrize("level", SECTIONS)
def test_row_passes_give_the_same_bits(level, monkeypatch):
    # rows in passes of a few (a prefill's many rows, so that a pass's codes stay in L2): each
    # row's sums are the same whatever the passes, tails included (7 and 12 rows: not multiples
    # of the 6- and 8-row tiles; 1: every row its own pass)
    monkeypatch.setenv("PDSERVE_CPU_ISA", level)
    lib = cpu_qgemm.new_library()
    if not lib.available() or cpu_qgemm.isa(lib) != SECTIONS[level]:
        pytest.skip(f"no {level} build on this host")
    c = lib.get()
    assert c.qgemm_set_row_block(-1) == 1
    assert c.qgemm_row_block(576) >= 48  # from L2's size, at least 48
    for bits, group, zero in [(4, 32, True), (8, 32, False)]:
        qt = weight(bits, group, zero)
        packed = pack(qt)
        for dtype in (torch.float32, torch.bfloat16):
            x = activations(130, dtype)
            x[40, 3] = float("nan")  # a NaN row inside a later pass
            whole = cpu_qgemm.matmul_a8(x, packed, lib)
            try:
                for rows in (1, 7, 12):
                    assert c.qgemm_set_row_block(rows) == 0 and c.qgemm_row_block(576) == rows
                    passes = cpu_qgemm.matmul_a8(x, packed, lib)
                    assert torch.equal(passes.isnan(), whole.isnan()) and whole[40].isnan().all()
                    assert torch.equal(passes.nan_to_num(), whole.nan_to_num())
            finally:
                c.qgemm_set_row_block(0)
            check(whole[torch.arange(130) != 40], x[torch.arange(130) != 40], qt)


@pytest.mark.parametrize("bits,group,zero", FORMATS)
def test_amx_gives_the_avx512_vnni_bits(bits, group, zero, monkeypatch):
    # the tile unit makes the same exact int32 block sums and the same float steps follow, in the
    # same order: whole tiles of 16 rows (from 32 rows on) and the rows past them, NaN rows too
    amx = cpu_qgemm.new_library()
    if not amx.available() or cpu_qgemm.isa(amx) != "amx":
        pytest.skip("no amx build on this host (no AMX, or the kernel refused the tile state)")
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx512bf16")
    vnni = cpu_qgemm.new_library()
    assert cpu_qgemm.isa(vnni) == "avx512vnni"
    # the tile path runs (same bits either way, so the equality alone would not show it)
    amx_rows = amx.get().qgemm_amx_rows
    assert [amx_rows(m) for m in (16, 31, 32, 33, 47, 64, 130)] == [0, 0, 32, 32, 32, 64, 128]
    assert vnni.get().qgemm_amx_rows(130) == 0
    qt = weight(bits, group, zero)
    packed = pack(qt)
    for m in (16, 31, 32, 33, 47, 64, 130):
        for dtype in (torch.float32, torch.bfloat16):
            x = activations(m, dtype)
            x[m // 2, 3] = float("nan")
            out, ref = cpu_qgemm.matmul_a8(x, packed, amx), cpu_qgemm.matmul_a8(x, packed, vnni)
            assert torch.equal(out.isnan(), ref.isnan()), (m, dtype)
            assert torch.equal(out.nan_to_num(0.0), ref.nan_to_num(0.0)), (m, dtype)
            assert out[m // 2].isnan().all() and not out[0].isnan().any()


def test_strided_and_float16_inputs():
    qt = weight(4, 32, True)
    packed = pack(qt)
    wide = activations(6, torch.float32, 2 * K)
    x = wide[:, :K]  # a row stride of 2K
    assert torch.equal(cpu_qgemm.matmul_a8(x, packed), cpu_qgemm.matmul_a8(x.contiguous(), packed))
    half = cpu_qgemm.matmul_a8(x.half(), packed)
    assert half.dtype == torch.float16
    check(cpu_qgemm.matmul_a8(x.half().float(), packed), x.half().float(), qt)


def test_zero_and_nonfinite_rows():
    qt = weight(8, 32, False)
    packed = pack(qt)
    x = activations(4, torch.float32)
    x[1] = 0
    x[2, 100] = float("nan")
    x[3, 5] = float("inf")
    out = cpu_qgemm.matmul_a8(x, packed)
    assert torch.equal(out[1], torch.zeros(N))
    assert out[2].isnan().all() and out[3].isnan().all()
    assert torch.isfinite(out[0]).all()


def test_tails_refused_cleanly():
    # N need not be a multiple of the panel; K and the group must be whole blocks of 32
    qt = weight(4, 32, True, n=3, k=64)
    x = activations(5, torch.float32, 64)
    check(cpu_qgemm.matmul_a8(x, pack(qt)), x, qt)
    assert not cpu_qgemm.supports(4, 16, 48) and not cpu_qgemm.supports(8, 48, 96)
    with pytest.raises(ValueError, match="multiples of 32"):
        pack(quantize_rtn(torch.randn(8, 48), 4, 16))
    with pytest.raises(ValueError, match="columns"):
        cpu_qgemm.matmul_a8(torch.randn(2, 96), pack(qt))
    assert cpu_qgemm.matmul_a8(torch.randn(0, 64), pack(qt)).shape == (0, 3)


def test_bfloat16_scales_are_read_exactly():
    qt = weight(4, 64, True)
    qt16 = QuantizedTensor(4, 64, qt.qweight, qt.scale.bfloat16(), qt.zero.bfloat16(), qt.shape)
    x = activations(7, torch.float32)
    ref = QuantizedTensor(4, 64, qt.qweight, qt16.scale.float(), qt16.zero.float(), qt.shape)
    assert torch.equal(cpu_qgemm.matmul_a8(x, pack(qt16)), cpu_qgemm.matmul_a8(x, pack(ref)))


def gguf_like(qt: QuantizedTensor) -> QuantizedTensor:
    """`qt` with float16 scales and (int4) zero = a float16 minimum + 8 * scale in float32, as
    common/model/weights.py makes a GGUF Q4_1 weight's (Q4_0 / Q8_0: no zero)."""
    scale = qt.scale.to(torch.float16).to(torch.float32)
    if qt.zero is not None:
        low = (qt.zero - 8 * qt.scale).to(torch.float16).to(torch.float32)
        qt.zero = low + 8 * scale
    qt.scale = scale
    return qt


def float32_panels(qt: QuantizedTensor) -> cpu_qgemm.PackedWeight:
    """The same weight with its scales and zeros in float32 in the panel layout (format 0)."""
    half = pack(qt)
    panels = half.codes.shape[0]

    def per_panel(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t.float(), (0, 0, 0, panels * cpu_qgemm.PANEL - qt.shape[0]))
        return t.view(panels, cpu_qgemm.PANEL, -1).permute(0, 2, 1).contiguous()

    zero = None if qt.zero is None else per_panel(qt.zero)
    return cpu_qgemm.PackedWeight(
        half.bits, half.group_size, half.n, half.k, half.codes, per_panel(qt.scale), zero
    )


@pytest.mark.parametrize("level", SECTIONS)
@pytest.mark.parametrize("form", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits,group,zero", [(4, 32, True), (4, 64, False), (8, 32, False)])
def test_16_bit_scales_give_the_same_bits(level, form, bits, group, zero, monkeypatch):
    # 16-bit scales and zeros stream 2.5 bytes a block of 32 weights fewer; where they give back
    # every one exactly (a GGUF weight's float16 ones, a bfloat16 model's), the results equal the
    # float32 panels'
    monkeypatch.setenv("PDSERVE_CPU_ISA", level)
    lib = cpu_qgemm.new_library()
    if not lib.available() or cpu_qgemm.isa(lib) != SECTIONS[level]:
        pytest.skip(f"no {level} build on this host")
    qt = weight(bits, group, zero)
    if form == "float16":
        qt = gguf_like(qt)
    else:
        qt.scale = qt.scale.to(torch.bfloat16)
        qt.zero = None if qt.zero is None else qt.zero.to(torch.bfloat16)
    half, full = pack(qt), float32_panels(qt)
    assert half.scale.dtype == getattr(torch, form)
    assert half.scale_format == {"float16": 1, "bfloat16": 2}[form]
    assert half.nbytes < full.nbytes
    for m in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = activations(m, dtype)
            out = cpu_qgemm.matmul_a8(x, half, lib)
            assert torch.equal(out, cpu_qgemm.matmul_a8(x, full, lib)), (m, dtype)
            check(out, x, qt)


def test_half_scales_only_where_exact():
    qt = weight(4, 32, True)  # round-to-nearest scales: not float16 values
    assert cpu_qgemm.sixteen_bit_scales(qt.kernel_weight()) is None
    assert pack(qt).scale_format == 0
    qt = gguf_like(weight(4, 32, True))
    assert pack(qt).scale_format == 1
    qt.zero[0, 0] += 2.0**-20  # one zero no float16 minimum gives back
    assert pack(qt).scale_format == 0
    qt = gguf_like(weight(8, 32, False))
    qt.zero = 0.01 * torch.ones_like(qt.scale)  # an int8 zero has no minimum form
    assert pack(qt).scale_format == 0
    qt.scale, qt.zero = qt.scale.to(torch.bfloat16), qt.zero.to(torch.bfloat16)
    assert pack(qt).scale_format == 2  # bfloat16 ones are kept as they are
