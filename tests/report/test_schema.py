"""The report schema (``specter.report/1``) and its text rendering, on stand-in engines: every key
is present, derived figures follow from the counters, what does not apply is null."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specter.decode.engine import GenerationResult
from specter.memory.links import EmulatedLink
from specter.report.metrics import GenerationMetrics
from specter.report.schema import REPORT_KEYS, SCHEMA, build_report, format_summary
from specter.testing.zoo import random_model

torch.set_num_threads(1)

# The keys ../shared/DESIGN.md promises to programs outside the repository.
DESIGN_KEYS = (
    "engine", "model", "device", "dtype", "link", "expert_budget", "device_bytes", "prompts", "prompt_tokens",
    "new_tokens", "ttft_s", "decode_tokens_per_s", "wall_s", "acceptance_rate", "mean_accepted_per_step", "k",
    "hit_rate", "prefetch_precision", "bytes_transferred", "transfer_wait_s", "io_wait_share", "lossless",
    "outputs", "threads", "versions",
)


def test_report_keys_cover_the_design():
    assert "schema" in REPORT_KEYS and SCHEMA == "specter.report/1"
    assert set(DESIGN_KEYS) <= set(REPORT_KEYS)
    assert len(set(REPORT_KEYS)) == len(REPORT_KEYS)


@pytest.fixture(scope="module")
def model():
    return random_model("mixtral", layers=2, n_experts=4)


class StandIn:
    """The attributes ``build_report`` reads from an engine, and a chosen ``engine_report``."""

    def __init__(self, model, extra: dict | None = None, store=None, link=None) -> None:
        self.name = "stand-in"
        self.model = model
        self.model_path = "/models/x"
        self.device = torch.device("cpu")
        self.sampling = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0)
        self.extra = extra or {}
        if store is not None:
            self.store = store
        if link is not None:
            self.link = link

    def engine_report(self) -> dict:
        return dict(self.extra)


def speculative_metrics() -> GenerationMetrics:
    metrics = GenerationMetrics()
    metrics.observe_prefill(10, 0.5)
    metrics.observe_prefill(6, 0.25)
    for k, accepted, seconds in [(4, 4, 0.1), (4, 1, 0.1), (2, 0, 0.2)]:
        metrics.observe_decode_step(accepted + 1, seconds)
        metrics.observe_draft(k, accepted)
    metrics.wall_s = 2.0
    return metrics


RESULT = GenerationResult(texts=["a", "b"], token_ids=[[5, 6, 7], [8]], prompt_ids=[[1] * 10, [1] * 6])


def test_build_report_from_counters(model):
    report = build_report(StandIn(model), speculative_metrics(), RESULT)
    assert set(REPORT_KEYS) <= set(report)
    assert report["schema"] == SCHEMA and report["engine"] == "stand-in"
    assert report["model"] == {"arch": "mixtral", "path": "/models/x", "n_layers": 2, "n_moe_layers": 2,
                               "n_experts": 4, "top_k": 2, "expert_bytes": report["model"]["expert_bytes"]}
    experts = model.model.layers[0].mlp.experts
    assert report["model"]["expert_bytes"] == sum(p[0].numel() * p.element_size() for p in experts.parameters())
    assert (report["prompts"], report["prompt_tokens"], report["new_tokens"]) == (2, 16, 2 + 5 + 2 + 1)
    assert report["ttft_s"] == pytest.approx(0.375)
    assert report["decode_tokens_per_s"] == pytest.approx(8 / 0.4)
    assert report["acceptance_rate"] == pytest.approx(5 / 10)
    assert report["mean_accepted_per_step"] == pytest.approx((5 + 3) / 3)
    assert report["k"] == {"mean": pytest.approx(10 / 3), "histogram": {"2": 1, "4": 2}}
    assert report["outputs"] == [{"text": "a", "token_ids": [5, 6, 7], "prompt_tokens": 10},
                                 {"text": "b", "token_ids": [8], "prompt_tokens": 6}]
    # an engine without a cache or link: those figures are null, not zero
    for key in ("link", "hit_rate", "prefetch_precision", "bytes_transferred", "transfer_wait_s", "io_wait_share",
                "copies_per_token", "lossless", "expert_budget", "device_bytes"):
        assert report[key] is None, key
    assert report["threads"] == torch.get_num_threads()
    json.dumps(report)


def test_plain_decoding_has_no_speculation_figures(model):
    metrics = GenerationMetrics()
    metrics.observe_prefill(4, 0.1)
    metrics.observe_decode_step(1, 0.05)
    report = build_report(StandIn(model), metrics, RESULT)
    assert report["acceptance_rate"] is None and report["mean_accepted_per_step"] is None and report["k"] is None
    assert report["decode_tokens_per_s"] == pytest.approx(20.0)


def test_derived_io_figures(model):
    store = SimpleNamespace(expert_bytes=1000)
    link = EmulatedLink(gbps=2.0, latency_us=20.0)
    extra = {"transfer_wait_s": 0.1, "decode_bytes_transferred": 16_000, "bytes_transferred": 20_000, "hit_rate": 0.5}
    metrics = speculative_metrics()  # 0.4 s of decode, 8 decode tokens
    report = build_report(StandIn(model, extra, store=store, link=link), metrics, RESULT)
    link.close()
    assert report["model"]["expert_bytes"] == 1000  # taken from the store when there is one
    assert report["link"] == {"kind": "emulated", "gbps": 2.0, "latency_us": 20.0, "emulated": True}
    assert report["io_wait_share"] == pytest.approx(0.1 / 0.4)
    assert report["copies_per_token"] == pytest.approx(16 / 8)
    extra["transfer_wait_s"] = 5.0  # more wait than decode time (waits during prefill): capped
    assert build_report(StandIn(model, extra, store=store, link=link), metrics, RESULT)["io_wait_share"] == 1.0


def test_format_summary_renders_full_and_sparse_reports(model):
    sparse = build_report(StandIn(model), speculative_metrics(), RESULT)
    text = format_summary(sparse)
    assert "stand-in" in text and "mixtral (2 MoE layers x 4 experts, top-2)" in text
    lines = text.splitlines()
    assert any(line.startswith("expert budget") and line.rstrip().endswith("-") for line in lines)
    assert any(line.startswith("lossless") and line.rstrip().endswith("-") for line in lines)
    full = dict(sparse, expert_budget={"experts": 8, "bytes": 8192, "fraction": 0.5},
                link={"kind": "emulated", "gbps": 2.0, "latency_us": 20.0, "emulated": True},
                hit_rate=0.75, lossless=True, transfer_wait_s=0.1, io_wait_share=0.25)
    text = format_summary(full)
    assert "8 experts, 8,192 bytes, 50%" in text
    assert "emulated 2.0 GB/s 20.0 us (emulated)" in text
    assert any(line.startswith("lossless") and line.rstrip().endswith("True") for line in text.splitlines())
    assert any(line.startswith("hit rate") and "0.75" in line for line in text.splitlines())
    governed = dict(full, governor={"name": "roofline", "prediction_error": 0.171, "prediction_total_error": 0.044})
    assert any(line.startswith("governor") and line.rstrip().endswith("roofline (17.1% median, 4.4% total)")
               for line in format_summary(governed).splitlines())
    governed["governor"].update(prediction_k=24, prediction_rounds=4)  # the width the errors are of
    assert any(line.startswith("governor") and line.rstrip().endswith("roofline (at k = 24, 4 rounds: 17.1% median, "
                                                                       "4.4% total)")
               for line in format_summary(governed).splitlines())


def test_the_summary_counts_slow_memory_only_where_the_process_timed_any(model):
    report = build_report(StandIn(model), speculative_metrics(), RESULT)
    assert set(report["page_placement"]) >= {"pieces", "slow", "swapped"}
    quiet = dict(report, page_placement={"regions": 0, "pieces": 0, "slow": 0, "swapped": 0})
    assert "slow memory" not in format_summary(quiet)
    timed = dict(report, page_placement={"regions": 9, "pieces": 120, "slow": 5, "swapped": 4})
    lines = format_summary(timed).splitlines()
    expected = "4 of 5 slow 8 MiB pieces (of 120 timed)"
    assert any(line.startswith("slow memory swapped") and line.rstrip().endswith(expected) for line in lines)
    none_slow = dict(report, page_placement={"regions": 9, "pieces": 120, "slow": 0, "swapped": 0})
    assert "none slow of 120 8 MiB pieces timed" in format_summary(none_slow)


def test_every_link_entry_carries_the_design_keys(model):
    """DESIGN's ``link`` is {kind, gbps, latency_us, emulated: bool}: a link (or an engine's own
    entry, as hf-offload's reads) that leaves some out gets them as None (``emulated`` False)."""
    reads = {"kind": "accelerate-disk-offload", "io": "O_DIRECT", "bytes_read": 0}
    report = build_report(StandIn(model, {"link": reads}), speculative_metrics(), RESULT)
    assert report["link"] == {"kind": "accelerate-disk-offload", "gbps": None, "latency_us": None, "emulated": False,
                              "io": "O_DIRECT", "bytes_read": 0}
    assert list(report["link"])[:4] == ["kind", "gbps", "latency_us", "emulated"]
    terse = SimpleNamespace(describe=lambda: {"kind": "plugin-link", "gbps": 3.0, "emulated": 1, "transfers": 7})
    report = build_report(StandIn(model, link=terse), speculative_metrics(), RESULT)
    assert report["link"] == {"kind": "plugin-link", "gbps": 3.0, "latency_us": None, "emulated": True, "transfers": 7}
    assert report["link"]["emulated"] is True
    assert "plugin-link 3.0 GB/s (emulated)" in format_summary(report)  # no "None us"


