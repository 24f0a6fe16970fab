"""Load a checkpoint for the disk tier without ever holding its routed experts in memory.

Contract: ``load_without_experts(path, dtype, trust_remote_code)`` returns the model loaded by
transformers from ``path`` with every weight in place except the routed experts' stacked
tensors, which stay on the ``meta`` device (no bytes): while transformers loads, the experts
modules' classes register no expert parameters, so the checkpoint's expert tensors are never
materialised (transformers reads safetensors lazily and skips keys the model does not have). So
a model whose experts do not fit in RAM loads in the memory of its dense weights.
A weight the dense model needs that the checkpoint lacks (or holds in another shape) is a
``SpecterError`` naming it (transformers' load report, silenced here for the experts' keys, would
only have warned, leaving it at random values).
``reference_layer(path, layer, trust_remote_code, dtype="auto")`` loads the model's first
``layer + 1`` decoder layers only, in ``dtype`` (the caller passes the dtype the experts are
stored in, so nothing is converted; ``auto`` is the config's, which the stored tensors need not
match; the rest of the checkpoint is not read; a stacked layout stays memory-mapped, so only the
pages compared are read) and returns that layer's experts module, whose expert 0 the disk tier
compares with its own reading of the checkpoint before serving it (``DiskExperts.check``).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from specter.errors import SpecterError
from specter.model.layout import expert_param_names, moe_layers
from specter.quiet import loading_quietly


@contextlib.contextmanager
def _load_report_silenced() -> Iterator[None]:
    """transformers' load report lists every key the model does not have as UNEXPECTED: here that
    is the point (experts, or the layers after the reference layer), so it is not shown."""
    from transformers.utils import logging as transformers_logging

    level = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers_logging.set_verbosity(level)


@contextlib.contextmanager
def _experts_left_out(classes: set[type]) -> Iterator[None]:
    """While open, a new instance of ``classes`` keeps its stacked expert tensors as plain meta
    attributes instead of parameters (transformers' weight init still finds them by name)."""
    originals = {cls: cls.__init__ for cls in classes}

    def leaving_out(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            for name in expert_param_names(self):
                param = self._parameters.pop(name)
                self.__dict__[name] = torch.empty(param.shape, dtype=param.dtype, device="meta")
        return __init__

    for cls, init in originals.items():
        cls.__init__ = leaving_out(init)
    try:
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


def _restore_meta_parameters(model: nn.Module, classes: set[type]) -> None:
    for module in model.modules():
        if type(module) not in classes:
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                del module.__dict__[name]
                module.register_parameter(name, nn.Parameter(value, requires_grad=False))


def load_without_experts(path: Path, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):  # only to find the experts modules' classes: no bytes
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    classes = {type(info.experts) for info in moe_layers(skeleton)}
    with loading_quietly(), _load_report_silenced(), _experts_left_out(classes):
        model, info = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code, output_loading_info=True)
    # the report is silenced for the experts' keys; a dense weight it would have called missing (or of
    # another shape) would be left at random values: refused
    for kind in ("missing_keys", "mismatched_keys"):
        keys = sorted(str(key) for key in info.get(kind) or ())
        if keys:
            listed = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
            raise SpecterError(f"model: {path} lacks weights the model needs ({kind.split('_')[0]}: {listed}); "
                               "with offload.experts_on: disk they would be left at random values")
    _restore_meta_parameters(model, classes)
    return model.eval()


def _first_layers(config, layers: int):
    """``config`` cut to its first ``layers`` decoder layers (per-layer lists cut with it)."""
    small = copy.deepcopy(config)
    total = small.num_hidden_layers
    for name, value in list(vars(small).items()):
        if isinstance(value, list) and len(value) == total:
            setattr(small, name, value[:layers])
    small.num_hidden_layers = layers
    return small


def reference_layer(path: Path, layer: int, trust_remote_code: bool = False,
                    dtype: torch.dtype | str = "auto") -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with loading_quietly(), _load_report_silenced():
        model = AutoModelForCausalLM.from_pretrained(
            path, config=_first_layers(config, layer + 1), dtype=dtype, use_safetensors=True,
            trust_remote_code=trust_remote_code)
    return next(info.experts for info in moe_layers(model) if info.layer == layer)
