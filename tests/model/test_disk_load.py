"""``specter.model.disk_load``: loading a checkpoint for the disk tier without its routed experts.

``load_without_experts`` must give the model transformers loads with every dense weight equal to
the checkpoint's and every stacked expert tensor left as a meta parameter of the right shape and
dtype (no bytes), and must leave the experts modules' classes as it found them, even when the load
fails. ``reference_layer`` must return the experts module of the asked layer with the checkpoint's
own values and dtype, loading only the first ``layer + 1`` decoder layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from specter.model.disk_load import _first_layers, load_without_experts, reference_layer
from specter.model.layout import moe_layers
from specter.testing.zoo import random_model, tiny_config

torch.set_num_threads(1)


def full_load(path: str | Path, dtype: torch.dtype | str = torch.float32) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).eval()


@pytest.fixture(scope="module")
def bf16_mixtral(tmp_path_factory) -> Path:
    """A random 2-layer Mixtral saved in bfloat16 (its config says so)."""
    path = tmp_path_factory.mktemp("zoo") / "mixtral-bf16"
    random_model("mixtral", seed=5).to(torch.bfloat16).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    return path


def test_experts_stay_meta_parameters_and_every_dense_weight_is_loaded(zoo_mixtral: str) -> None:
    model = load_without_experts(Path(zoo_mixtral), torch.float32)
    reference = full_load(zoo_mixtral)
    assert not model.training
    layers = moe_layers(model)
    assert [info.layer for info in layers] == [0, 1]
    expert_names = {f"{info.experts_name}.{name}" for info in layers for name in info.param_names}
    params = dict(model.named_parameters())
    wanted = dict(reference.named_parameters())
    assert set(params) == set(wanted)  # the experts are parameters again, under their own names
    for name, param in params.items():
        assert isinstance(param, torch.nn.Parameter)
        if name in expert_names:
            assert param.device.type == "meta", name
            assert param.requires_grad is False
            assert (param.shape, param.dtype) == (wanted[name].shape, torch.float32)
        else:
            assert param.device.type == "cpu", name
            assert torch.equal(param, wanted[name]), name
    # the experts modules hold no tensor outside their parameters (no meta attribute left behind)
    for info in layers:
        assert not any(isinstance(v, torch.Tensor) for v in vars(info.experts).values())


def test_the_requested_dtype_converts_the_dense_weights_and_the_meta_experts(bf16_mixtral: Path) -> None:
    model = load_without_experts(bf16_mixtral, torch.float32)
    reference = full_load(bf16_mixtral, torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    experts = moe_layers(model)[0].experts
    assert experts.gate_up_proj.device.type == "meta" and experts.gate_up_proj.dtype == torch.float32


def test_the_experts_class_is_restored_after_loading(zoo_mixtral: str) -> None:
    init = MixtralExperts.__init__
    load_without_experts(Path(zoo_mixtral), torch.float32)
    assert MixtralExperts.__init__ is init
    fresh = random_model("mixtral", seed=0)  # a later model gets real expert parameters again
    assert fresh.model.layers[0].mlp.experts.gate_up_proj.device.type == "cpu"


def test_the_experts_class_is_restored_when_the_load_fails(zoo_mixtral: str, tmp_path: Path) -> None:
    """A checkpoint folder with a config and no weights: transformers refuses it, and the experts
    class must still construct with its own ``__init__`` afterwards."""
    shutil.copy(Path(zoo_mixtral) / "config.json", tmp_path / "config.json")
    init = MixtralExperts.__init__
    with pytest.raises(OSError):
        load_without_experts(tmp_path, torch.float32)
    assert MixtralExperts.__init__ is init


def test_reference_layer_returns_that_layers_experts_in_the_checkpoints_dtype(bf16_mixtral: Path) -> None:
    reference = full_load(bf16_mixtral, "auto")
    for layer in (0, 1):
        experts = reference_layer(bf16_mixtral, layer)
        assert isinstance(experts, MixtralExperts)
        wanted = reference.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            tensor = getattr(experts, name)
            assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu"
            assert torch.equal(tensor, getattr(wanted, name)), (layer, name)
    assert not torch.equal(reference_layer(bf16_mixtral, 0).down_proj, reference.model.layers[1].mlp.experts.down_proj)


def test_reference_layer_loads_only_the_first_layers(zoo_checkpoints, monkeypatch) -> None:
    """DeepSeek-V3's first decoder layer is dense, its first MoE layer is layer 1: asking for it
    loads a 2-layer model (of the checkpoint's 3) and returns layer 1's experts."""
    path = zoo_checkpoints["deepseek_v3"]
    loaded: list[int] = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spying(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        loaded.append(len(model.model.layers))
        return model

    reference = full_load(path)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spying))
    experts = reference_layer(Path(path), 1)
    assert loaded == [2]
    assert reference.config.num_hidden_layers == 3
    assert torch.equal(experts.gate_up_proj, reference.model.layers[1].mlp.experts.gate_up_proj)
    assert torch.equal(experts.down_proj, reference.model.layers[1].mlp.experts.down_proj)


def test_first_layers_cuts_the_per_layer_lists_and_leaves_the_config_alone() -> None:
    config = tiny_config("gpt_oss", layers=4)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    small = _first_layers(config, 3)
    assert small.num_hidden_layers == 3
    assert small.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert small.hidden_size == config.hidden_size
    assert config.num_hidden_layers == 4 and len(config.layer_types) == 4  # a copy was cut


def test_a_dense_weight_the_checkpoint_lacks_is_refused_naming_it(zoo_mixtral: str, tmp_path: Path) -> None:
    """transformers' load report is silenced here (it would list every expert key); a dense weight
    it would have called missing is refused rather than left at random values."""
    from safetensors.torch import load_file, save_file

    from specter.errors import SpecterError

    for name in Path(zoo_mixtral).iterdir():
        shutil.copy(name, tmp_path / name.name)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.self_attn.q_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecterError, match="lacks weights the model needs \\(missing: "
                                           "model.layers.0.self_attn.q_proj.weight\\)"):
        load_without_experts(tmp_path, torch.float32)


def test_experts_on_disk_load_where_the_config_names_another_dtype_than_the_tensors(tmp_path: Path) -> None:
    """float32 tensors under a config that says bfloat16 (fine-tunes saved so are common), read
    for a float32 model: the disk tier's expert 0 is compared with the reference converted as the
    model's weights are, so it loads, and its experts equal the stored ones."""
    from specter.model.loader import load_model

    model = random_model("mixtral", seed=3)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, layers, store = load_model(tmp_path, dtype=torch.float32, device=torch.device("cpu"), keep_experts_on_host=True,
                                  experts_on_disk=True, pin_memory=False, direct_io=False)
    first = layers[0].layer
    wanted = moe_layers(model)[0].experts
    for name in ("gate_up_proj", "down_proj"):
        assert torch.equal(store.standard(first)[name], getattr(wanted, name).detach()), name
