"""A small synthetic ``specter.bench/2`` document: two links, two budgets, eager and compiled; the
25% cells also hold a ``specter roofline`` row (governor summary with a roofline table and trace)."""

from __future__ import annotations

import copy

import pytest

MEDIANS = {"ondemand": 10.0, "ondemand@same-memory": 14.0, "router-lookahead": 15.0, "specter k=2": 16.0,
           "specter k=4": 18.0}
RESIDENT = 30.0
ROOFLINE = 17.0
# Specter rows' phases: shares of the round 25% draft, 62.5% verify, 10% host.
PHASES = {"rounds": 50, "draft_s": 1.0, "flush_s": 0.1, "verify_s": 2.5, "host_s": 0.4, "draft_steps": 200,
          "verify_tokens": 240, "experts_read": 900, "verify_io_wait_s": 0.3, "draft_step_s": 0.005,
          "verify_s_per_round": 0.05, "verify_tokens_per_round": 4.8, "distinct_experts_per_layer": 4.5,
          "verify_compute_s_per_expert": 0.002, "verify_kernel_s_per_expert": 0.0015}
TRACE = [4, 0, 1, 2, 3, 3, 3, 2, 3, 4, 3, 3]


def governor_summary(scale: float) -> dict:
    accepted = [4 * (1 - 0.8**k) for k in range(9)]
    table = [{"k": k, "expected_accepted": accepted[k], "predicted_round_s": 0.05 + 0.012 * k,
              "predicted_tokens_per_s": scale * (1 + accepted[k]) / (0.05 + 0.012 * k)} for k in range(9)]
    return {"name": "roofline", "k_max": 8, "table": table, "trace": list(TRACE), "probes": 5, "cut_rounds": 2,
            "prediction": {"3": {"rounds": 40, "predicted_s": 0.1, "measured_s": 0.11, "error": 0.09,
                                 "total_error": 0.02}},
            "prediction_error": 0.09, "prediction_total_error": 0.02}


def _tokens(median: float | None) -> dict:
    if median is None:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": median, "min": median * 0.95, "max": median * 1.05, "runs": [median * 0.95, median * 1.05]}


def _row(label: str, budget: float | None, link: str | None, compile_: bool, median: float | None, **extra) -> dict:
    engine = label.split(" ")[0].split("@")[0]
    specter = engine == "specter"
    k = int(label[-1]) if specter and label[-1].isdigit() else None
    row = {
        "engine": engine, "label": label, "k": k,
        "governor": "fixed" if specter else None, "budget": budget, "link": link, "compile": compile_,
        "decode_tokens_per_s": _tokens(median), "hit_rate": 0.9 + (budget or 0.0) / 10, "io_wait_share": 0.2,
        "copies_per_token": 1.25, "acceptance_rate": 0.875 if specter else None,
        "mean_accepted_per_step": 3.5 if specter else None, "k_mean": None if k is None else float(k),
        "k_histogram": {str(k): 40} if k is not None else None, "ttft_s": 0.1, "transfer_wait_s": 0.3,
        "device_bytes_total": 3 * 2**20, "lossless": True, "note": None, "ratios": {},
        "decode_step_s": None if median is None else (3.5 if specter else 1.0) / median,
    }
    if specter:
        row.update(phases=dict(PHASES), governor_summary={"name": "fixed"},
                   prefetch={"mode": "lazy" if link == "fast" and budget == 0.5 else "auto",
                             "conservative": link == "slow", "lazy": link == "fast" and budget == 0.5,
                             "transfer_wait_share": 0.5})
    row.update(extra)
    return row


def _ratios(rows: list[dict]) -> None:
    for row in rows:
        median = row["decode_tokens_per_s"]["median"]
        if median is None or row["budget"] is None or row["link"] is None:
            continue
        for other in rows:
            base = other["decode_tokens_per_s"]["median"]
            same_cell = (other["budget"], other["link"]) == (row["budget"], row["link"])
            resident = other["engine"] == "resident"
            baseline = not other["label"].startswith("specter")
            if other is row or not baseline or base is None or other["compile"] != row["compile"] or not (same_cell or resident):
                continue
            row["ratios"][other["label"]] = median / base


def make_bench() -> dict:
    rows = [_row("resident", None, None, False, RESIDENT), _row("resident", None, None, True, RESIDENT * 1.2)]
    for compile_ in (False, True):
        for budget in (0.25, 0.5):
            for link, scale in (("slow", 1.0), ("fast", 1.5)):
                for label, median in MEDIANS.items():
                    rows.append(_row(label, budget, link, compile_, median * scale * (1 + budget)
                                     * (1.1 if compile_ else 1.0)))
                if budget == 0.25:
                    rows.append(_row("specter roofline", budget, link, compile_, ROOFLINE * scale,
                                     governor="roofline", k_mean=2.75, k_histogram={"0": 1, "1": 1, "2": 2, "3": 6, "4": 2},
                                     governor_summary=governor_summary(scale)))
    rows.append(_row("hf-offload", 0.25, None, False, 2.0, hit_rate=None,
                     note="hf-offload: experts spilled to disk (offload folder)"))
    _ratios(rows)
    return {
        "schema": "specter.bench/2", "title": "bench-proxy",
        "model": {"arch": "mixtral", "path": "/models/mixtral-proxy", "n_moe_layers": 4, "n_experts": 16, "top_k": 2,
                  "expert_bytes": 12582912},
        "machine": {"cpu": "x86_64 test", "cores": 2, "platform": "Linux-test", "python": "3.11.7",
                    "torch": "2.13.0+cpu", "transformers": "5.24.0", "device": "cpu"},
        "threads": 1, "prompts": 4, "max_new_tokens": 48, "repeats": 2, "wall_s": 812.3, "peak_rss_bytes": 6 * 2**30,
        "command": "python -m specter.bench recipes/bench-proxy.yaml",
        "links": {"slow": {"kind": "emulated", "gbps": 0.5, "latency_us": 20, "emulated": True},
                  "fast": {"kind": "emulated", "gbps": 5.0, "latency_us": 20, "emulated": True}},
        "budgets": [0.25, 0.5],
        "rows": rows,
    }


@pytest.fixture
def bench() -> dict:
    return copy.deepcopy(make_bench())


@pytest.fixture
def sparse_bench(bench: dict) -> dict:
    bench["links"].pop("fast")
    bench["budgets"] = [0.5]
    bench["rows"] = [r for r in bench["rows"] if not r["compile"] and r["link"] in (None, "slow")
                     and r["budget"] in (None, 0.5)]
    for row in bench["rows"]:
        row.pop("k_histogram")
        row["ratios"].pop("resident", None)
        row.update(io_wait_share=None, copies_per_token=None, device_bytes_total=None, lossless=None)
    bench["rows"][-1]["decode_tokens_per_s"] = {"median": None, "min": None, "max": None, "runs": []}
    bench["rows"][-1]["ratios"] = {}
    return bench