def test_hit_rate_is_null_where_no_decode_step_looked_an_expert_up(model):
    """An engine that reports a rate of 0.0 over zero lookups (as ``CacheStats.hit_rate`` did before
    stop 73, and as a plugin engine still may): the report says null."""
    prefill_only = GenerationMetrics()  # max_new_tokens=1: the prefill's token, no decode step
    prefill_only.observe_prefill(4, 0.1)
    idle = {"hit_rate": 0.0, "transfer_wait_s": 0.0, "bytes_transferred": 4000, "decode_bytes_transferred": 0,
            "cache": {"decode": {"acquired_keys": 0, "hits": 0, "misses": 0}}}
    report = build_report(StandIn(model, idle), prefill_only, RESULT)
    assert report["hit_rate"] is None and report["io_wait_share"] is None and report["copies_per_token"] is None
    assert report["bytes_transferred"] == 4000 and report["transfer_wait_s"] == 0.0  # measured: kept
    # decode steps that looked nothing up (a stand-in's cache counters): null too; some lookups: kept
    assert build_report(StandIn(model, idle), speculative_metrics(), RESULT)["hit_rate"] is None
    busy = dict(idle, hit_rate=0.75, cache={"decode": {"acquired_keys": 8, "hits": 6, "misses": 2}})
    assert build_report(StandIn(model, busy), speculative_metrics(), RESULT)["hit_rate"] == 0.75


