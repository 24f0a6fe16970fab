"""specter.serve.metrics: the Prometheus text exposition of the server's figures. A small parser
reads ``render()`` back; checked are the metric names, kinds and labels the contract lists, the
exact sample values before and after updates (sums of counters, the last request's gauges, NaN
where none was reported), number formatting, label escaping, and that every method takes the
lock (the worker thread and the event loop share the object)."""

from __future__ import annotations

import math
import re
import threading

import pytest

from specter.serve.metrics import OUTCOMES, ServerMetrics

COUNTERS = ["requests_total", "prompt_tokens_total", "completion_tokens_total", "decode_seconds_total",
            "bytes_transferred_total"]
GAUGES = ["queue_depth", "queue_capacity", "busy", "tokens_per_second", "ttft_seconds", "hit_rate",
          "acceptance_rate"]
SAMPLE = re.compile(r'^(specter_[a-z_]+)\{(.*)\} (\S+)$')
LABEL = re.compile(r'([a-z_]+)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse(text: str) -> tuple[dict[str, str], dict[str, str], dict[tuple[str, tuple], str]]:
    """The exposition as (name -> HELP text, name -> TYPE, (name, sorted label pairs) -> value
    text); fails on any line out of place: a sample before its metric's HELP and TYPE lines, a
    metric declared twice, a malformed line."""
    helps: dict[str, str] = {}
    types: dict[str, str] = {}
    samples: dict[tuple[str, tuple], str] = {}
    assert text.endswith("\n") and not text.endswith("\n\n")
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[len("# HELP "):].partition(" ")
            assert name not in helps and doc, line
            helps[name], current = doc, name
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE "):].partition(" ")
            assert name == current and name not in types, line
            types[name] = kind
        else:
            match = SAMPLE.match(line)
            assert match and match.group(1) == current and current in types, line
            labels = tuple(sorted(LABEL.findall(match.group(2))))
            assert ",".join(f'{k}="{v}"' for k, v in LABEL.findall(match.group(2))) == match.group(2), line
            key = (match.group(1), labels)
            assert key not in samples, line
            samples[key] = match.group(3)
    return helps, types, samples


def values(metrics: ServerMetrics) -> dict[str, str]:
    """Sample values by metric name (``requests_total`` by ``requests_total:OUTCOME``), checking that
    every sample carries exactly the model and engine labels (and the outcome on requests_total)."""
    _, _, samples = parse(metrics.render())
    out = {}
    for (name, labels), value in samples.items():
        labels = dict(labels)
        assert labels.pop("model") == metrics.model.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        assert labels.pop("engine") == metrics.engine
        short = name.removeprefix("specter_")
        if short == "requests_total":
            short = f"requests_total:{labels.pop('outcome')}"
        assert labels == {} and short not in out, (name, labels)
        out[short] = value
    return out


def test_every_listed_metric_is_declared_once_with_its_kind():
    helps, types, _ = parse(ServerMetrics("tiny", "resident", 32).render())
    assert types == {**{f"specter_{n}": "counter" for n in COUNTERS}, **{f"specter_{n}": "gauge" for n in GAUGES}}
    assert set(helps) == set(types)


def test_a_fresh_server_reports_zeros_its_capacity_and_nan_for_the_last_request():
    got = values(ServerMetrics("tiny", "resident", 32))
    assert {k: v for k, v in got.items() if k.startswith("requests_total:")} == {
        f"requests_total:{o}": "0" for o in OUTCOMES}
    assert set(OUTCOMES) == {"completed", "cancelled", "failed", "rejected_queue_full", "rejected_invalid"}
    assert (got["prompt_tokens_total"], got["completion_tokens_total"], got["bytes_transferred_total"]) == ("0",) * 3
    assert got["decode_seconds_total"] == "0.0"
    assert (got["queue_depth"], got["queue_capacity"], got["busy"]) == ("0", "32", "0")
    assert [got[n] for n in ("tokens_per_second", "ttft_seconds", "hit_rate", "acceptance_rate")] == ["NaN"] * 4


def test_counters_sum_over_requests_and_gauges_show_the_last_request():
    metrics = ServerMetrics("tiny", "specter", 4)
    for outcome in ["completed", "completed", "failed", "rejected_queue_full", "cancelled", "completed"]:
        metrics.count_request(outcome)
    metrics.set_queue(3, True)
    metrics.observe_completion(10, 16, {"decode_s": 0.5, "bytes_transferred": 1000, "tokens_per_s": 30.0,
                                        "ttft_s": 0.25, "hit_rate": 0.75, "acceptance_rate": 0.5})
    metrics.observe_completion(7, 4, {"decode_s": 0.25, "bytes_transferred": 24, "tokens_per_s": 12.5,
                                      "ttft_s": 0.125, "hit_rate": 1.0, "acceptance_rate": 0.0})
    got = values(metrics)
    assert [got[f"requests_total:{o}"] for o in OUTCOMES] == ["3", "1", "1", "1", "0"]
    assert (got["prompt_tokens_total"], got["completion_tokens_total"]) == ("17", "20")
    assert (got["decode_seconds_total"], got["bytes_transferred_total"]) == ("0.75", "1024")
    assert (got["queue_depth"], got["busy"], got["queue_capacity"]) == ("3", "1", "4")
    assert (got["tokens_per_second"], got["ttft_seconds"]) == ("12.5", "0.125")
    assert (got["hit_rate"], got["acceptance_rate"]) == ("1.0", "0.0")  # a rate of 0.0 is a value, not missing
    metrics.set_queue(0, False)
    assert (values(metrics)["queue_depth"], values(metrics)["busy"]) == ("0", "0")


def test_figures_an_engine_does_not_have_add_nothing_and_show_nan():
    metrics = ServerMetrics("tiny", "resident", 1)
    metrics.observe_completion(5, 3, {"decode_s": None, "bytes_transferred": None, "tokens_per_s": 8.0,
                                      "ttft_s": 0.5, "hit_rate": None, "acceptance_rate": None})
    got = values(metrics)
    assert (got["tokens_per_second"], got["ttft_seconds"]) == ("8.0", "0.5")
    assert (got["hit_rate"], got["acceptance_rate"]) == ("NaN", "NaN")
    metrics.observe_completion(2, 1, {})  # the last request reported none: its gauges show none
    got = values(metrics)
    assert (got["prompt_tokens_total"], got["completion_tokens_total"]) == ("7", "4")
    assert (got["decode_seconds_total"], got["bytes_transferred_total"]) == ("0.0", "0")
    assert (got["tokens_per_second"], got["ttft_seconds"]) == ("NaN", "NaN")


@pytest.mark.parametrize("value, text", [
    (float("inf"), "+Inf"), (float("-inf"), "-Inf"), (float("nan"), "NaN"), (1e-7, "1e-07"), (3, "3"),
])
def test_numbers_are_written_in_the_prometheus_forms(value, text):
    metrics = ServerMetrics("tiny", "resident", 1)
    metrics.observe_completion(0, 0, {"tokens_per_s": value})
    assert values(metrics)["tokens_per_second"] == text
    if isinstance(value, float) and math.isfinite(value):
        assert float(text) == value


def test_label_values_are_escaped():
    metrics = ServerMetrics('org/"odd"\\name\nv2', "resident", 1)
    text = metrics.render()
    assert 'specter_busy{model="org/\\"odd\\"\\\\name\\nv2",engine="resident"} 0\n' in text
    assert len(text.splitlines()) == len(ServerMetrics("plain", "resident", 1).render().splitlines())
    values(metrics)  # every sample still parses, with the model label read back escaped


@pytest.mark.parametrize("call", [
    lambda m: m.count_request("completed"), lambda m: m.set_queue(2, True),
    lambda m: m.observe_completion(1, 2, {"decode_s": 0.5}), lambda m: m.render(),
], ids=["count_request", "set_queue", "observe_completion", "render"])
def test_every_method_takes_the_lock(call):
    """The worker thread and the event loop update the same object: each method waits for the lock."""
    metrics = ServerMetrics("tiny", "resident", 1)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (call(metrics), done.set()))
    with metrics._lock:
        thread.start()
        assert not done.wait(0.05)  # blocked while another thread holds the lock
    assert done.wait(5)
    thread.join(5)
