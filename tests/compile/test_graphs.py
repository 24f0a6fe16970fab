"""The compiled decoder's step functions and their compilation (``specter.compile.graphs``):
``_compile_graphs(key, cpp_wrapper)`` compiles each documented function once, on its own copy of
the code for the layout ``key``, with the options the contract states; the functions themselves
(run uncompiled, ``torch.compile`` captured) are the model's forward over its weights; dynamo
traces each one whole.

Most tests replace ``torch.compile`` with a recorder that returns the function it was given, so
nothing is compiled; the tracing test uses dynamo's ``eager`` backend (no inductor) and a single
test compiles one small piece with inductor under the module's own options."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import pytest
import torch
from torch._dynamo.utils import counters

from specter.compile import decoder_math, layout_code
from specter.compile.decoder import CompiledDecoder
from specter.compile.graphs import DecoderGraphs
from specter.testing.zoo import random_model, tiny_config

TOKENS = torch.tensor([1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3])
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 1024}

# each attribute _compile_graphs sets -> the function it compiles (a copy of it per layout)
COMPILED = {
    "_target_step": DecoderGraphs._target_graph,
    "_draft_step": DecoderGraphs._draft_graph,
    "_embed_piece": DecoderGraphs._embed_graph,
    "_layer_piece": decoder_math.attention_and_route,
    "_after_piece": decoder_math.after_experts,
    "_dense_piece": decoder_math.dense_layer,
    "_head_piece": DecoderGraphs._head_graph,
}
FUSED = ("_target_step", "_draft_step")  # the whole steps; the others are the layered path's pieces
BOUND = ("_target_step", "_draft_step", "_embed_piece", "_head_piece")  # read the decoder's weights

_keys = itertools.count()


def fresh_key(name: str) -> tuple:
    """A layout key no other decoder (of this or another test) uses: code objects of its own."""
    return ("test_graphs", name, next(_keys))


@dataclasses.dataclass(eq=False)
class Compiled:
    """What ``torch.compile`` was called with; calling it runs the function uncompiled."""

    fn: Callable
    args: tuple
    kwargs: dict[str, Any]

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@pytest.fixture
def captured(monkeypatch) -> list[Compiled]:
    """``torch.compile`` recorded, not run: the decoder's compiled attributes run their function eagerly."""
    calls: list[Compiled] = []

    def record(fn, *args, **kwargs):
        calls.append(Compiled(fn, args, kwargs))
        return calls[-1]

    monkeypatch.setattr(torch, "compile", record)
    return calls


@pytest.fixture
def eager_backend(monkeypatch) -> None:
    """``torch.compile`` through dynamo with the ``eager`` backend: the module's ``fullgraph`` and
    ``dynamic`` kept, inductor's options dropped (nothing is generated; graph breaks still raise)."""
    real = torch.compile

    def compile_eagerly(fn, *args, **kwargs):
        kwargs.pop("options", None)
        return real(fn, *args, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_eagerly)


