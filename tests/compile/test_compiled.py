"""Compiled engines (``compile: true``): same greedy tokens as the eager resident engine, zero graph
breaks in the fused steps, and no recompilation after warm-up whatever k and the sequence do.

Models are tiny random Mixtrals (2 MoE layers, 16 experts top-2, hidden 64, GQA 4/2 heads), so
that inductor compiles quickly; the graphs are shared by every engine of the same shapes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._dynamo.utils import counters

import specter
from specter import native
from specter.decode.governor import Governor
from specter.compile import host_layer
from specter.compile.attach import compile_engine
from specter.compile.decoder import CompiledDecoder, StaticKV, unsupported_reason
from specter.errors import SpecterError
from specter.model import expert_layout
from specter.kernels.slot_experts import gather_experts, slots_for
from specter.testing.marks import needs_native
from specter.testing.zoo import random_model, save_random_checkpoint, tiny_config

torch.set_num_threads(1)

PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3, 9, 120, 44, 19, 23, 77, 5], [1, 200, 5, 77, 12]]
MAX_NEW = 24


def recipe(path: str, engine: str, compile: bool, budget: float = 0.25, k: int = 4, link: dict | None = None) -> dict:
    return {"model": path, "engine": engine, "max_new_tokens": MAX_NEW, "threads": 1, "compile": compile,
            "offload": {"link": link or {"kind": "local"}, "expert_budget": budget},
            "speculation": {"governor": {"name": "fixed", "k": k}}}


@pytest.fixture(scope="module")
def eager_resident(zoo_mixtral) -> list[list[int]]:
    return specter.load(recipe(zoo_mixtral, "resident", compile=False)).generate(PROMPTS).token_ids


@pytest.mark.slow
def test_compiled_resident_matches_eager(zoo_mixtral, eager_resident):
    engine = specter.load(recipe(zoo_mixtral, "resident", compile=True))
    report = engine.generate(PROMPTS).report
    assert [o["token_ids"] for o in report["outputs"]] == eager_resident
    compiled = report["compile"]
    assert compiled["enabled"] and compiled["warmup_s"] > 0
    assert compiled["fused_steps"] > 0 and compiled["late_graphs"] == 0
    assert sum(counters["graph_break"].values()) == 0


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["ondemand", "specter", "router-lookahead"])
def test_compiled_offloaded_engines_match_eager(zoo_mixtral, eager_resident, engine_name):
    # synchronous copies: with a copy thread, which prefetch finds room depends on when copies end
    synchronous = {"kind": "local", "options": {"copy_thread": False}}
    # k = 3: a verification's 4 tokens x top-2 fit the 8 slots, so it may take the fused graph
    eager = specter.load(recipe(zoo_mixtral, engine_name, compile=False, k=3, link=synchronous))
    eager_report = eager.generate(PROMPTS).report
    engine = specter.load(recipe(zoo_mixtral, engine_name, compile=True, k=3, link=synchronous))
    report = engine.generate(PROMPTS).report
    assert [o["token_ids"] for o in report["outputs"]] == eager_resident
    assert report["compile"]["late_graphs"] == 0
    # fused steps do the cache bookkeeping live (host calls) or replay it: the same hits, misses and loads as eager
    for key in ("hits", "misses", "demand_loads", "evictions"):
        assert report["cache"]["decode"][key] == eager_report["cache"]["decode"][key], key
    if engine_name == "specter":
        assert report["compile"]["fused_steps"] > 0
        # on a CPU with the native kernels the lean step drafts; elsewhere the draft graph
        assert (engine.compiled.lean_step is not None) == native.available()
        assert report["draft"]["step"] == ("lean" if native.available() else "compiled")
        assert (report["compile"]["draft_steps"] > 0) == (not native.available())
    if engine_name == "router-lookahead":  # its predictor acts between layers: inside the graph's host calls
        assert report["compile"]["fused_steps"] > 0 and report["compile"]["layered"] is False
    eager.close()
    engine.close()


@pytest.mark.slow
@needs_native
@pytest.mark.parametrize("computes", ["graph", "host"])
def test_compiled_engines_read_blocked_experts_losslessly(zoo_mixtral, eager_resident, computes, monkeypatch,
                                                          tmp_path):
    """With the blocked layout's size floor lowered, compiled ``resident`` (its own modules in the
    graph) and compiled ``specter`` (the slots through the table in the graph, or computed by the
    host at each layer) give the standard layout's tokens, after graphs of the same shapes were
    compiled for the standard layout (the layout is part of what the graphs trace). The model is
    the module's zoo_mixtral saved again elsewhere (the same weights), so no standard host store of
    an earlier test is shared; the graphs' caches are reset after, so the two layouts' graphs do
    not count against later tests' recompile limit."""
    standard = specter.load(recipe(zoo_mixtral, "resident", compile=True))
    assert [o["token_ids"] for o in standard.generate(PROMPTS).report["outputs"]] == eager_resident
    standard.close()
    again = str(save_random_checkpoint("mixtral", tmp_path / "mixtral", seed=0, hidden=64, intermediate=64, layers=2))
    monkeypatch.setattr(expert_layout, "BLOCKED_MIN_BYTES", 0)
    if computes == "host":
        monkeypatch.setattr(host_layer, "COMPUTES_MIN_BYTES", 0)
    synchronous = {"kind": "local", "options": {"copy_thread": False}}
    try:
        for engine_name in ("resident", "specter"):
            engine = specter.load(recipe(again, engine_name, compile=True, k=3, link=synchronous))
            report = engine.generate(PROMPTS).report
            assert report["expert_layout"] == "blocked"
            assert [o["token_ids"] for o in report["outputs"]] == eager_resident, engine_name
            assert report["compile"]["fused_steps"] > 0 and report["compile"]["late_graphs"] == 0
            engine.close()
    finally:
        torch._dynamo.reset()


