"""Prometheus metrics of a model under --ram-budget (runtime/offload.py, runtime/
expert_offload.py): the neuron store's or an MoE model's expert store's counters, read from the
store when /metrics is scraped (a collector, so the engine thread never updates them)."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class OffloadCollector:
    """Registered in the server's registry when its session has a neuron store."""

    def __init__(self, offload):
        self.offload = offload

    def collect(self):
        s = self.offload.stats()
        if not s:
            return
        if "pinned_hits" in s:  # an MoE model's expert store (runtime/expert_offload.py)
            yield from self._experts(s)
            return
        for name, key, doc in (
                ("pij_neurons_requested", "requested", "FFN neurons the active sets asked for"),
                ("pij_neuron_static_hits", "static_hits", "of them, in the static (hot) part"),
                ("pij_neuron_cache_hits", "cache_hits", "of them, in the dynamic cache"),
                ("pij_neuron_misses", "misses", "of them, read from the bundle file"),
                ("pij_neuron_read_bytes", "bytes_read", "bytes read from the bundle file"),
                ("pij_neuron_read_wait_seconds", "wait_ns", "compute threads waiting for reads")):
            value = s[key] / 1e9 if key == "wait_ns" else s[key]
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("pij_neuron_hit_rate", "(static + cache hits) / requested, "
                                "since the model loaded", value=s["hit_rate"])
        yield GaugeMetricFamily("pij_neuron_read_bytes_per_token", "bytes read per decoded token "
                                "(one-token steps; their reads ahead included)",
                                value=s["per_token"]["bytes_read"])
        yield GaugeMetricFamily("pij_neuron_memory_hit_rate", "one-token steps' requests no read "
                                "served, ahead or not", value=s["per_token"]["memory_hit_rate"])
        yield GaugeMetricFamily("pij_neuron_resident_bytes", "the store's static and dynamic "
                                "parts", value=s["resident_bytes"])

    @staticmethod
    def _experts(s):
        for name, key, doc in (
                ("pij_experts_requested", "requested", "routed experts the calls asked for"),
                ("pij_expert_pinned_hits", "pinned_hits", "of them, pinned in memory"),
                ("pij_expert_cache_hits", "cache_hits", "of them, in the expert cache"),
                ("pij_expert_misses", "misses", "of them, read from the expert file"),
                ("pij_expert_read_bytes", "bytes_read", "bytes read from the expert file"),
                ("pij_expert_read_wait_seconds", "wait_ns", "compute threads waiting for reads")):
            value = s[key] / 1e9 if key == "wait_ns" else s[key]
            yield CounterMetricFamily(name, doc, value=value)
        pt = s["per_token"]
        yield GaugeMetricFamily("pij_expert_hit_rate", "(pinned + cache hits) / requested, "
                                "since the model loaded", value=s["hit_rate"])
        yield GaugeMetricFamily("pij_expert_read_bytes_per_token", "bytes read per decoded "
                                "token (one-token steps; their reads ahead included)",
                                value=pt["bytes_read"])
        if pt["readahead_recall"] is not None:
            yield GaugeMetricFamily("pij_expert_readahead_recall", "the next layer's routed "
                                    "experts the read-ahead had guessed",
                                    value=pt["readahead_recall"])
        yield GaugeMetricFamily("pij_expert_resident_bytes", "the store's pinned experts and "
                                "cache", value=s["resident_bytes"])
