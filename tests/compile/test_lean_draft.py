"""The lean draft step: the same logits, K/V and routing as the model's own forward with the INT4
experts switched in, step after step; engines use it where the model allows and say which draft
step they ran; elsewhere the model's forward drafts as before."""

from __future__ import annotations

import pytest
import torch

import specter
from specter import native
from specter.compile import lean_draft
from specter.compile.attach import compile_engine
from specter.compile.lean_draft import unsupported_reason
from specter.decode.kv import crop_to
from specter.kernels import native_rows
from specter.testing.zoo import save_random_checkpoint, tiny_config

torch.set_num_threads(1)

PROMPT = [1, 17, 93, 4, 250, 31, 8, 66, 140, 7]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lean")
    paths = {arch: str(save_random_checkpoint(arch, root / arch, seed=1, layers=3))
             for arch in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "phimoe")}
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 1024}
    paths["mixtral-yarn"] = str(save_random_checkpoint(tiny_config("mixtral", layers=3, rope_parameters=yarn, head_dim=16),
                                                       root / "mixtral-yarn", seed=1))
    clipped = tiny_config("olmoe", layers=3, clip_qkv=0.05)  # tight enough that the clamp bites
    paths["olmoe-clip"] = str(save_random_checkpoint(clipped, root / "olmoe-clip", seed=1))
    windowed = tiny_config("mixtral", layers=2, sliding_window=8)
    paths["mixtral-window"] = str(save_random_checkpoint(windowed, root / "mixtral-window", seed=1))
    return paths


def build(path: str, **extra):
    data = {"model": path, "engine": "specter", "threads": 1, "dtype": "float32", "max_new_tokens": 12,
            "offload": {"link": {"kind": "local"}, "expert_budget": 0.5},
            "speculation": {"governor": {"name": "fixed", "k": 3}}}
    data.update(extra)
    return specter.load(data)


def routing_log(engine) -> list:
    seen: list = []
    engine.runtime.observers.append(
        lambda layer, hidden, index, weights, mode: seen.append((layer, mode, hidden.clone(), index.clone(), weights.clone())))
    return seen


OP_ATTENTION = ("olmoe", "olmoe-clip", "qwen2_moe")  # no native layer half: see the test below


@pytest.mark.parametrize("arch, path", [
    (arch, path) for arch in ("mixtral", "qwen3_moe", "mixtral-yarn", *OP_ATTENTION)
    for path in ("native-layers", "native-projections", "pytorch")
    if not (arch in OP_ATTENTION and path == "native-layers")])
