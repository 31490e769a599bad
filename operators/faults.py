"""Fault points: named places where a test or a chaos run can stop a process at a chosen moment.

Off unless `STREAMRL_FAULT_DIR` is set in the process's environment. Then, the first time a
process reaches a fault point named in `STREAMRL_FAULT_POINTS` (comma-separated; default: all), it
writes `<dir>/<name>.json` ({"pid", "name", "time", ...details}) and holds there for
`STREAMRL_FAULT_HOLD_S` seconds (default 30), long enough for the test to SIGKILL it in exactly that
state. Each point fires once per directory: a restarted process passes it without holding.

    rollout_paused   operators/engines/rollout.py: the engine is paused for a weight update with requests in flight
"""

from __future__ import annotations

import json
import os
import time


def fault_point(name: str, **details) -> None:
    folder = os.environ.get("STREAMRL_FAULT_DIR")
    if not folder:
        return
    points = os.environ.get("STREAMRL_FAULT_POINTS")
    if points and name not in {p.strip() for p in points.split(",")}:
        return
    path = os.path.join(folder, f"{name}.json")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # once per directory
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as out:
        json.dump({"pid": os.getpid(), "name": name, "time": time.time(), **details}, out)
    time.sleep(float(os.environ.get("STREAMRL_FAULT_HOLD_S", "30")))
