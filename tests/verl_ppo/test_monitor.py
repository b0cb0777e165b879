"""Prometheus monitor: scraped over HTTP on loopback, private registry, rank 0 only."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from verl_comm.telemetry import rss_bytes
from verl_ppo.observe.monitor import PrometheusMonitor

pytestmark = pytest.mark.timeout(60)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


METRICS = {
    "timing_s/step": 2.5,
    "timing_s/gen": 1.25,
    "timing_s/update_actor": 0.75,
    "perf/throughput_tokens_per_s": 1234.5,
    "perf/throughput_tokens_per_s_per_gpu": 617.25,
    "reward/mean": 0.375,
    "comm/actor/comm/wire_bytes": 1000.0,
    "comm/actor/comm/hook_time_s": 0.125,
    "comm/actor/comm/compression_ratio": 3.5,
    "comm/critic/bytes": 64.0,
    "comm/compression_ratio": 2.0,
    "actor/pg_clipfrac": 0.0625,
    "eval/reward": float("nan"),
    "note": "text",
}


def test_scrape_over_loopback_maps_every_key():
    with PrometheusMonitor(port=0) as mon:
        assert mon.port and mon.port > 0
        assert mon.url == f"http://127.0.0.1:{mon.port}/metrics"
        mon.update(METRICS, step=7)
        got = scrape(mon.url)
    assert got[("verl_ppo_step", ())] == 7
    assert got[("verl_ppo_step_time_seconds", ())] == 2.5
    assert got[("verl_ppo_phase_time_seconds", (("phase", "gen"),))] == 1.25
    assert got[("verl_ppo_phase_time_seconds", (("phase", "update_actor"),))] == 0.75
    assert ("verl_ppo_phase_time_seconds", (("phase", "step"),)) not in got
    assert got[("verl_ppo_throughput_tokens_per_second", ())] == 1234.5
    assert got[("verl_ppo_throughput_tokens_per_second_per_gpu", ())] == 617.25
    assert got[("verl_ppo_reward_mean", ())] == 0.375
    assert got[("verl_ppo_allreduce_bytes", (("role", "actor"),))] == 1000.0
    assert got[("verl_ppo_allreduce_bytes", (("role", "critic"),))] == 64.0
    assert got[("verl_ppo_allreduce_time_seconds", (("role", "actor"),))] == 0.125
    assert got[("verl_ppo_compression_ratio", (("role", "actor"),))] == 3.5
    assert got[("verl_ppo_compression_ratio", (("role", "all"),))] == 2.0
    assert got[("verl_ppo_metric", (("name", "actor/pg_clipfrac"),))] == 0.0625
    assert ("verl_ppo_metric", (("name", "eval/reward"),)) not in got  # NaN skipped
    assert got[("verl_ppo_memory_rss_bytes", ())] > 1e6  # a Python process with torch


def test_gauges_follow_the_latest_step_and_port_is_freed():
    mon = PrometheusMonitor(port=0)
    mon.update({"reward/mean": 1.0}, step=1)
    mon.update({"reward/mean": -2.0}, step=2)
    got = scrape(mon.url)
    assert got[("verl_ppo_reward_mean", ())] == -2.0 and got[("verl_ppo_step", ())] == 2
    port = mon.port
    mon.close()
    mon.close()  # idempotent
    with socket.socket() as s:  # nothing listens any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    with PrometheusMonitor(port=port) as again:  # and the port can be served again
        assert again.port == port


def test_private_registries_and_default_untouched():
    before = {m.name for m in REGISTRY.collect()}
    with PrometheusMonitor(port=0) as a, PrometheusMonitor(port=0) as b:
        a.update({"reward/mean": 1.0})
        b.update({"reward/mean": 2.0})
        assert scrape(a.url)[("verl_ppo_reward_mean", ())] == 1.0
        assert scrape(b.url)[("verl_ppo_reward_mean", ())] == 2.0
    assert {m.name for m in REGISTRY.collect()} == before


def test_only_rank_zero_serves():
    mon = PrometheusMonitor(port=0, rank=1)
    assert mon.port is None and mon.url is None
    mon.update(METRICS, step=1)  # no-op
    mon.close()


def test_errors_name_the_config_field():
    with pytest.raises(ValueError, match="prometheus_port"):
        PrometheusMonitor(port=70000)
    with PrometheusMonitor(port=0) as mon:
        with pytest.raises(OSError, match="monitor.prometheus_port"):
            PrometheusMonitor(port=mon.port)


def test_rss_is_plausible():
    assert 1e6 < rss_bytes() < 1e12
