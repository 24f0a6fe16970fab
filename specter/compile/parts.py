"""The pieces the compiled decoder is assembled from: where a graph's experts come from (the
layer's own weights, cache slots through the device slot table, the INT4 draft), the measured
choice between the fused and the layered path (``PathChooser``), the static KV buffers and the
compile counters. Contract details: ``specter.compile.decoder``'s docstring."""

from __future__ import annotations

import collections
import dataclasses
import functools
import statistics
import time
from typing import Callable

import torch
from torch import Tensor, nn

from specter.compile.host_layer import layer_experts, layer_routed, layer_slots
from specter.kernels import native_rows
from specter.kernels.grouped_experts import native_grouped_experts
from specter.kernels.slot_experts import gather_biased_experts, gather_experts, slots_for
from specter.model.expert_layout import is_blocked


def _pairs_kernel(x_like: Tensor, gate_up: Tensor, down: Tensor, blocked: bool, biased: bool = False):
    """The experts kernel a graph traces: Specter's grouped native rows (each chosen expert read
    once for all its tokens; ``blocked``: the weights are stored blocked) where they serve these
    weights, else ``gather_experts`` (per pair; the standard layout only); GPT-OSS's [in, out]
    experts with biases (``biased``) through ``gather_biased_experts``, which takes the two biases
    after the other arguments."""
    if biased:
        return gather_biased_experts
    if native_rows.serves(x_like, gate_up, down):
        return functools.partial(native_grouped_experts, blocked=blocked)
    if blocked:
        raise RuntimeError("blocked experts need Specter's native kernels, which do not serve these weights")
    return gather_experts


@dataclasses.dataclass
class CompileStats:
    warmup_s: float = 0.0
    fused_steps: int = 0
    fused_misses: int = 0  # fused cache steps rerun on the layered path
    layered_steps: int = 0
    draft_steps: int = 0
    late_graphs: int = 0  # graphs compiled by steps after warm-up (recompilations)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----- expert sources of the fused step ----------------------------------------------------------

def _biased(module: nn.Module) -> bool:
    return bool(getattr(module, "has_bias", False))


class OwnExperts:
    """The layers' own stacked experts (the resident engine)."""

    def __init__(self, modules: dict[int, nn.Module]) -> None:
        self.gate_up = {layer: m.gate_up_proj for layer, m in modules.items()}  # [E, 2I, H] each
        self.down = {layer: m.down_proj for layer, m in modules.items()}  # [E, H, I] each
        # GPT-OSS's biases, after the weights (``_pairs_kernel``); none for the other layouts
        self.biases = {layer: (m.gate_up_proj_bias, m.down_proj_bias) if _biased(m) else ()
                       for layer, m in modules.items()}
        first = next(iter(modules))
        self.apply_gate = modules[first]._apply_gate
        probe = self.gate_up[first].new_zeros(1, self.gate_up[first].shape[-1])
        self.kernel = _pairs_kernel(probe, self.gate_up[first], self.down[first], is_blocked(modules[first]),
                                    _biased(modules[first]))

    def __call__(self, layer: int, x: Tensor, top_k_index: Tensor,
                 top_k_weights: Tensor) -> tuple[Tensor, Tensor | None]:
        y = self.kernel(x, top_k_index, top_k_weights, self.gate_up[layer], self.down[layer], self.apply_gate,
                        *self.biases[layer])
        return y, None