class CyclingGovernor(Governor):
    """Drafts k from a fixed cycle (exercises every verification length)."""

    name = "cycling"

    def __init__(self, ks: list[int]) -> None:
        self._ks = itertools.cycle(ks)

    def next_k(self) -> int:
        return next(self._ks)

    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        pass


@pytest.mark.parametrize("draft", ["lean", "graph"])
def test_no_recompilation_after_warm_up(zoo_mixtral, draft):
    """256 new tokens with k cycling through 1..32 (wider than the fused step: layered), prompts of two lengths, cache misses and
    hits, the sequence crossing many attention spans: not one graph compiled after warm-up, no
    graph break, and the eager resident engine's greedy tokens. Drafting with the lean step (a
    CPU's default) and with the draft graph (taken where no lean step serves)."""
    if draft == "lean" and not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    resident = specter.load(recipe(zoo_mixtral, "resident", compile=False))
    resident.eos_token_id = None
    expected = resident.generate(PROMPTS, max_new_tokens=256).token_ids
    # a link whose copies overlap compute: rounds run the routing-only draft step, so verification
    # finds every expert predicted and the fused graph runs (on `local` the layered one does)
    link = {"kind": "emulated", "gbps": 50.0, "latency_us": 1}
    engine = specter.load(recipe(zoo_mixtral, "specter", compile=False, budget=0.25, link=link))
    engine.governor = CyclingGovernor([1, 3, 16, 2, 7, 32, 12, 5, 20, 9, 4])
    engine.eos_token_id = None  # random weights may emit EOS; run the full length
    if draft == "graph":
        engine.lean_draft = None
    decoder = compile_engine(engine, max_k=32)
    graphs = counters["stats"]["unique_graphs"]
    report = engine.generate(PROMPTS, max_new_tokens=256).report
    assert counters["stats"]["unique_graphs"] == graphs
    assert report["compile"]["late_graphs"] == 0
    assert [o["token_ids"] for o in report["outputs"]] == expected
    assert set(report["k"]["histogram"]) >= {"1", "3", "16", "32", "12", "20"}
    assert decoder.stats.fused_steps > 0
    drafting_rounds = sum(n for k, n in report["k"]["histogram"].items() if int(k))
    judged_rounds = sum(decoder.chooser.counts.get((0, path), 0) for path in ("fused", "layered"))
    if draft == "graph":
        assert report["draft"]["step"] == "compiled" and decoder.stats.draft_steps > 0
        assert judged_rounds == drafting_rounds  # the draft graph against its layered path, judged per round
    else:
        assert report["draft"]["step"] == "lean" and decoder.stats.draft_steps == 0 and judged_rounds == 0
    assert report["cache"]["decode"]["evictions"] > 0  # the slot table changed under the graphs
    assert sum(counters["graph_break"].values()) == 0
    engine.close()


