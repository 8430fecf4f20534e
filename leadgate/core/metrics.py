"""Prometheus counters (``/metrics``). One registry per process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest


class Metrics:
    """The product's counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.turns = Counter(
            "leadgate_turns_total",
            "Turns by outcome (plain, gated, busy, duplicate, error)",
            ["outcome"],
            registry=self.registry,
        )
        self.transitions = Counter(
            "leadgate_work_item_transitions_total",
            "Work item status transitions",
            ["from_status", "to_status"],
            registry=self.registry,
        )
        self.reviews = Counter(
            "leadgate_reviews_total",
            "Lead review attempts by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.deliveries = Counter(
            "leadgate_deliveries_total",
            "Delivery attempts by channel and outcome",
            ["channel", "outcome"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return bytes(generate_latest(self.registry))


METRICS = Metrics()
