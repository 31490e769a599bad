"""Overlap analysis (pipelines/tracking/timeline.py) on hand-made busy intervals."""

from __future__ import annotations

import json

import pytest

from pipelines.tracking.timeline import overlap_report


def test_alternating_schedule_has_the_sync_efficiency():
    # Two steps, strictly in turn: generate 2 s, train 1 s, generate 2 s, train 1 s.
    timelines = [
        {"train": (2.0, 3.0), "generate": [("g", 0.0, 2.0)]},
        {"train": (5.0, 6.0), "generate": [("g", 3.0, 5.0)]},
    ]
    report = overlap_report(timelines)
    assert report["window_s"] == pytest.approx(6.0)
    assert report["generator_busy_s"] == pytest.approx(4.0)
    assert report["trainer_busy_s"] == pytest.approx(2.0)
    # Perfect overlap: generate both steps back to back (4 s), then train the last (1 s).
    assert report["ideal_s"] == pytest.approx(5.0)
    assert report["overlap_efficiency"] == pytest.approx(5.0 / 6.0)
    assert report["trainer_idle_fraction"] == pytest.approx(4.0 / 6.0)
    assert report["generator_idle_fraction"] == pytest.approx(2.0 / 6.0)


def test_perfect_pipeline_scores_one_and_json_rows_are_accepted():
    timelines = [
        {"train": (2.0, 4.0), "generate": [("g", 0.0, 2.0)]},
        {"train": (4.0, 6.0), "generate": [("g", 2.0, 4.0)]},
        {"train": (6.0, 8.0), "generate": [("g", 4.0, 6.0)]},
    ]
    report = overlap_report([json.dumps(t) for t in timelines])
    assert report["ideal_s"] == pytest.approx(8.0)
    assert report["overlap_efficiency"] == pytest.approx(1.0)


def test_concurrent_calls_of_one_generator_count_once_and_generators_average():
    timelines = [{"train": (4.0, 5.0), "generate": [("a", 0.0, 3.0), ("a", 1.0, 4.0), ("b", 0.0, 1.0)]}]
    report = overlap_report(timelines)
    assert report["generators"] == 2
    assert report["generator_busy_s"] == pytest.approx((4.0 + 1.0) / 2)
    assert report["first_step_generate_s"] == pytest.approx(4.0)


def test_no_steps_is_an_error():
    with pytest.raises(ValueError, match="no steps"):
        overlap_report([])