def test_a_model_the_math_does_not_cover_is_refused_saying_what_is_missing():
    model = random_model(tiny_config("qwen2_moe", use_sliding_window=True))
    with pytest.raises(SpecterError, match="compile: true cannot compile this model: .*use_sliding_window.*"
                                           "set compile: false"):
        CompiledDecoder(model)


@pytest.mark.parametrize("engine_name", ["resident", "specter"])
def test_a_sequence_filling_the_whole_static_kv_cache_decodes_to_the_eager_tokens(engine_name, tmp_path):
    """A model of 128 positions (the static KV cache's max_len, a multiple of span_step): prompts
    whose length plus max_new_tokens is exactly 128, prefilled below the last span and within it,
    decode compiled to the eager tokens. The last span reads every position; with K/V buffers
    exactly that long, dynamo specialised the span's dynamic dimension and the step raised
    ConstraintViolationError, though the context check had let the prompt through."""
    path = save_random_checkpoint(tiny_config("mixtral", max_position_embeddings=128), tmp_path / "m128", seed=0)
    cases = [(list(range(3, 103)), 28), (list(range(200, 140, -1)), 68), (list(range(2, 129)), 1)]
    eager = specter.load(recipe(str(path), "resident", compile=False))
    eager.eos_token_id = None  # random weights may emit EOS; fill the context
    expected = [eager.generate([prompt], max_new_tokens=n).token_ids[0] for prompt, n in cases]
    engine = specter.load(recipe(str(path), engine_name, compile=True, k=4))
    engine.eos_token_id = None
    assert engine.compiled.max_len == 128
    for (prompt, n), tokens in zip(cases, expected):
        report = engine.generate([prompt], max_new_tokens=n).report
        assert report["outputs"][0]["token_ids"] == tokens and len(tokens) == n
        assert report["compile"]["late_graphs"] == 0
    engine.close()


def test_a_sequence_past_the_static_kv_cache_is_refused_before_decoding(zoo_mixtral):
    """A model of 4096 positions compiles with a 2048-position static KV cache: the compiled
    engine's context length is the cache's, so a 2040-token prompt with 20 new tokens (which fits
    the model) is refused before any token, naming that cache (it failed mid-way: compiled
    ``specter``'s draft steps ran past the cache into a native RuntimeError), while one filling the
    cache exactly decodes to the eager engine's tokens."""
    prompt = [(7 * i) % 250 + 3 for i in range(2040)]
    eager = specter.load(recipe(zoo_mixtral, "resident", compile=False))
    eager.eos_token_id = None
    expected = eager.generate([prompt], max_new_tokens=8).token_ids[0]
    engine = specter.load(recipe(zoo_mixtral, "specter", compile=True, k=4))
    engine.eos_token_id = None
    assert engine.compiled.max_len == engine.context_length == 2048 < eager.context_length
    streamed = []
    with pytest.raises(SpecterError, match=r"2060 positions exceed the compiled decoder's \(its static KV cache\) "
                                           r"context length 2048"):
        engine.generate([prompt], max_new_tokens=20, on_tokens=lambda index, ids: streamed.append(list(ids)))
    assert streamed == []
    assert engine.generate([prompt], max_new_tokens=8).token_ids[0] == expected
    engine.close()


def test_static_kv_crops_like_a_dynamic_cache():
    kv = StaticKV([torch.zeros(1, 2, 8, 4)], [torch.zeros(1, 2, 8, 4)])
    kv.length = 6
    kv.crop(-2)
    assert kv.get_seq_length() == 4
    kv.crop(7)
    assert kv.get_seq_length() == 4
    kv.crop(3)
    assert kv.get_seq_length() == 3