def test_the_summary_says_which_figures_are_of_the_decode(model):
    report = build_report(StandIn(model), speculative_metrics(), RESULT)
    lines = format_summary(report).splitlines()
    assert any(line.startswith("transfer wait / share of decode time") and line.rstrip().endswith("  -")
               for line in lines)  # no transfers at all: a dash, not "- s / -"
    assert any(line.startswith("hit rate (decode)") for line in lines)
    waited = dict(report, transfer_wait_s=0.1, io_wait_share=0.25, copies_per_token=2.0)
    lines = format_summary(waited).splitlines()
    assert any(line.startswith("transfer wait / share of decode time") and line.rstrip().endswith("0.1 s / 0.25")
               for line in lines)
    assert any(line.startswith("expert copies per decode token") and line.rstrip().endswith("2")
               for line in lines)


def test_real_engines_report_the_design_keys(tiny_mixtral):
    """End to end through ``specter.load``: an ondemand run without decode steps has a null hit
    rate, and hf-offload's link entry (its accelerate reads) carries every DESIGN link key."""
    import specter

    base = {"model": str(tiny_mixtral), "device": "cpu", "dtype": "float32", "threads": 1,
            "offload": {"expert_budget": 0.25, "link": {"kind": "local"}}}
    with specter.load(dict(base, engine="ondemand", max_new_tokens=1)) as engine:
        report = engine.generate([[1, 17, 93, 4, 250]]).report
    assert report["new_tokens"] == 1 and report["hit_rate"] is None
    assert report["cache"]["decode"]["acquired_keys"] == 0
    assert report["link"]["kind"] == "local" and report["link"]["emulated"] is False
    with specter.load(dict(base, engine="hf-offload", max_new_tokens=3)) as engine:
        report = engine.generate([[1, 17, 93, 4, 250]]).report
    assert set(report) >= set(DESIGN_KEYS)
    assert report["offload"]["tier"] == "disk"  # a quarter of the experts on device: accelerate reads the rest
    assert list(report["link"])[:4] == ["kind", "gbps", "latency_us", "emulated"], report["link"]
    assert report["link"]["kind"] == "accelerate-disk-offload" and report["link"]["emulated"] is False


def test_the_summary_says_where_the_rounds_time_went(model):
    """A speculative run's summary has a row of the rounds' phases (shares of their time, the
    verification's transfer wait among them, the mean draft step); a plain run has none."""
    report = build_report(StandIn(model), speculative_metrics(), RESULT)
    assert "round time" not in format_summary(dict(report, phases=None))
    phases = {"rounds": 3, "draft_s": 0.2, "flush_s": 0.01, "verify_s": 0.7, "host_s": 0.09,
              "verify_io_wait_s": 0.25, "draft_step_s": 0.0125}
    lines = format_summary(dict(report, phases=phases)).splitlines()
    row = next(line for line in lines if line.startswith("round time (decode)"))
    assert row.rstrip().endswith("draft 20% (12.50 ms a step), flush 1%, verify 70% (transfer wait 25%), "
                                 "host 9%; 3 rounds")
    assert lines.index(row) == next(i for i, line in enumerate(lines) if line.startswith("lossless")) - 1
    no_wait = dict(phases, verify_io_wait_s=0.0, draft_step_s=None)
    row = next(line for line in format_summary(dict(report, phases=no_wait)).splitlines()
               if line.startswith("round time"))
    assert row.rstrip().endswith("draft 20%, flush 1%, verify 70%, host 9%; 3 rounds")
