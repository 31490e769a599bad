"""Fault points: named places where a test or a chaos run can stop a process at a chosen moment.

A `FaultPoints` value says which points are armed; the job builds it once, in the driver
(`FaultPoints.from_environment()`, the only reader of the variables below), and passes it to the
stages that have points, in their constructor kwargs like any other setting. Unarmed (the default,
`FaultPoints()`), every point is a no-op.

The variables, set on `streamrl run` by a test or benchmarks/chaos.py: `STREAMRL_FAULT_DIR` arms the
points; the first time a process reaches a point named in `STREAMRL_FAULT_POINTS` (comma-separated;
default: all), it writes `<dir>/<name>.json` ({"pid", "name", "time", ...details}) and holds there for
`STREAMRL_FAULT_HOLD_S` seconds (default 30), long enough for the test to SIGKILL it in exactly that
state. Each point fires once per directory: a restarted process passes it without holding.

    rollout_paused   operators/engines/rollout.py: the engine is paused for a weight update with requests in flight

Behaviour faults do not hold: the first process to reach one writes its file and misbehaves once.

    engine_ignores_update   operators/engines/rollout.py: the engine skips applying a version and goes on with
                            the weights (or the LoRA adapter) it had, while the loop records the new version
                            (what the served-policy probe, operators/weights/probe.py, must catch)
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultPoints:
    folder: str | None = None  # None: unarmed
    points: tuple[str, ...] = ()  # () with a folder: every point
    hold_s: float = 30.0

    @classmethod
    def from_environment(cls, environ=os.environ) -> "FaultPoints":
        folder = environ.get("STREAMRL_FAULT_DIR")
        if not folder:
            return cls()
        points = tuple(p.strip() for p in environ.get("STREAMRL_FAULT_POINTS", "").split(",") if p.strip())
        return cls(folder, points, float(environ.get("STREAMRL_FAULT_HOLD_S", "30")))

    def reach(self, name: str, **details) -> None:
        """Point `name` is reached: hold here once per folder if it is armed."""
        if self.fires(name, **details):
            time.sleep(self.hold_s)

    def fires(self, name: str, **details) -> bool:
        """Point `name` is reached: True the first time in this folder if it is armed (its file written)."""
        if not self.folder or (self.points and name not in self.points):
            return False
        path = os.path.join(self.folder, f"{name}.json")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # once per directory
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as out:
            json.dump({"pid": os.getpid(), "name": name, "time": time.time(), **details}, out)
        return True