def test_gather_experts_matches_per_pair_math():
    torch.manual_seed(0)
    gate_up, down = torch.randn(6, 8, 4), torch.randn(6, 4, 4)  # [N, 2I, H], [N, H, I]
    x, ids = torch.randn(3, 4), torch.tensor([[0, 5], [2, 2], [4, 1]])
    weights = torch.rand(3, 2)

    def gate(h):
        g, u = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    expected = torch.stack([
        sum(weights[t, j] * (down[ids[t, j]] @ gate(gate_up[ids[t, j]] @ x[t])) for j in range(2)) for t in range(3)
    ])
    torch.testing.assert_close(gather_experts(x, ids, weights, gate_up, down, gate), expected)
    slots, missing = slots_for(torch.tensor([3, -1, 0]), torch.tensor([[0, 2], [2, 0]]))
    assert slots.tolist() == [[3, 0], [0, 3]] and not missing
    assert bool(slots_for(torch.tensor([3, -1, 0]), torch.tensor([[1, 2]]))[1])


YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("rope, refused", [
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, False),
    ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 32}, False),
    (YARN, False),
    ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, True)])
def test_rope_whose_frequencies_are_fixed_at_load_compiles(rope, refused):
    model = random_model(tiny_config("mixtral", rope_parameters=rope, head_dim=16))
    reason = unsupported_reason(model)
    assert (reason is not None) == refused
    if refused:
        assert "rope type 'dynamic'" in reason and "sequence length" in reason