def model_of(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    config = {"mixtral-yarn": lambda: tiny_config("mixtral", rope_parameters=YARN, head_dim=16)}.get(
        arch, lambda: tiny_config(arch))()
    config.dtype = dtype
    return random_model(config, seed=seed)


def function_of(compiled: Compiled) -> Callable:
    return getattr(compiled.fn, "__func__", compiled.fn)


def step(fn: Callable, decoder: CompiledDecoder, start: int, stop: int):
    """A fused step over ``TOKENS[start:stop]`` at their positions, on the decoder's K/V buffers."""
    kv = decoder.new_kv_cache()
    return fn(TOKENS[start:stop], torch.arange(start, stop), decoder._kv_index, kv.keys, kv.values)


def experts_calls(model) -> dict[int, list[tuple]]:
    """Hooks recording what the model's own experts receive (x [T, H], top_k_index, top_k_weights),
    by decoder layer."""
    seen: dict[int, list[tuple]] = {}
    for index, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            seen[index] = []
            layer.mlp.experts.register_forward_pre_hook(
                lambda module, args, index=index: seen[index].append(tuple(a.detach().clone() for a in args[:3])))
    return seen


# ----- _compile_graphs: what it compiles, on which code, with which options ----------------------

def test_each_documented_function_is_compiled_once_on_its_own_copy_of_the_code_for_the_key(captured):
    decoder = CompiledDecoder(model_of("mixtral"), max_len=64)
    captured.clear()
    key = fresh_key("copies")
    decoder._compile_graphs(key, False)
    assert len(captured) == len(COMPILED)
    assert {name: getattr(decoder, name) for name in COMPILED} == {
        name: next(c for c in captured if function_of(c).__qualname__ == original.__qualname__)
        for name, original in COMPILED.items()}
    codes = layout_code._codes[key]
    for name, original in COMPILED.items():
        compiled = getattr(decoder, name)
        func = function_of(compiled)
        assert func.__qualname__ == original.__qualname__ and func.__module__ == original.__module__, name
        assert func.__code__ is codes[original.__qualname__], name  # the key's copy
        assert func.__code__ is not original.__code__ and func.__code__ == original.__code__, name
        assert func.__globals__ is original.__globals__, name
        if name in BOUND:
            assert compiled.fn.__self__ is decoder, name  # reads this decoder's weights
        else:
            assert not hasattr(compiled.fn, "__self__"), name  # takes arch and weights as arguments
    assert len({id(function_of(getattr(decoder, name)).__code__) for name in COMPILED}) == len(COMPILED)


def test_decoders_compiled_for_one_key_share_its_code_and_another_key_gets_its_own(captured):
    first = CompiledDecoder(model_of("mixtral", seed=0), max_len=64)
    second = CompiledDecoder(model_of("mixtral", seed=1), max_len=64)
    shared, other = fresh_key("shared"), fresh_key("other")
    first._compile_graphs(shared, False)
    second._compile_graphs(shared, True)  # cpp_wrapper is an option, not part of the code's identity
    codes = {name: function_of(getattr(first, name)).__code__ for name in COMPILED}
    for name in COMPILED:
        assert function_of(getattr(second, name)).__code__ is codes[name], name
    for name in BOUND:  # one code, each decoder's own weights
        assert getattr(first, name).fn.__self__ is first and getattr(second, name).fn.__self__ is second
    second._compile_graphs(other, False)
    for name in COMPILED:
        assert function_of(getattr(second, name)).__code__ is not codes[name], name
        assert function_of(getattr(second, name)).__code__ == codes[name], name


def test_decoders_of_one_layout_under_other_compile_options_get_code_of_their_own(captured):
    """The decoder's key carries CUDA graphs and the C++ wrapper: dynamo would otherwise recompile
    one code object per option set against one recompile limit."""
    model = model_of("mixtral")
    plain, again = CompiledDecoder(model, max_len=64), CompiledDecoder(model, max_len=64)
    graphed = CompiledDecoder(model, max_len=64, cuda_graphs=True)
    wrapped = CompiledDecoder(model, max_len=64, cpp_wrapper=True)
    for name in COMPILED:
        code = function_of(getattr(plain, name)).__code__
        assert function_of(getattr(again, name)).__code__ is code, name
        assert function_of(getattr(graphed, name)).__code__ is not code, name
        assert function_of(getattr(wrapped, name)).__code__ is not code, name


@pytest.mark.parametrize("dtype_name, cuda_graphs, cpp_wrapper", [
    ("float32", False, False), ("float32", True, True), ("bfloat16", False, True), ("float16", True, False)])
def test_the_compile_options(captured, dtype_name, cuda_graphs, cpp_wrapper):
    """Size and alignment asserts off everywhere; inductor rounds where eager rounds for a model that
    is not float32; CUDA graphs (as the decoder says) and the C++ wrapper (as asked) for the fused
    steps only: the host runs between the pieces."""
    dtype = getattr(torch, dtype_name)
    decoder = CompiledDecoder(model_of("mixtral", dtype), max_len=64, cuda_graphs=cuda_graphs)
    captured.clear()
    decoder._compile_graphs(fresh_key("options"), cpp_wrapper)
    options = {"size_asserts": False, "alignment_asserts": False, "emulate_precision_casts": dtype != torch.float32}
    fused_options = options | {"triton.cudagraphs": cuda_graphs, "cpp_wrapper": cpp_wrapper}
    for name in COMPILED:
        compiled = getattr(decoder, name)
        expected = fused_options if name in FUSED else options
        assert compiled.args == (), name
        assert compiled.kwargs == {"fullgraph": True, "dynamic": False, "options": expected}, name
        assert compiled.kwargs["options"]["emulate_precision_casts"] is (dtype != torch.float32), name


# ----- the functions: the model's forward over its weights ---------------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "mixtral-yarn", "qwen3_moe", "olmoe", "qwen2_moe", "phimoe",
                                  "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_the_fused_target_step_is_the_models_forward(captured, arch):
    """Prefill, one decode token and a two-token verification, each a fused step on the decoder's K/V:
    float32 logits [T, V] equal to the model's own over the whole sequence, and the routing the
    StepOutput reports (per MoE layer, in order) equal to what the model's own experts receive."""
    model = model_of(arch)
    seen = experts_calls(model)
    decoder = CompiledDecoder(model, max_len=64)
    with torch.inference_mode():
        expected = model(TOKENS[None]).logits[0].float()
        outs = [step(decoder._target_step, decoder, start, stop) for start, stop in ((0, 10), (10, 11), (11, 13))]
    n_moe = len(decoder.moe_layers)
    assert list(seen) == decoder.moe_layers
    for out, (start, stop) in zip(outs, ((0, 10), (10, 11), (11, 13))):
        assert out.logits.dtype == torch.float32 and out.logits.shape == (stop - start, model.config.vocab_size)
        torch.testing.assert_close(out.logits, expected[start:stop], rtol=1e-4, atol=1e-5)
        assert out.top_k_index.shape == (n_moe, stop - start, decoder.arch.top_k)
        assert out.top_k_weights.shape == out.top_k_index.shape
        assert out.expert_inputs.shape == (n_moe, stop - start, model.config.hidden_size)
        assert out.missing is None  # the resident experts miss nothing
        for row, layer in enumerate(decoder.moe_layers):
            x, top_k_index, top_k_weights = seen[layer][0]
            assert torch.equal(out.top_k_index[row], top_k_index[start:stop]), (layer, start)
            torch.testing.assert_close(out.top_k_weights[row], top_k_weights[start:stop], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out.expert_inputs[row], x[start:stop], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v2"])
def test_the_pieces_compose_to_the_models_forward(captured, arch):
    """embed -> per layer: attention + route, then a dense layer's MLP, or the host's experts and (a
    layer with a shared expert) the after-experts piece -> head: the model's logits."""
    model = model_of(arch)
    decoder = CompiledDecoder(model, max_len=64)
    tokens, positions = TOKENS[:7], torch.arange(7)
    kv = decoder.new_kv_cache()
    used = set()
    with torch.inference_mode():
        expected = model(tokens[None]).logits[0].float()
        h, cos, sin = decoder._embed_piece(tokens, positions)
        for layer, w in enumerate(decoder.layers):
            h, x, top_k_weights, top_k_index = decoder._layer_piece(
                decoder.arch, w, kv.keys[layer], kv.values[layer], h, cos, sin, positions, decoder._kv_index)
            if w.dense is not None:
                assert top_k_index is None and top_k_weights is None
                h = decoder._dense_piece(decoder.arch, w, h, x)
                used.add("dense")
                continue
            y = decoder.expert_modules[layer](x, top_k_index, top_k_weights)
            if w.shared is None:
                h = h + y
            else:
                h = decoder._after_piece(decoder.arch, w, h, x, y)
                used.add("shared")
        logits = decoder._head_piece(h)
    assert used == {"mixtral": set(), "qwen2_moe": {"shared"}, "deepseek_v2": {"dense", "shared"}}[arch]
    assert logits.dtype == torch.float32 and logits.shape == (7, model.config.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    with torch.inference_mode():  # the fused step over the same tokens: the same logits
        fused = step(decoder._target_step, decoder, 0, 7).logits
    torch.testing.assert_close(fused, logits, rtol=1e-5, atol=1e-6)


class Experts:
    """An experts source recording its calls; ``misses`` (by decoder layer) what it says was absent."""

    def __init__(self, inner: Callable | None, misses: dict[int, bool] | None) -> None:
        self.inner, self.misses, self.layers = inner, misses, []

    def __call__(self, layer, x, top_k_index, top_k_weights):
        self.layers.append(layer)
        y = torch.zeros_like(x) if self.inner is None else self.inner(layer, x, top_k_index, top_k_weights)[0]
        if self.misses is None:
            return y, None
        return y, (top_k_index < 0).any() | self.misses[layer]  # read from the routing, as a slot table is


@pytest.mark.parametrize("misses, missing", [
    (None, None), ({1: False, 2: False}, False), ({1: False, 2: True}, True), ({1: True, 2: False}, True)])
def test_the_draft_step_runs_the_draft_experts_and_the_target_step_the_target_ones(captured, misses, missing):
    """Each fused step asks its own source for each MoE layer's experts (by decoder layer, a dense
    layer skipped); ``missing`` says whether any layer's expert was absent (None: the source never
    says)."""
    decoder = CompiledDecoder(model_of("deepseek_v3"), max_len=64)  # a dense first layer
    assert decoder.moe_layers == [1, 2]
    target = Experts(decoder.target_experts, misses)
    draft = Experts(None, misses)  # no experts at all: the draft's logits differ
    decoder.target_experts, decoder._draft_experts = target, draft
    with torch.inference_mode():
        target_out = step(decoder._target_step, decoder, 0, 3)
        assert target.layers == [1, 2] and draft.layers == []
        draft_out = step(decoder._draft_step, decoder, 0, 3)
        assert target.layers == [1, 2] and draft.layers == [1, 2]
    for out in (target_out, draft_out):
        if missing is None:
            assert out.missing is None
        else:
            assert out.missing.dtype == torch.bool and out.missing.shape == () and bool(out.missing) is missing
    assert not torch.allclose(draft_out.logits, target_out.logits)
    decoder._draft_experts = decoder.target_experts  # the same experts: the same step
    with torch.inference_mode():
        same = step(decoder._draft_step, decoder, 0, 3)
    torch.testing.assert_close(same.logits, target_out.logits, rtol=0, atol=0)


@pytest.mark.parametrize("arch, dtype_name", [("mixtral", "bfloat16"), ("phimoe", "float32")])
def test_the_head_piece_is_the_final_norm_and_lm_head_in_float32(captured, arch, dtype_name):
    """bfloat16 hidden states give float32 logits; PhiMoE's LayerNorm bias and lm_head bias are applied."""
    dtype = getattr(torch, dtype_name)
    model = model_of(arch, dtype)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for bias in (getattr(model.model.norm, "bias", None), model.lm_head.bias):  # zeros as initialised
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=generator))
    decoder = CompiledDecoder(model, max_len=64)
    h = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.inference_mode():
        logits = decoder._head_piece(h)
        expected = model.lm_head(model.model.norm(h)).float()
    assert logits.dtype == torch.float32 and logits.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch, dtype_name, tables_name", [
    ("mixtral-yarn", "float32", "float32"), ("mixtral", "bfloat16", "bfloat16"),
    ("deepseek_v2", "bfloat16", "float32")])
