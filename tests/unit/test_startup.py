"""The start-up report (pipelines/tracking/startup.py): phases from the job's start, what ran beside what,
and the first step's own timeline."""

from __future__ import annotations

import json

from pipelines.tracking.startup import Phases, wall_line


def test_phases_are_said_in_start_order_with_what_ran_beside_them():
    phases = Phases(start=1000.0)
    phases.add("prepare (model, prompts, run)", 1000.0, 1003.0)
    phases.add("Ray", 1003.0, 1008.0)
    phases.add("DAG built", 1008.0, 1009.0)
    phases.add("trainer ranks", 1008.5, 1030.0)
    phases.from_first_step(json.dumps({"train": [1050.0, 1061.0],
                                       "generate": [["g0", 1040.0, 1049.0], ["g1", 1041.0, 1050.0]]}))
    line = phases.line()
    assert line.startswith("streamrl: start-up: first step trained 1m01.0s after the start: ")
    parts = line.split(": ", 3)[3].split("; ")
    assert [part.split(" ")[0] for part in parts] == ["prepare", "Ray", "DAG", "trainer", "engines", "step"]
    assert parts[3] == "trainer ranks 8.5s-30.0s (beside DAG built)"
    # the engines' phase runs from the DAG's start to the end of the first generate call
    assert parts[4] == "engines and first rollouts 9.0s-49.0s (beside trainer ranks)"
    assert parts[5] == "step 1 trained 50.0s-1m01.0s"
    assert phases.first_step_s() == 61.0


def test_a_restarted_attempt_does_not_move_the_start_ups_phases():
    phases = Phases(start=0.0)
    phases.add("trainer ranks", 1.0, 5.0)
    phases.add("trainer ranks", 100.0, 110.0)
    assert phases.spans["trainer ranks"] == (1.0, 5.0)
    assert phases.first_step_s() is None and "no step trained" in phases.line()


def test_the_wall_line_says_start_up_steps_and_evaluations():
    phases = Phases(start=0.0)
    phases.add("step 1 trained", 50.0, 60.0)
    phases.add("waiting for evaluations", 290.0, 300.0)
    overlap = {"window_s": 240.0, "trainer_idle_fraction": 0.25, "generator_idle_fraction": 0.5}
    line = wall_line(300.0, phases, overlap, [{"eval/time_s": 30.0}, {"eval/time_s": 40.0}], 8)
    assert line == ("streamrl: wall time 5m00.0s; start-up to the end of step 1 1m00.0s (20%); 8 step(s) over "
                    "4m00.0s: trainer busy 75%, generators busy 50%; 2 evaluation(s) 1m10.0s in all; waited 10.0s "
                    "for evaluations after the last step")
