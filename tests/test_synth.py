"""The synthetic ticket generator: deterministic, balanced, long-tailed, varied."""

import json
from collections import Counter
from pathlib import Path

import pytest

from slimroute.io.synth import CLASSES, synthetic_tickets, ticket_length_summary

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "tickets-600.jsonl"


def words(ticket: dict) -> int:
    return len(ticket["text"].split())


def test_synthetic_is_deterministic_and_seeded():
    assert synthetic_tickets(50, seed=3) == synthetic_tickets(50, seed=3)
    assert synthetic_tickets(50, seed=3) != synthetic_tickets(50, seed=4)
    assert synthetic_tickets(0) == []


def test_synthetic_shape_and_balance():
    tickets = synthetic_tickets(600, 0)
    assert [t["id"] for t in tickets] == [f"t{i:05d}" for i in range(600)]
    assert all(set(t) == {"id", "text", "label"} for t in tickets)
    assert Counter(t["label"] for t in tickets) == {c: 200 for c in CLASSES}
    assert [t["label"] for t in tickets[:30]] != sorted(t["label"] for t in tickets[:30])  # shuffled
    assert len({t["text"] for t in tickets}) == 600


def test_synthetic_length_distribution():
    tickets = synthetic_tickets(600, 0)
    lengths = [words(t) for t in tickets]
    assert sum(10 <= n <= 60 for n in lengths) > 0.7 * len(lengths)
    assert max(lengths) > 200
    assert 0.04 * len(lengths) < sum(n > 120 for n in lengths) < 0.15 * len(lengths)
    assert max(lengths) <= 500


def test_synthetic_variety_per_class():
    tickets = synthetic_tickets(600, 0)
    for label in CLASSES:
        starts = {" ".join(t["text"].lower().split()[:5]) for t in tickets if t["label"] == label}
        assert len(starts) >= 60, (label, len(starts))


def test_synthetic_class_signal_is_present_but_not_one_keyword():
    """A crude keyword scorer gets most tickets right, but not all: the wording varies."""
    cues = {
        "billing": ("charge", "refund", "invoice", "paid", "pay", "bill", "price", "discount", "seats"),
        "technical": ("error", "crash", "sync", "slow", "app", "version", "load", "search", "mode", "api"),
        "account": ("log in", "password", "account", "sign", "email", "username", "admin", "profile"),
    }
    tickets = synthetic_tickets(600, 0)

    def guess(text: str) -> str:
        return max(cues, key=lambda label: sum(text.lower().count(cue) for cue in cues[label]))

    accuracy = sum(guess(t["text"]) == t["label"] for t in tickets) / len(tickets)
    assert 0.7 < accuracy < 0.97


def test_ticket_length_summary():
    summary = ticket_length_summary(synthetic_tickets(600, 0))
    assert summary["count"] == 600
    assert summary["min"] <= summary["p50"] <= summary["p90"] <= summary["p99"] <= summary["max"]
    assert summary["min"] < summary["mean"] < summary["max"]
    with pytest.raises(ValueError, match="empty"):
        ticket_length_summary([])


def test_bundled_sample_matches_generator():
    lines = SAMPLE.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == synthetic_tickets(600, 0)
