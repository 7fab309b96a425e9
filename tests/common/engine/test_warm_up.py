"""Engine.warm_up: throwaway requests at start that leave no trace, and the workers' --warm-up."""

from __future__ import annotations

import pytest

from common.cli import build_parser
from common.engine import warm_up
from common.engine.engine import Engine
from common.runtime import worker_cli
from common.sampling_params import SamplingParams
from tests.common.engine.test_engine import assert_block_pool_full, make_engine, prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
@pytest.mark.parametrize("speculative", ["none", "ngram"])
def test_warm_up_leaves_counters_cache_and_output_as_a_fresh_engine_has_them(
    tiny_model, speculative
) -> None:
    _, hf_model, _ = tiny_model
    fresh = make_engine(hf_model, speculative=speculative)
    warmed = make_engine(hf_model, speculative=speculative)
    before = warmed.stats()
    assert warmed.warm_up() > 0
    assert warmed.stats() == before  # every counter and gauge, the free blocks included
    assert_block_pool_full(warmed)  # nothing running, held or cached
    assert not warmed.block_books().errors
    if speculative == "ngram":
        assert warmed.governor is not None and warmed.governor is not fresh.governor
    batch = prompts(4)
    expected = [s.output_token_ids for s in fresh.generate(batch, GREEDY)]
    assert [s.output_token_ids for s in warmed.generate(batch, GREEDY)] == expected
    # the first real requests' counters are theirs alone
    assert warmed.stats()["prefill_kv_computed_tokens_total"] == sum(len(p) for p in batch)
    assert warmed.stats() == fresh.stats()


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
def test_warm_up_prompts_are_not_cached(tiny_model) -> None:
    """Prefix caching is off while it runs: a later prompt equal to a warm-up prompt finds no
    cached block (and a worker has no KV event to send about them)."""
    _, hf_model, _ = tiny_model
    engine = make_engine(hf_model)
    seen: list[list[int]] = []
    generate = engine.generate

    def recording(batch, params):
        seen.extend(list(p) for p in batch)
        return generate(batch, params)

    engine.generate = recording
    engine.warm_up()
    engine.generate = generate
    assert seen and max(len(p) for p in seen) > 64  # a prompt step past the C layers' rows
    assert engine.block_manager.enable_prefix_caching
    engine.generate([seen[0]], GREEDY)
    assert engine.stats()["prefix_cache_hits_total"] == 0


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
@pytest.mark.parametrize("max_model_len", [8, 9, 40])
def test_warm_up_fits_short_contexts(tiny_model, max_model_len) -> None:
    _, hf_model, _ = tiny_model
    engine = make_engine(hf_model, max_model_len=max_model_len)
    before = engine.stats()
    engine.warm_up()
    assert engine.stats() == before
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].output_token_ids) == 3


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
def test_warm_up_refuses_once_requests_came(tiny_model) -> None:
    _, hf_model, _ = tiny_model
    engine = make_engine(hf_model)
    engine.add_request("r", prompts(1)[0], GREEDY)
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warm_up()


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
@pytest.mark.parametrize("flags,calls", [((), 1), (("--no-warm-up",), 0)])
def test_workers_warm_up_unless_told_not_to(tiny_model, monkeypatch, flags, calls) -> None:
    _, hf_model, _ = tiny_model
    counted: list[Engine] = []
    original = Engine.warm_up

    def counting(self: Engine) -> float:
        counted.append(self)
        return original(self)

    monkeypatch.setattr(Engine, "warm_up", counting)
    monkeypatch.setattr(worker_cli, "load_engine", lambda config: make_engine(hf_model))
    args = build_parser().parse_args(["decode", "--model", "tiny", *flags])
    engine = worker_cli.build_engine(args)
    assert len(counted) == calls and all(e is engine for e in counted)


@pytest.mark.parametrize("tiny_model", ["llama", "qwen3"], indirect=True)
def test_warm_up_runs_the_projections_at_every_padded_row_count(tiny_model, monkeypatch) -> None:
    """On the CPU the warm-up runs the first layer's projections (QKV, O, the MLP's) at every
    row count a padded step up to the token budget can take (289..1000 rows: 288 .. 1024 in
    32s), so that oneDNN has built each count's matmul before a request meets it."""
    from common.model.llama import PAD_ROWS

    _, hf_model, _ = tiny_model
    engine = make_engine(hf_model, max_num_batched_tokens=1000)
    layer = engine.runner.model.layers[0]
    seen: dict[str, list[int]] = {"qkv": [], "o": [], "mlp": []}
    for name, module in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                         ("mlp", layer.mlp)):  # fmt: skip
        forward = module.forward
        monkeypatch.setattr(
            module, "forward", lambda x, *a, f=forward, n=name: seen[n].append(x.shape[0]) or f(x)
        )
    engine.warm_up()
    want = list(range(288, 1024 + 1, PAD_ROWS))
    for name, rows in seen.items():
        padded = [n for n in rows if n > 256]
        assert padded[-len(want) :] == want, name
    # a budget past WARM_UP_MAX_ROWS builds up to it only (the rest when first met)
    monkeypatch.setattr(warm_up, "WARM_UP_MAX_ROWS", 512)
    big = make_engine(hf_model, max_num_batched_tokens=4096)
    built = []
    monkeypatch.setattr(big.runner.model, "build_padded_matmuls", built.append)
    big.warm_up()
    assert built == [512]


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
def test_warm_up_builds_the_grammar_tokenizer(tiny_model, caplog) -> None:
    """Built by a first structured request instead, it holds the interpreter lock long enough
    (0.3-1 s) to stall every running stream's step."""
    from transformers import AutoTokenizer

    from common.engine.grammar import GrammarCompiler
    from common.model.model_files import resolve_model

    _, hf_model, _ = tiny_model
    engine = make_engine(hf_model)
    hf = AutoTokenizer.from_pretrained(resolve_model("default").hf_dir)
    engine.grammars = GrammarCompiler(hf, vocab_size=engine.vocab_size)
    assert not engine.grammars.tokenizer_built
    engine.warm_up()
    assert engine.grammars.tokenizer_built

    # Without a usable tokenizer the warm-up still completes; structured requests say why.
    def no_tokenizer():
        raise OSError("no tokenizer files")

    broken = make_engine(hf_model)
    broken.grammars = GrammarCompiler(load_tokenizer=no_tokenizer)
    with caplog.at_level("INFO", logger="common.engine.warm_up"):
        assert broken.warm_up() > 0
    assert "structured outputs unavailable" in caplog.text and "no tokenizer files" in caplog.text
    assert not broken.grammars.tokenizer_built
