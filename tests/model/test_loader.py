"""Loading offloaded engines: engines of one checkpoint share one host expert store while it is
alive, and each still decodes the resident engine's greedy tokens."""

from __future__ import annotations

import gc
import weakref

from specter.build import build_engine
from specter.config import load_recipe
from specter.model import expert_layout

PROMPT = [[1, 17, 93, 4, 250, 31, 8]]


def engine(path, name: str, dtype: str = "float32"):
    offload = {"expert_budget": 0.25, "link": {"kind": "local"}}
    return build_engine(load_recipe({"model": str(path), "engine": name, "dtype": dtype, "threads": 1,
                                     "max_new_tokens": 8, "offload": offload}))


def test_offloaded_engines_of_one_checkpoint_share_its_expert_store(tiny_mixtral):
    ondemand, specter = engine(tiny_mixtral, "ondemand"), engine(tiny_mixtral, "specter")
    assert specter.store is ondemand.store
    assert ondemand.model is not specter.model and ondemand.cache is not specter.cache
    resident = engine(tiny_mixtral, "resident").generate(PROMPT).token_ids
    assert ondemand.generate(PROMPT).token_ids == resident
    assert specter.generate(PROMPT).token_ids == resident
    assert engine(tiny_mixtral, "ondemand", dtype="bfloat16").store is not ondemand.store  # another dtype: its own


def test_a_store_no_engine_holds_is_freed_and_the_next_load_builds_its_own(tiny_mixtral):
    first = engine(tiny_mixtral, "ondemand")
    gone = weakref.ref(first.store)
    first.close()
    del first
    gc.collect()
    assert gone() is None
    second = engine(tiny_mixtral, "ondemand")
    assert second.store.expert(0, 0)["down_proj"].abs().sum() > 0  # loaded again, not left empty


def test_the_layout_switch_gives_each_layout_its_own_store(tiny_mixtral, monkeypatch):
    """Engines built on each side of ``expert_layout.enabled`` never share a store: one is blocked
    (the size floor lowered for the tiny model), the other standard, and both decode alike."""
    monkeypatch.setattr(expert_layout, "BLOCKED_MIN_BYTES", 0)
    was = expert_layout.enabled()
    try:
        expert_layout.enabled(False)
        standard = engine(tiny_mixtral, "ondemand")
        expert_layout.enabled(True)
        blocked = engine(tiny_mixtral, "ondemand")
    finally:
        expert_layout.enabled(was)
    assert blocked.store is not standard.store
    assert blocked.store.blocked and not standard.store.blocked
    assert blocked.generate(PROMPT).token_ids == standard.generate(PROMPT).token_ids