def test_the_embed_piece_is_the_embedding_and_the_models_rope_tables(captured, arch, dtype_name, tables_name):
    """h [T, H] from the embedding; cos and sin [T, 1, d] as the model's rotary embedding gives them
    (YaRN's attention scaling included), in the model's dtype or float32 where it rotates in float32."""
    dtype, tables = getattr(torch, dtype_name), getattr(torch, tables_name)
    model = model_of(arch, dtype)
    decoder = CompiledDecoder(model, max_len=64)
    tokens, positions = TOKENS[:5], torch.arange(3, 8)
    with torch.inference_mode():
        h, cos, sin = decoder._embed_piece(tokens, positions)
        assert torch.equal(h, model.model.embed_tokens(tokens))
        assert cos.dtype == sin.dtype == tables
        assert cos.shape == sin.shape and cos.shape[:2] == (5, 1)
        if arch != "deepseek_v2":  # DeepSeek-V2's own rotary embedding gives complex frequencies
            own_cos, own_sin = model.model.rotary_emb(h[None], positions[None])
            torch.testing.assert_close(cos, own_cos[0, :, None, :], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(sin, own_sin[0, :, None, :], rtol=1e-6, atol=1e-6)
            if arch == "mixtral-yarn":
                assert cos.abs().max() > 1.01  # the scaling is there to be missed


# ----- dynamo traces each function whole ----------------------------------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v2"])
def test_dynamo_traces_each_function_whole(eager_backend, arch):
    """Every compiled function, first called, is one graph (no break: ``fullgraph=True`` would raise)
    computing what the function computes uncompiled. DeepSeek-V2 has a dense layer and shared experts,
    so every piece runs."""
    decoder = CompiledDecoder(model_of(arch), max_len=64)
    decoder._compile_graphs(fresh_key(f"traced-{arch}"), False)
    # a draft source that reports absent experts, as a cache's does: the missing flag traced too
    decoder._draft_experts = Experts(decoder.target_experts, {layer: False for layer in decoder.moe_layers})
    breaks = sum(counters["graph_break"].values())
    first_calls = set()

    def traced(name: str, *args):
        """The compiled function's result, checked against the uncompiled one's (the same K/V writes)."""
        graphs = counters["stats"]["unique_graphs"]
        result = getattr(decoder, name)(*args)
        if name not in first_calls:
            assert counters["stats"]["unique_graphs"] == graphs + 1, name
            first_calls.add(name)
        expected = getattr(decoder, name)._torchdynamo_orig_callable(*args)
        for got, want in zip(*(r if isinstance(r, tuple) else (r,) for r in (result, expected))):
            if want is None:
                assert got is None, name
            elif isinstance(want, torch.Tensor):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            else:  # a StepOutput
                torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-6)
                assert torch.equal(got.top_k_index, want.top_k_index)
                assert (got.missing is None) == (want.missing is None) == (name == "_target_step")
        return result

    tokens, positions = TOKENS[:3], torch.arange(3)
    kv = decoder.new_kv_cache()
    with torch.inference_mode():
        for name in FUSED:
            traced(name, tokens, positions, decoder._kv_index, kv.keys, kv.values)
        h, cos, sin = traced("_embed_piece", tokens, positions)
        for layer, w in enumerate(decoder.layers):
            h, x, top_k_weights, top_k_index = traced(
                "_layer_piece", decoder.arch, w, kv.keys[layer], kv.values[layer], h, cos, sin, positions,
                decoder._kv_index)
            if w.dense is not None:
                h = traced("_dense_piece", decoder.arch, w, h, x)
                continue
            y = decoder.expert_modules[layer](x, top_k_index, top_k_weights)
            h = traced("_after_piece", decoder.arch, w, h, x, y) if w.shared is not None else h + y
        logits = traced("_head_piece", h)
    assert logits.dtype == torch.float32 and logits.shape == (3, decoder.model.config.vocab_size)
    pieces = {"_embed_piece", "_layer_piece", "_head_piece", *FUSED}
    assert first_calls == (pieces if arch == "mixtral" else pieces | {"_dense_piece", "_after_piece"})
    assert sum(counters["graph_break"].values()) == breaks


def test_inductor_compiles_the_head_piece_under_the_modules_options():
    """The real compile of one small piece, bfloat16 (precision casts emulated): float32 logits [T, V]
    equal to the uncompiled piece's."""
    decoder = CompiledDecoder(model_of("mixtral", torch.bfloat16), max_len=64)
    decoder._compile_graphs(fresh_key("inductor"), False)
    h = torch.randn(2, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.inference_mode():
        logits = decoder._head_piece(h)
        expected = decoder._head_piece._torchdynamo_orig_callable(h)
    assert logits.dtype == torch.float32 and logits.shape == (2, 256)
    torch.testing.assert_close(logits, expected, rtol=1e-2, atol=1e-2)
