"""Prometheus counters (``/metrics``). One registry per process."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """The product's counters, made (and prometheus_client imported) on the first use of
    any of them: the service uses them from its start, while an operator command that
    changes nothing counted (``review list``...) never loads the library (about 20 ms
    of each command's start)."""

    registry: CollectorRegistry
    turns: Counter
    transitions: Counter
    reviews: Counter
    deliveries: Counter
    unavailable: Counter
    http_connections: Gauge
    http_connections_closed: Counter
    http_unsent_bytes: Gauge
    flow_runs_unrecoverable: Counter
    idempotency_answers_lost: Counter
    time_to_decision: Histogram
    decisions: Counter
    reminders: Counter
    escalations: Counter
    expiries: Counter
    cards: Counter

    if not TYPE_CHECKING:  # mypy still refuses a name that is no metric

        def __getattr__(self, name: str) -> object:
            # Reached only while the attribute is missing: after the first use, every
            # metric is an instance attribute and no use comes here again.
            if name.startswith("__") or "registry" in self.__dict__:
                raise AttributeError(name)
            self._make()
            return getattr(self, name)

    def _make(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

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
            "Lead review verdicts stored (committed), by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.deliveries = Counter(
            "leadgate_deliveries_total",
            "Delivery attempts by channel and outcome",
            ["channel", "outcome"],
            registry=self.registry,
        )

        self.unavailable = Counter(
            "leadgate_unavailable_responses_total",
            "Requests answered 503 with Retry-After, by rule (server.busy: shed at "
            "[server] max_inflight; service.unavailable: a database fault; events.limit)",
            ["rule"],
            registry=self.registry,
        )
        self.http_connections = Gauge(
            "leadgate_http_connections",
            "HTTP connections open now, by listener (main; metrics: the separate listener)",
            ["listener"],
            registry=self.registry,
        )
        self.http_connections_closed = Counter(
            "leadgate_http_connections_closed_total",
            "Connections closed by a bound: [server] max_connections (evicted: idle, to "
            "make room; refused: 503 server.connections, every open one busy), "
            "send_timeout_s (send_timeout) and max_unsent_bytes (unsent_bytes)",
            ["listener", "reason"],
            registry=self.registry,
        )
        self.http_unsent_bytes = Gauge(
            "leadgate_http_unsent_bytes",
            "Bytes of answers waiting for clients that read slower than they are sent",
            ["listener"],
            registry=self.registry,
        )

        self.flow_runs_unrecoverable = Counter(
            "leadgate_flow_runs_unrecoverable_total",
            "Flow runs given up as unrecoverable (rule flow.unrecoverable): by recovery "
            "after MAX_RECOVERIES attempts without progress, by the resumer when an "
            "approved paused run cannot be read, or because turn recovery gave up on a "
            "node's turn",
            registry=self.registry,
        )

        self.idempotency_answers_lost = Counter(
            "leadgate_idempotency_answers_lost_total",
            "Idempotency-Key answers a database fault kept from their key that the "
            "process did not store: not held (bytes: past ANSWERS_HELD_BYTES; answers: "
            "the watch full of answers) or given up (unstorable: a store that failed for "
            "a reason other than a database fault)",
            ["reason"],
            registry=self.registry,
        )

        self._review_metrics()

    def _review_metrics(self) -> None:
        """Human review: decisions, their latency, reminders, escalations, expiries,
        review cards (README "Review cards, chat decisions, reminders")."""
        from prometheus_client import Counter, Histogram

        self.time_to_decision = Histogram(
            "leadgate_review_time_to_decision_seconds",
            "Time from an item starting to wait for a human to the decision",
            ["reason"],
            buckets=(60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 86400, 3 * 86400, 7 * 86400),
            registry=self.registry,
        )
        self.decisions = Counter(
            "leadgate_review_decisions_total",
            "Human decisions and delivery recoveries by surface and verdict",
            ["surface", "verdict"],
            registry=self.registry,
        )
        self.reminders = Counter(
            "leadgate_review_reminders_total", "Review reminders fired", registry=self.registry
        )
        self.escalations = Counter(
            "leadgate_review_escalations_total",
            "Review escalations fired",
            registry=self.registry,
        )
        self.expiries = Counter(
            "leadgate_review_expiries_total",
            "Items rejected because no decision came in time (not human rejections)",
            registry=self.registry,
        )
        self.cards = Counter(
            "leadgate_review_cards_total",
            "Review card posts and in-place updates by channel and outcome",
            ["channel", "op", "outcome"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """Prometheus text exposition."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))


METRICS = Metrics()


@functools.cache
def labelled(metric: Counter, *values: str) -> Counter:
    """``metric.labels(*values)``, kept: prometheus_client's ``labels()`` takes a lock
    and checks and joins its values on every call (about 1 µs, measured: a gated REST
    lifecycle made five such calls for work item moves alone), where a kept child is one
    dict lookup. Only for label values from a fixed set (statuses, outcomes, channel
    kinds): every distinct one is kept for the life of the process."""
    return metric.labels(*values)