class SlotExperts:
    """Experts from the cache's slot buffers, addressed through the device ``slot_table``; with a
    ``host`` (``specter.compile.host_layer.LayerHost``), through the table row the host returns
    once it has made the layer's experts resident, or, where the host ``computes``, the host's
    output itself."""

    def __init__(self, cache, module: nn.Module, host=None) -> None:
        self.table = cache.slot_table  # [n_moe_layers, E]
        self.table_rows = cache.table_rows  # decoder layer -> row of the table
        self.gate_up = cache.slots["gate_up_proj"]  # [n_slots, 2I, H]
        self.down = cache.slots["down_proj"]  # [n_slots, H, I]
        slots = cache.slots
        self.biases = (slots["gate_up_proj_bias"], slots["down_proj_bias"]) if _biased(module) else ()
        self.apply_gate = module._apply_gate
        self.kernel = _pairs_kernel(self.gate_up.new_zeros(1, self.gate_up.shape[-1]), self.gate_up, self.down,
                                    cache.store.blocked, _biased(module))
        self.host_handle = host.handle if host is not None else None
        self.host_computes = host is not None and host.computes

    def __call__(self, layer: int, x: Tensor, top_k_index: Tensor,
                 top_k_weights: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.host_computes:
            return layer_experts(x, top_k_index, top_k_weights, layer, self.host_handle), None
        if self.host_handle is None:
            table_row = self.table[self.table_rows[layer]]
        else:
            table_row = layer_slots(x, top_k_index, top_k_weights, layer, self.host_handle, self.table.shape[1])
        slots, missing = slots_for(table_row, top_k_index)
        return self.kernel(x, slots, top_k_weights, self.gate_up, self.down, self.apply_gate, *self.biases), missing


class CompiledDraftExperts:
    """The resident INT4 draft experts (``Int4Experts.forward_static``); with a ``host``
    (``specter.compile.host_layer.LayerHost``), each layer's routing goes to the host first
    (``layer_routed``)."""

    def __init__(self, draft: dict, host=None) -> None:
        self.draft = draft  # by decoder layer
        self.host_handle = host.draft_handle if host is not None else None

    def __call__(self, layer: int, x: Tensor, top_k_index: Tensor,
                 top_k_weights: Tensor) -> tuple[Tensor, Tensor | None]:
        if self.host_handle is not None:
            x = layer_routed(x, top_k_index, top_k_weights, layer, self.host_handle)
        return self.draft[layer].forward_static(x, top_k_index, top_k_weights), None


class PathChooser:
    """Picks the faster path (``fused`` or ``layered``) for draft steps and for cache target steps
    of each width by measuring both: a fused cache step calls the host at each layer (on a CPU;
    under CUDA graphs it waits for every transfer in flight first) and reruns layered when an
    expert is missing (it reads each distinct expert once with the native grouped kernel, else
    once per (token, slot) pair), while the layered path runs the host between compiled pieces
    and reads each distinct expert once; which wins
    depends on the cache, the link and the expert size. Each width tries both paths ``TRIALS``
    times, then takes the one with the lower median of its last ``WINDOW`` step times (a median:
    one slow early step, e.g. beside a burst of copies, must not hide the faster path until the
    next recheck), trying the other path again after ``RECHECK`` steps of that width, then after
    twice as many each time the same path stays ahead (up to ``RECHECK_MAX``), or at the next step
    when the recheck's own time beat the path ahead (so its median can move). The layered
    path is the eager engine's own: it goes first, and the fused one must be ``MARGIN`` faster to
    replace it (where the two measure alike, rounds judged on noise flipped between them, each
    flip a trial that costs on a slow link; bundled model, 25% on 1 GB/s). ``trials`` counts
    the choices of a path the evidence so far says is the slower one (or not yet measured while
    the other is), so a caller timing a round can tell a trial's cost from the path's.
    ``begin_round(key)`` instead holds one choice for every step of ``key``
    until ``end_round(key, seconds_per_step)``, which judges it by a cost the caller measured over
    the round (the speculative engine's draft steps: their time plus the transfer wait they left
    to verification: a fused draft step under CUDA graphs hands its predictions over only at its end).
    ``run(key, fused, layered, waited_s)`` chooses, runs and observes a step, its time less the
    transfer wait it added to ``waited_s()``."""

    TRIALS, RECHECK, WINDOW = 3, 16, 5
    MARGIN = 0.05  # the fused path replaces the layered one when at least this much faster
    RECHECK_MAX = 256  # a recheck that keeps the same path doubles the steps to the next, up to this

    def __init__(self) -> None:
        self.trials = 0  # choices of the path known (so far) to be the slower one
        self.seconds: dict[tuple[int, str], float] = {}  # median of the last WINDOW step times
        self.counts: dict[tuple[int, str], int] = {}
        self._recent: dict[tuple[int, str], collections.deque] = {}
        self.steps: dict[int, int] = {}
        self._held: dict[int, str] = {}
        self._next_recheck: dict[int, tuple[int, int, str]] = {}  # width -> (step, interval, best then)
        self._rechecking: dict[int, str] = {}  # width -> the path a recheck chose, until observed

    def begin_round(self, key: int) -> None:
        self._held[key] = self.choose(key)

    def held(self, key: int) -> str | None:
        """The path held for ``key`` by ``begin_round`` (None outside a round)."""
        return self._held.get(key)

    def end_round(self, key: int, seconds_per_step: float) -> None:
        path = self._held.pop(key, None)
        if path is not None:
            self.observe(key, path, seconds_per_step)

    def choose(self, width: int) -> str:
        step = self.steps[width] = self.steps.get(width, 0) + 1
        fused, layered = self.counts.get((width, "fused"), 0), self.counts.get((width, "layered"), 0)
        if min(fused, layered) < self.TRIALS:
            path = "layered" if layered <= fused else "fused"
        else:
            best = "fused" if self._faster(width, "fused") else "layered"
            due, interval, before = self._next_recheck.get(width, (self.RECHECK, self.RECHECK, best))
            if best != before:  # the evidence changed sides: recheck as often as at first
                due, interval = step + self.RECHECK, self.RECHECK
            path = best
            if step >= due:
                path = self._rechecking[width] = "layered" if best == "fused" else "fused"
                interval = min(2 * interval, self.RECHECK_MAX) if best == before else self.RECHECK
                due = step + interval
            self._next_recheck[width] = (due, interval, best)
        self.trials += self._known_slower(width, path)
        return path

    def _faster(self, width: int, path: str, mine: float | None = None) -> bool:
        """Whether ``path`` (its median, or ``mine``) measured faster than the other's median, by
        ``MARGIN`` for the fused path."""
        mine = self.seconds.get((width, path)) if mine is None else mine
        theirs = self.seconds.get((width, "layered" if path == "fused" else "fused"))
        if mine is None or theirs is None:
            return mine is not None
        return mine < theirs * (1 - self.MARGIN) if path == "fused" else mine <= theirs * (1 - self.MARGIN) ** -1

    def _known_slower(self, width: int, path: str) -> bool:
        other = "layered" if path == "fused" else "fused"
        return (width, other) in self.seconds and not self._faster(width, path)

    def observe(self, width: int, path: str, seconds: float) -> None:
        if self._rechecking.pop(width, None) == path and self._faster(width, path, seconds):
            best = self._next_recheck[width][2]  # the recheck beat the path ahead: again at once
            self._next_recheck[width] = (self.steps[width] + 1, 1, best)
        key = (width, path)
        self.counts[key] = self.counts.get(key, 0) + 1
        recent = self._recent.setdefault(key, collections.deque(maxlen=self.WINDOW))
        recent.append(seconds)
        self.seconds[key] = statistics.median(recent)

    def run(self, key: int, fused: Callable[[], Tensor], layered: Callable[[], Tensor],
            waited_s: Callable[[], float] = lambda: 0.0, synchronize: Callable[[], None] = lambda: None) -> Tensor:
        """Run the path ``choose(key)`` picks and ``observe`` its time less the transfer wait the
        step added to ``waited_s()`` (a caller whose paths wait for the same copies says so: the wait
        then tells which experts were missing, not which path is faster; on a 2 GB/s link it
        swamped the difference and the choice followed the misses)."""
        path = self.choose(key)
        waited, started = waited_s(), time.perf_counter()
        result = layered() if path == "layered" else fused()
        synchronize()
        self.observe(key, path, time.perf_counter() - started - max(0.0, waited_s() - waited))
        return result

    def as_dict(self) -> dict:
        return {f"{width}:{path}": {"steps": self.counts[(width, path)], "mean_s": seconds}
                for (width, path), seconds in sorted(self.seconds.items())}


@dataclasses.dataclass
class StepOutput:
    logits: Tensor  # [T, V] float32
    top_k_index: Tensor  # [L, T, k], L the MoE layers
    top_k_weights: Tensor  # [L, T, k]
    expert_inputs: Tensor  # [L, T, H]
    missing: Tensor | None  # [] bool: a needed expert was not resident (cache source only)

    def replay(self, runtime, cache, mode: str, layers: list[int]) -> None:
        """The host side of the eager path, after the fact: ``runtime``'s observers per MoE layer
        (``layers``: their decoder indices, in order), then (a ``cache`` target step) the cache's
        bookkeeping of the experts used, all READY, hence hits."""
        if runtime is None:
            return
        account = mode == "target" and cache is not None
        for row, layer in enumerate(layers):
            top_k_index = self.top_k_index[row]
            runtime.notify(layer, self.expert_inputs[row], top_k_index, self.top_k_weights[row], mode)
            if account:
                experts = top_k_index.unique().tolist()
                cache.acquire(layer, experts)
                cache.release(layer, experts)


class StaticKV:
    """The decoder's static K/V buffers with a host-side length; crops like a DynamicCache."""

    def __init__(self, keys: list[Tensor], values: list[Tensor]) -> None:
        self.keys, self.values = keys, values  # [1, nKV, positions, d] per layer (the decoder's: max_len + 1)
        self.length = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep ``max_length`` positions; a negative value drops that many newest ones."""
        self.length = self.length + max_length if max_length < 0 else min(self.length, max_length)


def _mark_static(tensors) -> None:
    for tensor in tensors:
        if tensor is not None:
            torch._dynamo.mark_static_address(tensor)
