"""The service's Prometheus metrics, in a registry of their own (several apps may live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Prometheus:
    """The service's metrics (request counts and latency, batches, tokens, queue depth, errors)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("slimroute_requests", "Classify requests by task and HTTP status", ["task", "status"],
                                registry=r)
        self.items = Counter("slimroute_items", "Texts classified", ["task"], registry=r)
        self.latency = Histogram("slimroute_request_latency_seconds", "Classify request latency",
                                 ["task"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_items = Histogram("slimroute_batch_items", "Texts per engine call", ["task"],
                                     buckets=SIZE_BUCKETS, registry=r)
        self.batch_requests = Histogram("slimroute_batch_requests", "Requests per engine call", ["task"],
                                        buckets=SIZE_BUCKETS, registry=r)
        self.batch_seconds = Histogram("slimroute_batch_seconds", "Engine time per call", ["task"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.real_tokens = Counter("slimroute_real_tokens", "Item tokens that carry text", ["task"], registry=r)
        self.processed_tokens = Counter("slimroute_processed_tokens", "Item tokens run, padding included",
                                        ["task"], registry=r)
        self.padding_overhead = Gauge("slimroute_padding_overhead", "Padded / processed tokens, last call",
                                      ["task"], registry=r)
        self.queue_depth = Gauge("slimroute_queue_depth", "Texts waiting for the engine", registry=r)
        self.errors = Counter("slimroute_errors", "Errors by task and kind", ["task", "kind"], registry=r)
        self.dropped = Counter("slimroute_dropped_requests", "Requests dropped because the client went away",
                               ["task"], registry=r)
        self.unauthorized = Counter("slimroute_unauthorized_requests", "Requests refused with 401, any path",
                                    ["reason"], registry=r)

    def observe_batch(self, task: str, num_items: int, num_requests: int, seconds: float, stats) -> None:
        self.batch_items.labels(task=task).observe(num_items)
        self.batch_requests.labels(task=task).observe(num_requests)
        self.batch_seconds.labels(task=task).observe(seconds)
        self.items.labels(task=task).inc(num_items)
        if stats is not None:
            self.real_tokens.labels(task=task).inc(stats.padding.real_tokens)
            self.processed_tokens.labels(task=task).inc(stats.padding.processed_tokens)
            self.padding_overhead.labels(task=task).set(stats.padding.overhead)
