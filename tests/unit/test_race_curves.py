"""The time-to-quality race's arithmetic (benchmarks/race_curves.py), by hand."""

from __future__ import annotations

from benchmarks.race_curves import first_reach, headline, median_reach, mode_curve


def run(points):
    return {"points": [{"step": s, "wall_s": w, "accuracy": a} for s, w, a in points]}


def test_first_reach_is_the_first_evaluated_step_at_or_above_the_threshold():
    points = run([(0, 0.0, 0.2), (4, 100.0, 0.5), (8, 180.0, 0.4), (12, 250.0, 0.9)])["points"]
    assert first_reach(points, 0.35) == 100.0
    assert first_reach(points, 0.35, "step") == 4
    assert first_reach(points, 0.9) == 250.0  # equal counts
    assert first_reach(points, 0.95) is None


def test_a_seed_that_never_reaches_counts_as_infinitely_late():
    assert median_reach([100.0, None, 300.0]) == 300.0
    assert median_reach([100.0, None, None]) is None
    assert median_reach([100.0, 200.0]) == 150.0
    assert median_reach([100.0, None]) is None
    assert median_reach([]) is None


def test_a_modes_curve_is_the_seeds_median_with_their_spread():
    runs = [run([(0, 0.0, 0.2), (4, 90.0, 0.4)]), run([(0, 0.0, 0.2), (4, 110.0, 0.6)]),
            run([(0, 0.0, 0.2), (4, 100.0, 0.9)])]
    curve = mode_curve(runs)
    assert curve[1] == {"step": 4, "seeds": 3, "accuracy": 0.6, "accuracy_min": 0.4, "accuracy_max": 0.9,
                        "wall_s": 100.0}


def test_headline_thresholds_are_from_step_0():
    runs = [run([(0, 0.0, 0.2), (4, 90.0, 0.4), (8, 200.0, 0.86)]), run([(0, 0.0, 0.2), (4, 120.0, 0.3)])]
    figures = headline(runs, base=0.2, target=0.85, rise=0.15)
    assert figures["rise_threshold"] == 0.35
    assert figures["wall_s_to_rise"] == [90.0, None] and figures["median_wall_s_to_rise"] is None
    assert figures["wall_s_to_target"] == [200.0, None]
    assert figures["steps_to_rise"] == [4, None]


def test_the_answered_scores_are_the_seeds_median_when_the_runs_have_them():
    runs = [{"points": [{"step": 4, "wall_s": 10.0, "accuracy": 0.2, "answered_rate": 0.5,
                         "accuracy_among_answered": 0.4}]},
            {"points": [{"step": 4, "wall_s": 12.0, "accuracy": 0.0, "answered_rate": 0.0,
                         "accuracy_among_answered": float("nan")}]}]
    point = mode_curve(runs)[0]
    assert point["answered_rate"] == 0.25 and point["accuracy_among_answered"] == 0.4
    assert "answered_rate" not in mode_curve([run([(4, 1.0, 0.5)])])[0]


def test_a_continued_race_keeps_every_mode_it_raced_and_its_commands():
    """`race --continue --modes plain` on a record of the default mode: the record covers both modes (their curves
    and headlines), keeps the earlier runs, the first command and every command since."""
    from benchmarks.race import resumed

    earlier = {"config": "c.yaml", "every": 4, "modes": ["default"], "seeds": 3, "date": "d1",
               "command": "python benchmarks/real_model.py race c.yaml --modes default --seeds 3 --set a=1",
               "runs": [{"mode": "default", "seed": s} for s in range(3)], "step0": {"accuracy": 0.2},
               "step0_accuracy": 0.2}
    now = {"config": "c.yaml", "every": 4, "modes": ["plain"], "seeds": 1, "date": "d2", "runs": [],
           "command": "python benchmarks/real_model.py race c.yaml --modes plain --seeds 1 --set a=1"}
    record = resumed(earlier, now, echo=lambda *_: None)
    assert record["modes"] == ["default", "plain"] and record["seeds"] == 3
    assert record["runs"] == earlier["runs"] and record["step0_accuracy"] == 0.2
    assert record["command"] == earlier["command"] and record["commands"] == [earlier["command"], now["command"]]
    assert record["date"] == "d1" and record["continued"] == ["d2"]