def test_lean_steps_match_the_models_forward_with_the_draft_experts(arch, path, checkpoints, monkeypatch):
    """OLMoE norms q and k over the whole projection (and may clip q, k and v), Qwen2-MoE has
    attention biases and a shared expert: their layers keep the op-by-op attention half."""
    whole_qk_norm = arch.startswith("olmoe")
    op_attention = arch in OP_ATTENTION
    calls = []
    native_projections = path != "pytorch"
    if native_projections:  # every projection of the tiny model through the native row kernel
        if not native.available():
            pytest.skip(f"native kernels: {native.unavailable_reason()}")
        monkeypatch.setattr(lean_draft, "NATIVE_MIN_ROWS", 1)
        for name in ("grouped_rows", "normed_rows", "draft_qkv", "draft_attend_route"):
            real = getattr(native_rows, name)
            monkeypatch.setattr(native_rows, name, lambda *args, real=real, **kw: calls.append(1) or real(*args, **kw))
    else:
        monkeypatch.setattr(native, "available", lambda: False)
    engine = build(checkpoints[arch])
    try:
        assert engine.lean_draft is not None and engine.lean_draft.native_rows == native_projections
        assert engine.lean_draft.native_layers == (native_projections and not op_attention)
        assert engine.lean_draft.arch.whole_qk_norm == whole_qk_norm
        engine.lean_draft.native_layers = path == "native-layers"
        seen = routing_log(engine)
        caches, lean_calls = [], []
        for use_lean in (False, True):
            kv = engine.new_kv_cache()
            with torch.inference_mode():
                engine.forward_logits(torch.tensor([PROMPT]), kv)
                start = len(seen)
                logits = []
                with engine.runtime.drafting():
                    for token in (5, 77, 12, 200):  # successive steps: the K/V grows between them
                        if use_lean:
                            before = len(calls)
                            logits.append(engine.lean_draft.step(token, kv))
                            lean_calls.append(len(calls) - before)
                        else:
                            logits.append(engine.forward_logits(torch.tensor([[token]]), kv)[-1])
            caches.append((kv, torch.stack(logits), seen[start:]))
        (kv_model, logits_model, routed_model), (kv_lean, logits_lean, routed_lean) = caches
        layers = engine.model.config.num_hidden_layers
        # native layers: a layer's q, k, v, then its attention through the router; the norm with the LM head.
        # Native projections: a layer's norm with q, k and v; o; its norm with the router; the LM head's
        # and a shared expert's four projections (Qwen2-MoE)
        shared = 4 * layers if arch == "qwen2_moe" else 0
        per_step = {"native-layers": 2 * layers + 1, "native-projections": 3 * layers + 1 + shared, "pytorch": 0}[path]
        assert lean_calls == [per_step] * 4
        torch.testing.assert_close(logits_lean, logits_model, rtol=1e-5, atol=1e-5)
        assert kv_lean.get_seq_length() == kv_model.get_seq_length() == len(PROMPT) + 4
        for lean_layer, model_layer in zip(kv_lean.layers, kv_model.layers):
            torch.testing.assert_close(lean_layer.keys, model_layer.keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lean_layer.values, model_layer.values, rtol=1e-5, atol=1e-6)
        assert len(routed_lean) == len(routed_model) == 4 * engine.model.config.num_hidden_layers
        for (layer, mode, hidden, index, weights), (layer2, mode2, hidden2, index2, weights2) in zip(routed_lean, routed_model):
            assert (layer, mode) == (layer2, mode2) and mode == "draft"
            assert torch.equal(index, index2)
            torch.testing.assert_close(hidden, hidden2, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(weights, weights2, rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ("mixtral", "qwen3_moe"))
def test_steps_ahead_of_the_cache_hold_their_kv_beside_it_with_the_same_logits(arch, checkpoints):
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    engine = build(checkpoints[arch])
    try:
        step = engine.lean_draft
        assert step.native_layers
        kv = engine.new_kv_cache()
        with torch.inference_mode(), engine.runtime.drafting():
            engine.forward_logits(torch.tensor([PROMPT]), kv)
            for first_round in (True, False):  # a second round after the cache grew, past the buffers' first size
                tokens = [5, 77, 12, 200] if first_round else [9, 3, 44, 18, 250, 61, 7, 30, 2, 90, 11, 6, 8, 71, 4, 19, 23]
                base = kv.get_seq_length()
                appended = torch.stack([step.step(token, kv) for token in tokens])
                crop_to(kv, base)
                beside = torch.stack([step.step(token, kv, ahead=i) for i, token in enumerate(tokens)])
                assert kv.get_seq_length() == base  # the cache is left as it was
                torch.testing.assert_close(beside, appended, rtol=1e-6, atol=1e-6)
                engine.forward_logits(torch.tensor([tokens[:3]]), kv)
    finally:
        engine.close()


def test_a_cropped_cache_is_written_again_at_the_same_positions(checkpoints):
    engine = build(checkpoints["mixtral"])
    try:
        kv = engine.new_kv_cache()
        with torch.inference_mode(), engine.runtime.drafting():
            engine.forward_logits(torch.tensor([PROMPT]), kv)
            first = engine.lean_draft.step(42, kv)
            engine.lean_draft.step(43, kv)
            crop_to(kv, len(PROMPT))
            again = engine.lean_draft.step(42, kv)
        assert torch.equal(first, again)
    finally:
        engine.close()


def test_engines_draft_with_the_lean_step_and_stay_lossless(checkpoints):
    path = checkpoints["qwen3_moe"]
    resident = specter.load({"model": path, "engine": "resident", "threads": 1, "dtype": "float32", "max_new_tokens": 12})
    try:
        expected = resident.generate([PROMPT]).token_ids
    finally:
        resident.close()
    engine = build(path)
    try:
        result = engine.generate([PROMPT])
    finally:
        engine.close()
    assert result.token_ids == expected
    assert result.report["draft"]["step"] == "lean"
    assert result.report["phases"]["draft_steps"] > 0


@pytest.mark.parametrize("name, reason", [("phimoe", "LayerNorms"),
                                          ("mixtral-window", "sliding attention window")])
def test_other_models_draft_through_their_own_forward(name, reason, checkpoints):
    engine = build(checkpoints[name])
    try:
        assert engine.lean_draft is None
        assert reason in unsupported_reason(engine.model, engine.runtime)
        assert engine.generate([PROMPT]).report["draft"]["step"] == "model"
    finally:
        engine.close()


@pytest.mark.parametrize("native_layers", [True, False])
def test_a_routing_only_step_routes_and_caches_as_a_full_step_without_logits(native_layers, checkpoints, monkeypatch):
    engine = build(checkpoints["mixtral"])
    try:
        engine.lean_draft.native_layers = native_layers and engine.lean_draft.native_layers
        seen = routing_log(engine)
        computed: list[int] = []
        forward = engine.runtime.forward
        monkeypatch.setattr(engine.runtime, "forward", lambda layer, *rest: computed.append(layer) or forward(layer, *rest))
        runs = []
        for logits in (True, False):
            kv = engine.new_kv_cache()
            with torch.inference_mode(), engine.runtime.drafting():
                engine.forward_logits(torch.tensor([PROMPT]), kv)
                start, computed[:] = len(seen), []
                out = engine.lean_draft.step(42, kv, logits=logits)
            runs.append((out, kv.get_seq_length(), seen[start:], kv.layers[0].keys.clone(), list(computed)))
        (full, full_len, full_seen, full_keys, full_computed), (none, none_len, none_seen, none_keys, none_computed) = runs
        # the last layer's experts feed only the LM head's input: a routing-only step leaves them out
        assert full_computed == [0, 1, 2] and none_computed == [0, 1]
        assert full is not None and full.shape == (engine.model.config.vocab_size,) and none is None
        assert full_len == none_len == len(PROMPT) + 1
        assert len(none_seen) == len(full_seen) == 3  # every MoE layer's routing, as the full step
        for a, b in zip(full_seen, none_seen):
            assert a[0] == b[0] and a[1] == b[1] == "draft" and torch.equal(a[3], b[3]) and torch.equal(a[2], b[2])
        assert torch.equal(full_keys, none_keys)
    finally:
        engine.close()


def test_on_the_compiled_decoders_static_cache_it_writes_and_reads_as_on_a_transformers_cache(checkpoints):
    from specter.compile.parts import StaticKV

    engine = build(checkpoints["mixtral"])
    try:
        config = engine.model.config
        heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        shape = (1, heads, 64, head_dim)
        static = StaticKV([torch.zeros(shape) for _ in range(config.num_hidden_layers)],
                          [torch.zeros(shape) for _ in range(config.num_hidden_layers)])
        dynamic = engine.new_kv_cache()
        with torch.inference_mode(), engine.runtime.drafting():
            for token in PROMPT:  # both caches filled by the lean step itself
                expected = engine.lean_draft.step(token, dynamic)
                got = engine.lean_draft.step(token, static)
            assert static.get_seq_length() == dynamic.get_seq_length() == len(PROMPT)
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
            for layer, cached in enumerate(dynamic.layers):
                torch.testing.assert_close(static.keys[layer][:, :, :len(PROMPT)], cached.keys, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(static.values[layer][:, :, :len(PROMPT)], cached.values, rtol=1e-6, atol=1e-6)
    finally:
        engine.close()


def test_a_compiled_engine_on_a_cpu_drafts_with_the_lean_step_and_compiles_no_draft_graph(checkpoints):
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    path = checkpoints["mixtral"]
    resident = specter.load({"model": path, "engine": "resident", "threads": 1, "dtype": "float32", "max_new_tokens": 12})
    try:
        expected = resident.generate([PROMPT]).token_ids
    finally:
        resident.close()
    engine = build(path)
    try:
        step = engine.lean_draft
        assert isinstance(step, lean_draft.LeanDraftStep)
        compile_engine(engine, max_k=3)
        assert engine.compiled.lean_step is step and engine.lean_draft is None
        graph_calls: list = []
        engine.compiled._draft_step = lambda *args: graph_calls.append(args)  # a draft graph run would land here
        result = engine.generate([PROMPT])
    finally:
        engine.close()
    assert result.token_ids == expected
    assert result.report["draft"]["step"] == "lean" and result.report["phases"]["draft_steps"] > 0
    # the fused verification graph computed these small experts from the slots itself: no kernel time is claimed
    assert engine.runtime.layers_computed_in_graph > 0 and result.report["phases"]["verify_kernel_s"] is None
    assert graph_calls == [] and result.report["compile"]["late_graphs"] == 0


@pytest.mark.parametrize("cache", ["static", "ahead"])
def test_a_whole_layer_in_one_native_call_gives_the_three_calls_bits_and_tells_the_observers(cache, checkpoints,
                                                                                          monkeypatch):
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    from specter.compile.parts import StaticKV

    engine = build(checkpoints["mixtral"])
    try:
        step = engine.lean_draft
        config = engine.model.config
        layers = config.num_hidden_layers
        fused_calls: list[int] = []
        real = native_rows.draft_layer
        monkeypatch.setattr(native_rows, "draft_layer", lambda *a, **kw: fused_calls.append(1) or real(*a, **kw))
        seen = routing_log(engine)
        runs = []
        for fused in (False, True):
            step.fused_layers = fused
            fused_calls[:] = []
            if cache == "static":
                shape = (1, config.num_key_value_heads, 64, config.hidden_size // config.num_attention_heads)
                kv = StaticKV([torch.zeros(shape) for _ in range(layers)], [torch.zeros(shape) for _ in range(layers)])
            else:
                kv = engine.new_kv_cache()
            with torch.inference_mode(), engine.runtime.drafting():
                for token in PROMPT[:3]:
                    step.step(token, kv)  # a transformers cache: appended, never fused
                start = len(seen)
                tokens = [5, 77, 12]
                logits = [step.step(token, kv, ahead=i if cache == "ahead" else None) for i, token in enumerate(tokens)]
                assert step.step(200, kv, logits=False, ahead=3 if cache == "ahead" else None) is None
            written = len(PROMPT[:3]) + 4 if cache == "static" else 4  # positions the steps wrote
            held = [t[:, :, :written].clone() for t in (kv.keys + kv.values if cache == "static"
                                                         else [b for pair in step._beside for b in pair])]
            runs.append((torch.stack(logits), held, seen[start:], len(fused_calls)))
        (old_logits, old_kv, old_seen, old_calls), (new_logits, new_kv, new_seen, new_calls) = runs
        # on a static cache every step is fused (the prompt's too); the routing-only step's last layer computes no experts
        assert old_calls == 0 and new_calls == (6 if cache == "static" else 3) * layers + (layers - 1)
        assert torch.equal(new_logits, old_logits)
        assert all(torch.equal(a, b) for a, b in zip(new_kv, old_kv))
        assert len(new_seen) == len(old_seen) == 4 * layers
        for a, b in zip(new_seen, old_seen):
            assert a[:2] == b[:2] and a[1] == "draft"
            assert all(torch.equal(x, y) for x, y in zip(a[2:], b[2:]))
    finally:
        engine.close()