def longrope_phimoe(original: int, positions: int):
    """A tiny PhiMoE with longrope RoPE (short factors 1.5, long 2.0) switching past ``original`` tokens."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.5] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": original, "short_mscale": 1.0, "long_mscale": 1.0}
    return tiny_config("phimoe", rope_parameters=rope, max_position_embeddings=positions)


def test_longrope_compiles_where_every_sequence_keeps_its_short_factors():
    assert unsupported_reason(random_model(longrope_phimoe(4096, 8192))) is None  # the decoder holds 2048
    reason = unsupported_reason(random_model(longrope_phimoe(1024, 4096)))
    assert "rope type 'longrope'" in reason and "sequence length" in reason


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "qwen2_moe", "mixtral-yarn", "phimoe", "phimoe-longrope",
                                  "deepseek_v2", "deepseek_v3", "deepseek_v3-plain", "gpt_oss"])
def test_other_layouts_compile_to_the_eager_tokens(arch, tmp_path):
    """Qwen3-MoE (per-head q/k norms), OLMoE (q/k norms over the whole projection; the lean draft
    step then attends op by op) and Qwen2-MoE (attention biases, a sigmoid-gated shared expert, no
    sliding window though its config holds one), a Mixtral with YaRN RoPE (frequencies and attention
    scaling fixed at load), PhiMoE (LayerNorms with biases, the sparsemixer router; drafting through
    the compiled draft graph), a PhiMoE with longrope within its short factors' range, DeepSeek-V2
    (latent attention with low-rank queries, a group-limited softmax router, a dense first layer,
    an unscaled shared expert) and DeepSeek-V3 (a biased sigmoid over expert groups; interleaved
    RoPE, and plain RoPE with full-rank queries and no dense layer, where the lean draft step
    declines and the draft graph runs) and GPT-OSS (attention sinks, sliding windows in every other
    layer, a biased top-k-then-softmax router, [in, out] experts with biases and interleaved gate/up
    columns read per pair): compiled ``resident`` and ``specter`` give eager
    ``resident``'s tokens, with no graph compiled after warm-up (each layout's graphs apart:
    ``specter.compile.layout_code``)."""
    config = {"mixtral-yarn": lambda: tiny_config("mixtral", rope_parameters=YARN, head_dim=16),
              "phimoe-longrope": lambda: longrope_phimoe(4096, 8192),
              "deepseek_v3-plain": lambda: tiny_config("deepseek_v3", rope_interleave=False, q_lora_rank=None,
                                                       first_k_dense_replace=0),
              }.get(arch, lambda: tiny_config(arch))()
    path = str(save_random_checkpoint(config, tmp_path / arch, seed=0))
    eager = specter.load(recipe(path, "resident", compile=False)).generate(PROMPTS).token_ids
    for engine_name in ("resident", "specter"):
        engine = specter.load(recipe(path, engine_name, compile=True, k=3))
        report = engine.generate(PROMPTS).report
        assert [o["token_ids"] for o in report["outputs"]] == eager, engine_name
        assert report["compile"]["fused_steps"] > 0 and report["compile"]["late_graphs"] == 0
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_a_bfloat16_model_compiles_to_the_eager_tokens_with_its_roundings_kept(arch, tmp_path):
    """In bfloat16 the graphs round intermediates where eager rounds them (inductor's
    ``emulate_precision_casts``, on for a model that is not float32): without it, both tiny
    DeepSeeks' compiled ``resident`` left eager ``resident``'s tokens within 24."""
    path = str(save_random_checkpoint(tiny_config(arch), tmp_path / arch, seed=0))
    eager = specter.load({**recipe(path, "resident", compile=False), "dtype": "bfloat16"}).generate(PROMPTS).token_ids
    engine = specter.load({**recipe(path, "resident", compile=True), "dtype": "bfloat16"})
    report = engine.generate(PROMPTS).report
    assert [o["token_ids"] for o in report["outputs"]] == eager
    assert report["compile"]["late_graphs"] == 0
    engine.close()


@pytest.mark.slow
def test_any_number_of_cache_sizes_compile_in_one_process(zoo_mixtral, eager_resident):
    """A bench sweeps budgets in one process: each cache size is a layout with graphs of its own.
    Nine sizes on one code object hit dynamo's recompile limit (8) and the ninth engine failed with
    ``FailOnRecompileLimitHit`` (a bench of 3 budgets compiled did, across its engines)."""
    for eighths in range(1, 10):
        engine = specter.load(recipe(zoo_mixtral, "ondemand", compile=True, budget=eighths / 16,
                                     link={"kind": "local", "options": {"copy_thread": False}}))
        report = engine.generate(PROMPTS).report
        assert [o["token_ids"] for o in report["outputs"]] == eager_resident, eighths
        assert report["compile"]["late_graphs"] == 0
        engine.close()


@pytest.mark.parametrize("engine_name", [pytest.param("ondemand", marks=pytest.mark.slow), "specter"])
def test_the_cuda_shaped_cache_path_keeps_the_eager_tokens_on_a_cpu(zoo_mixtral, eager_resident, engine_name):
    """What a CUDA device runs (the GPU tests' path, which CI never has): no host call from a graph,
    so a fused cache step drains the link, reruns layered when an expert is missing and replays the
    cache's bookkeeping after; ``specter`` drafts through the compiled draft graph. On a CPU with
    ``cuda_graphs=True``: eager ``resident``'s tokens, the same cache bookkeeping as the eager
    engine, misses rerun layered, no graph after warm-up."""
    synchronous = {"kind": "local", "options": {"copy_thread": False}}
    eager = specter.load(recipe(zoo_mixtral, engine_name, compile=False, k=3, link=synchronous))
    eager_report = eager.generate(PROMPTS).report
    engine = specter.load(recipe(zoo_mixtral, engine_name, compile=False, k=3, link=synchronous))
    engine.lean_draft = None  # as on CUDA, where the native row kernels do not serve
    decoder = compile_engine(engine, cuda_graphs=True)
    assert decoder.cuda_graphs and not decoder.host_layers and decoder.lean_step is None
    report = engine.generate(PROMPTS).report
    assert [o["token_ids"] for o in report["outputs"]] == eager_resident
    for key in ("hits", "misses", "demand_loads", "evictions"):
        assert report["cache"]["decode"][key] == eager_report["cache"]["decode"][key], key
    stats = engine.cache.stats
    assert stats.hits + stats.misses == stats.acquired_keys
    compiled = report["compile"]
    assert compiled["late_graphs"] == 0 and compiled["fused_misses"] > 0
    if engine_name == "specter":
        assert report["draft"]["step"] == "compiled" and compiled["draft_steps"] > 0 and compiled["fused_steps"] > 0
    eager.close()
    engine.close()
