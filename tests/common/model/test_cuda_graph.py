"""common/model/cuda_graph.py: padded static-buffer decode steps give the eager logits.

On the CPU the graphs are not captured (`capture=False`): the same padded buffers run eagerly,
which checks the padding, buffer reuse and slicing. With CUDA, real captured graphs replay and
must give the eager logits for every captured size.
"""

from __future__ import annotations

import pytest
import torch

from common.config import EngineConfig
from common.model.cuda_graph import DecodeGraphs, capture_sizes
from common.model.model_runner import ModelRunner

BS = 8


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]
    assert capture_sizes(0) == []


def make_runner(hf_model, device: str) -> ModelRunner:
    cfg = EngineConfig(
        model="tiny", dtype="float32", device=device, kv_cache_memory="8MiB", block_size=BS,
        max_model_len=128, gpu_memory_utilization=0.3,
    )  # fmt: skip
    return ModelRunner(cfg, hf_model.config, hf_model.state_dict().items())


def make_graphs(runner: ModelRunner, max_batch: int, query_len: int, **kw) -> DecodeGraphs:
    return DecodeGraphs(
        runner.model, max_batch=max_batch, query_len=query_len, max_model_len=128,
        block_size=BS, device=runner.device, **kw,
    )  # fmt: skip


def rows(num_seqs: int, query_len: int, seed: int) -> list:
    """Sequences with distinct blocks and random cached lengths: (tokens, start, block table)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_seqs):
        start = int(torch.randint(0, 60, (1,), generator=g))
        n_blocks = (start + query_len + BS - 1) // BS
        table = list(range(1 + i * 12, 1 + i * 12 + n_blocks))  # block 0 is never a real one
        tokens = torch.randint(2, 250, (query_len,), generator=g).tolist()
        out.append((tokens, start, table))
    return out


def fill_cache(runner: ModelRunner, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(runner.kv_cache.shape, generator=g) * 0.5
    runner.kv_cache.copy_(cache.to(runner.kv_cache.dtype))


def compare(runner: ModelRunner, graphs: DecodeGraphs, sizes: list[int], query_len: int) -> None:
    for i, num_seqs in enumerate(sizes):
        step = rows(num_seqs, query_len, seed=i)
        fill_cache(runner, seed=100 + i)
        ids, pos, meta = runner.prepare_rows(step)
        assert graphs.fits(meta)
        eager = runner.model.compute_logits(runner.model(ids, pos, meta))
        fill_cache(runner, seed=100 + i)  # the same cache (the eager run wrote the new K/V)
        got = graphs.run(ids, pos, meta).clone()
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("query_len", [1, 3])
def test_padded_buffers_match_eager_on_cpu(tiny_llama, query_len: int) -> None:
    hf_model, _ = tiny_llama
    runner = make_runner(hf_model, "cpu")
    scratch = runner.num_blocks * BS - 1  # the CPU writer needs a real slot for padding rows
    graphs = make_graphs(runner, 8, query_len, capture=False, pad_slot=scratch)
    # Sizes that pad (3 -> 4, 5 -> 8), exact sizes, and a smaller batch after a larger one
    # (stale buffer contents must not leak into the result).
    compare(runner, graphs, [1, 3, 8, 5, 2], query_len)
    ids, pos, meta = runner.prepare_rows(rows(9, query_len, seed=0))
    assert not graphs.fits(meta)  # more sequences than the largest size: eager
    ids, pos, meta = runner.prepare_rows([([5, 6], 0, [1]), ([7], 3, [2])])
    assert not graphs.fits(meta)  # ragged query lengths: eager


@pytest.mark.parametrize("query_len", [1, 3])
def test_padding_rows_write_nothing_with_the_triton_path(tiny_llama, query_len: int) -> None:
    """The GPU configuration on the CPU: Triton kernels (interpreted), padding slot -1 skipped."""
    hf_model, _ = tiny_llama
    runner = make_runner(hf_model, "cpu")
    graphs = make_graphs(runner, 4, query_len, capture=False)
    runner.model.set_attention_backend("triton")  # this model only: nothing global to restore
    compare(runner, graphs, [3, 1], query_len)
    # Padding rows left every slot outside the real rows' alone.
    fill_cache(runner, seed=7)
    before = runner.kv_cache.clone()
    ids, pos, meta = runner.prepare_rows(rows(3, query_len, seed=0))
    graphs.run(ids, pos, meta)
    written = torch.zeros(runner.num_blocks * BS, dtype=torch.bool)
    written[meta.slot_mapping] = True
    num_layers = runner.kv_cache.shape[0]
    per_slot = (runner.kv_cache != before).reshape(num_layers, 2, written.numel(), -1)
    changed = per_slot.any(-1).any(1).any(0)
    assert changed.any()  # the real rows did write
    assert not (changed & ~written).any()


def test_attention_backend_is_per_model(tiny_llama) -> None:
    """Two runners in one process keep their own backends (no module-global state)."""
    hf_model, _ = tiny_llama
    a, b = make_runner(hf_model, "cpu"), make_runner(hf_model, "cpu")
    a.model.set_attention_backend("triton")
    assert {layer.self_attn.backend for layer in a.model.layers} == {"triton"}
    assert {layer.self_attn.backend for layer in b.model.layers} == {"torch"}
    step = rows(2, 1, seed=3)
    fill_cache(a, seed=5)
    fill_cache(b, seed=5)
    logits_a = a.run(step, [1, 1])
    logits_b = b.run(step, [1, 1])
    torch.testing.assert_close(logits_a, logits_b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        a.model.set_attention_backend("nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("query_len", [1, 4])
def test_graph_replay_matches_eager_for_every_captured_size(tiny_llama, query_len: int) -> None:
    hf_model, _ = tiny_llama
    runner = make_runner(hf_model, "cuda")
    graphs = make_graphs(runner, 24, query_len)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16, 24]
    compare(runner, graphs, [1, 2, 4, 8, 16, 24, 3, 13], query_len)


def test_cpu_runner_stays_eager(tiny_llama) -> None:
    hf_model, _ = tiny_llama
    assert make_runner(hf_model, "cpu").graphs == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_engine_with_graphs_generates_what_eager_does(tiny_llama, speculative: str) -> None:
    from common.engine.engine import Engine
    from common.sampling_params import SamplingParams

    hf_model, _ = tiny_llama
    outputs = {}
    for eager in (True, False):
        cfg = EngineConfig(
            model="tiny", dtype="float32", device="cuda", block_size=BS, max_model_len=128,
            gpu_memory_utilization=0.3, enforce_eager=eager, cuda_graph_max_batch=8,
            speculative=speculative,
        )  # fmt: skip
        engine = Engine(cfg, hf_model.config, hf_model.state_dict().items())
        assert bool(engine.runner.graphs) == (not eager)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (3, 9, 17, 30, 5)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outputs[eager] = [s.output_token_ids for s in engine.generate(prompts, params)]
        assert engine.pool.num_free == engine.pool.num_blocks
    assert outputs[False] == outputs[True]
