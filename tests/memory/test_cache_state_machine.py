"""A stateful property test of ExpertCache over random budgets, layers, experts and operations.

Runs three times: with a manual link whose transfers complete only when the test says (or when
waited for), so in-flight copies are observable, with the real synchronous ``local`` link, and
with the experts on disk (a safetensors file) read by the ``disk`` link's threads behind a gate
the test opens (so thread timing never changes a replay), where no expert may be read twice at
once. The machine keeps its own model of pins and counters and checks after every step that slots and keys
are one-to-one, pinned keys stay put, the slot table mirrors the host state, every READY slot and
every slot handed out by ``acquire`` holds the store's bytes, and the statistics add up.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specter.memory.cache import ExpertCache, SlotState
from specter.errors import BudgetError
from specter.memory.links import LocalLink
from specter.policies import LFUPolicy, LRUPolicy
from specter.policies.base import ExpertKey
from specter.memory.store import ExpertStore

from gated_links import SIMULATED_WAIT_S, GatedDiskLink, ManualLink

torch.set_num_threads(1)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


class CacheMachine(RuleBasedStateMachine):
    manual_link = True

    @initialize(
        n_layers=st.integers(1, 3),
        n_experts=st.integers(2, 8),
        n_slots=st.integers(1, 6),
        policy=st.sampled_from(["lru", "lfu"]),
        seed=st.integers(0, 2**16),
    )
    def build(self, n_layers: int, n_experts: int, n_slots: int, policy: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        layer_ids = [2 * i + 1 for i in range(n_layers)]  # non-contiguous, like dense-first models
        tensors = {
            layer: {
                "gate_up_proj": torch.randn(n_experts, 4, 3, generator=gen),
                "down_proj": torch.randn(n_experts, 3, 2, generator=gen),
                "gate_up_proj_bias": torch.randn(n_experts, 4, generator=gen),
            }
            for layer in layer_ids
        }
        self.store, self.link = self.make_store_and_link(tensors)
        self.cache = ExpertCache(self.store, n_slots, torch.device("cpu"), self.link,
                                 LRUPolicy() if policy == "lru" else LFUPolicy())
        self.buffers = {name: t.data_ptr() for name, t in self.cache.slots.items()}
        self.held: list[tuple[int, list[int]]] = []
        self.pins: Counter[ExpertKey] = Counter()
        self.pinned_at: dict[ExpertKey, int] = {}
        self.expected = Counter()
        self.unused_prefetches: set[ExpertKey] = set()
        self.ever_prefetched: list[ExpertKey] = []
        self.x = torch.randn(2, 3, generator=gen)

    def make_store_and_link(self, tensors):
        return ExpertStore(tensors), ManualLink() if self.manual_link else LocalLink(copy_thread=False)

    # ----- rules -------------------------------------------------------------------------------

    @rule(data=st.data())
    def acquire(self, data: st.DataObject) -> None:
        layer = data.draw(st.sampled_from(self.store.layers), label="layer")
        experts = data.draw(st.lists(st.integers(0, self.store.n_experts - 1), min_size=1,
                                     max_size=self.cache.capacity + 1), label="experts")
        self.acquire_and_check(layer, experts)

    @precondition(lambda self: any(self.cache.state(s) is SlotState.LOADING for s in range(self.cache.n_slots)))
    @rule(data=st.data())
    def acquire_a_loading_key(self, data: st.DataObject) -> None:
        loading = [self.cache.key_in(s) for s in range(self.cache.n_slots)
                   if self.cache.state(s) is SlotState.LOADING]
        self.acquire_with(data, data.draw(st.sampled_from(loading), label="loading key"))

    @precondition(lambda self: self.ever_prefetched)
    @rule(data=st.data())
    def acquire_a_once_prefetched_key(self, data: st.DataObject) -> None:
        self.acquire_with(data, data.draw(st.sampled_from(self.ever_prefetched), label="prefetched key"))

    def acquire_with(self, data: st.DataObject, key: ExpertKey) -> None:
        others = data.draw(st.lists(st.integers(0, self.store.n_experts - 1),
                                    max_size=self.cache.capacity - 1), label="others")
        self.acquire_and_check(key[0], [key[1], *others])

    def acquire_and_check(self, layer: int, experts: list[int]) -> None:
        cache = self.cache
        distinct = {(layer, e) for e in experts}
        present = {k for k in distinct if cache.contains(k)}
        in_flight = {k for k in present if not self.copy_complete(cache.slot_of(k))}
        resident = set(cache.resident_keys())
        occupied = len(set(self.pins) | present)
        should_refuse = len(distinct) > cache.capacity or len(distinct - present) > cache.n_slots - occupied
        try:
            slots = cache.acquire(layer, experts)
        except BudgetError:
            assert should_refuse, f"refused {experts} of layer {layer} with room for it"
            return
        assert not should_refuse, f"accepted {experts} of layer {layer} beyond the budget"
        self.expected["hits"] += len(present)
        self.expected["misses"] += len(distinct) - len(present)
        for key in present & self.unused_prefetches:
            self.unused_prefetches.discard(key)
            self.expected["prefetch_used"] += 1
            self.expected["prefetch_late"] += key in in_flight
        self.note_evictions(resident)
        assert len(slots) == len(experts)
        for expert, slot in zip(experts, slots):
            key = (layer, expert)
            assert cache.key_in(slot) == key and cache.state(slot) is SlotState.READY
            if self.manual_link:
                assert self.link.slot_copy_complete(slot), f"slot {slot} handed out mid-copy"
            self.check_contents(key, slot)
            weight = self.store.expert(layer, expert)["gate_up_proj"]
            assert torch.equal(self.x @ cache.slots["gate_up_proj"][slot].T, self.x @ weight.T)
        for key in distinct:
            self.pins[key] += 1
            self.pinned_at[key] = cache.slot_of(key)
        self.held.append((layer, experts))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        layer, experts = self.held.pop(data.draw(st.integers(0, len(self.held) - 1), label="which"))
        self.cache.release(layer, experts)
        for key in {(layer, e) for e in experts}:
            self.pins[key] -= 1
            if self.pins[key] == 0:
                del self.pins[key]
                del self.pinned_at[key]

    @rule(data=st.data(), score=st.floats(0, 1))
    def prefetch(self, data: st.DataObject, score: float) -> None:
        cache = self.cache
        layer = data.draw(st.sampled_from(self.store.layers), label="layer")
        expert = data.draw(st.integers(0, self.store.n_experts - 1), label="expert")
        key = (layer, expert)
        before = {k: self.copy_complete(cache.slot_of(k)) for k in cache.resident_keys()}
        protected = cache.protected_keys()
        waits = getattr(self.link, "blocked_waits", 0)
        issued = cache.prefetch(layer, expert, score)
        assert getattr(self.link, "blocked_waits", 0) == waits, "prefetch blocked on a transfer"
        after = set(cache.resident_keys())
        if key in before:
            assert not issued
        assert issued == (key in after and key not in before)
        for evicted in set(before) - after:
            assert issued, f"a refused prefetch evicted {evicted}"
            assert evicted not in self.pins and evicted not in protected
            assert before[evicted], f"prefetch evicted {evicted} mid-copy"
        self.note_evictions(set(before))
        if issued:
            self.expected["prefetch_issued"] += 1
            self.unused_prefetches.add(key)
            self.ever_prefetched.append(key)

    @rule(data=st.data())
    def protect(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.tuples(st.sampled_from(self.store.layers),
                                            st.integers(0, self.store.n_experts - 1)), max_size=4))
        self.cache.protect(keys)
        assert set(keys) <= self.cache.protected_keys()

    @rule()
    def unprotect_all(self) -> None:
        self.cache.unprotect_all()
        assert not self.cache.protected_keys()

    @precondition(lambda self: self.manual_link and self.link.pending())
    @rule(data=st.data())
    def complete_transfers(self, data: st.DataObject) -> None:
        pending = self.link.pending()
        for transfer in data.draw(st.lists(st.sampled_from(pending), min_size=1, unique_by=id)):
            transfer.complete()

    @rule()
    def poll(self) -> None:
        self.cache.poll()

    @rule()
    def drain(self) -> None:
        self.cache.drain()
        assert all(self.cache.state(s) is not SlotState.LOADING for s in range(self.cache.n_slots))

    # ----- invariants --------------------------------------------------------------------------

    def note_evictions(self, resident_before: set[ExpertKey]) -> None:
        for evicted in resident_before - set(self.cache.resident_keys()):
            self.expected["evictions"] += 1
            if evicted in self.unused_prefetches:
                self.unused_prefetches.discard(evicted)
                self.expected["prefetch_wasted"] += 1

    def copy_complete(self, slot: int) -> bool:
        if self.cache.state(slot) is SlotState.READY:
            return True
        return not self.manual_link or self.link.slot_copy_complete(slot)

    def check_contents(self, key: ExpertKey, slot: int) -> None:
        for name, tensor in self.store.expert(*key).items():
            assert torch.equal(as_bytes(self.cache.slots[name][slot]), as_bytes(tensor)), \
                f"slot {slot} does not hold {key}'s {name}"

    @invariant()
    def device_memory_is_fixed(self) -> None:
        cache = self.cache
        assert {n: t.data_ptr() for n, t in cache.slots.items()} == self.buffers
        device_bytes = sum(t.numel() * t.element_size() for t in cache.slots.values())
        assert device_bytes == cache.bytes == cache.n_slots * self.store.expert_bytes

    @invariant()
    def slots_and_keys_are_one_to_one(self) -> None:
        cache = self.cache
        keys = cache.resident_keys()
        assert len(keys) <= cache.n_slots
        occupied = [s for s in range(cache.n_slots) if cache.key_in(s) is not None]
        assert len(occupied) == len(keys)
        assert sorted(cache.key_in(s) for s in occupied) == keys
        for key in keys:
            assert cache.key_in(cache.slot_of(key)) == key
        for slot in range(cache.n_slots):
            assert (cache.key_in(slot) is None) == (cache.state(slot) is SlotState.FREE)

    @invariant()
    def pinned_keys_stay_put(self) -> None:
        cache = self.cache
        assert cache.pinned_keys() == set(self.pins)
        for key, count in self.pins.items():
            slot = cache.slot_of(key)
            assert slot == self.pinned_at[key], f"pinned {key} moved or was evicted"
            assert cache.pin_count(slot) == count and cache.state(slot) is SlotState.READY
            self.check_contents(key, slot)

    @invariant()
    def ready_slots_hold_their_expert(self) -> None:
        for slot in range(self.cache.n_slots):
            if self.cache.state(slot) is SlotState.READY:
                self.check_contents(self.cache.key_in(slot), slot)

    @invariant()
    def slot_table_mirrors_host_state(self) -> None:
        cache = self.cache
        expected = torch.full_like(cache.slot_table, -1)
        for key in cache.resident_keys():
            slot = cache.slot_of(key)
            if cache.state(slot) is SlotState.READY:
                expected[self.store.layers.index(key[0]), key[1]] = slot
        assert torch.equal(cache.slot_table, expected)

    @invariant()
    def counters_add_up(self) -> None:
        stats, cache = self.cache.stats, self.cache
        exact = ("hits", "misses", "evictions", "prefetch_issued", "prefetch_used", "prefetch_wasted")
        for name in exact + ("prefetch_late",):
            assert getattr(stats, name) == self.expected[name], f"stats.{name}"
        assert stats.hits + stats.misses == stats.acquired_keys
        assert stats.misses == stats.demand_loads
        loads = stats.demand_loads + stats.prefetch_issued
        assert stats.bytes_transferred == loads * self.store.expert_bytes
        assert loads - stats.evictions == len(cache.resident_keys())
        assert stats.prefetch_used + stats.prefetch_wasted <= stats.prefetch_issued
        assert stats.prefetch_late <= stats.prefetch_used and stats.prefetch_wasted <= stats.evictions
        if self.manual_link:
            assert abs(stats.transfer_wait_s - self.link.blocked_waits * SIMULATED_WAIT_S) < 1e-9


class LocalLinkMachine(CacheMachine):
    manual_link = False


MACHINE_SETTINGS = settings(max_examples=300, stateful_step_count=30, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])

TestCacheWithManualLink = CacheMachine.TestCase
TestCacheWithManualLink.settings = MACHINE_SETTINGS
TestCacheWithLocalLink = LocalLinkMachine.TestCase
TestCacheWithLocalLink.settings = MACHINE_SETTINGS


class DiskTierMachine(CacheMachine):
    """The same machine with the experts on disk: a safetensors file written per example, read by
    the ``disk`` link's thread pool straight into the slots (two tiers: disk below, slots above),
    each read gated so the test decides when the cache sees it finish."""

    def make_store_and_link(self, tensors):
        import tempfile
        from types import SimpleNamespace

        from safetensors.torch import save_file

        from specter.memory.disk import CheckpointIndex, DiskExperts
        from specter.memory.disk_store import DiskStore

        directory = self.directory = Path(tempfile.mkdtemp(prefix="specter-disk-machine-"))
        save_file({f"model.layers.{layer}.mlp.experts.{name}": t for layer, params in tensors.items()
                   for name, t in params.items()}, directory / "model.safetensors")
        layers = [SimpleNamespace(layer=layer, experts=SimpleNamespace(**params), param_names=tuple(params),
                                  num_experts=next(iter(params.values())).shape[0])
                  for layer, params in tensors.items()]
        disk = DiskExperts(CheckpointIndex(directory), layers, torch.float32, direct=False)
        return DiskStore(disk, layers[0].num_experts), GatedDiskLink()

    def teardown(self) -> None:
        import shutil

        if hasattr(self, "cache"):
            self.cache.drain()
            self.link.close()
            shutil.rmtree(self.directory, ignore_errors=True)


TestCacheWithDiskTier = DiskTierMachine.TestCase
TestCacheWithDiskTier.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
