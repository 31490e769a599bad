"""When no step comes for a long while: say what the job is waiting on, instead of waiting silently.

A job whose DAG stops producing steps (an actor that cannot be placed, a stage blocked on a version that
never comes, a wedged engine) otherwise sits in Ray Data's output queue with nothing on the terminal.
`StallReport` is a thread beside an attempt: when `after_s` pass with no step, it prints once what it can
see, then again after twice as long, and so on:

- the cluster's free and total resources (a pending actor that does not fit shows here);
- the live actors of this job, by class and state, with their pids (PENDING_CREATION: waiting for room);
- the policy store's newest version (the staleness gate admits step s at version s - max_staleness);
- the Python stacks of the driver's threads (Ray Data's executor among them), and, with py-spy on PATH
  (`pip install py-spy`; the dev extra has it), of each live actor process on this node.

Nothing here changes the job: it reads and prints. train.stall_report_s: 0 turns it off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Callable

# py-spy's dump of one process: at most this many lines each (a vLLM engine has dozens of threads)
STACK_LINES = 80
PY_SPY_TIMEOUT_S = 20.0


class StallReport:
    """`beat(step)` after every step; `start()` / `stop()` around the attempt's wait on the DAG."""

    def __init__(self, after_s: float, echo: Callable[[str], None], store=None, poll_s: float = 1.0):
        self.after_s, self.echo, self.store, self.poll_s = after_s, echo, store, poll_s
        self.last_step: int | None = None
        self.since = time.monotonic()
        self.next_s = after_s
        self.reports = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "StallReport":
        if self.after_s > 0:
            self._thread = threading.Thread(target=self._run, name="streamrl-stall-report", daemon=True)
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.last_step, self.since, self.next_s = step, time.monotonic(), self.after_s

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=PY_SPY_TIMEOUT_S + 5)

    def _run(self) -> None:
        while not self._stopped.wait(self.poll_s):
            idle = time.monotonic() - self.since
            if idle < self.next_s:
                continue
            self.next_s *= 2
            try:
                text = self.report(idle)
            except Exception as err:  # noqa: BLE001 - a report must never take the job down
                text = f"streamrl: no step for {idle:.0f}s; the stall report itself failed: {err!r}"
            if not self._stopped.is_set():
                self.reports += 1
                self.echo(text)

    def report(self, idle: float) -> str:
        after = "the attempt started" if self.last_step is None else f"step {self.last_step}"
        lines = [f"streamrl: WARNING no step for {idle:.0f}s since {after}; what the job is waiting on "
                 f"(the next report at {self.next_s:.0f}s without a step; train.stall_report_s sets the first):"]
        lines += resource_lines()
        actors = job_actors()
        lines += actor_lines(actors)
        if self.store is not None:
            try:
                lines.append(f"  policy store: newest version {self.store.version(timeout_s=5)}")
            except Exception as err:  # noqa: BLE001
                lines.append(f"  policy store: no answer ({err!r})")
        lines += driver_stacks()
        lines += actor_stacks(actors)
        return "\n".join(lines)


def resource_lines() -> list[str]:
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    shown = [key for key in ("CPU", "GPU", "memory", "object_store_memory") if key in total]
    shown += sorted(key for key in total if key not in shown and not key.startswith(("node:", "bundle_group")))
    parts = [f"{key} {free.get(key, 0.0):g}/{total[key]:g}" if "memory" not in key else
             f"{key} {free.get(key, 0.0) / 2**30:.1f}/{total[key] / 2**30:.1f} GiB" for key in shown]
    return ["  free/total: " + ", ".join(parts)]


def job_actors() -> list[dict]:
    """This job's actors that are not dead. Private API: ray._private.state.actors() reads the GCS actor table
    without the dashboard (ray.util.state needs the dashboard's API server, which jobs here run without)."""
    import ray
    from ray._private import state

    job = ray.get_runtime_context().get_job_id()
    table = state.actors()
    return [info for info in table.values() if info.get("State") != "DEAD" and info.get("JobID") == job]


def actor_lines(actors: list[dict]) -> list[str]:
    if not actors:
        return ["  actors: none alive"]
    counts = Counter((info["ActorClassName"], info["State"]) for info in actors)
    lines = ["  actors: " + ", ".join(f"{name} {state.lower()} x{count}" if count > 1 else f"{name} {state.lower()}"
                                      for (name, state), count in sorted(counts.items()))]
    waiting = [info for info in actors if info["State"] != "ALIVE"]
    if waiting:
        lines.append("  not running yet (PENDING_CREATION: waiting for resources or for their arguments): "
                     + ", ".join(info["ActorClassName"] for info in waiting))
    return lines


def driver_stacks() -> list[str]:
    """The driver's threads, innermost frames last (this thread left out)."""
    lines = ["  driver threads:"]
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = traceback.format_stack(frame)[-6:]
        lines.append(f"    thread {names.get(ident, ident)}:")
        lines += ["      " + line for entry in stack for line in entry.rstrip().splitlines()]
    return lines


def actor_stacks(actors: list[dict]) -> list[str]:
    """py-spy dumps of the live actor processes on this machine (none without py-spy, or across nodes)."""
    import ray

    spy = shutil.which("py-spy") or _beside_python("py-spy")
    here = ray.get_runtime_context().get_node_id()  # a pid of another node means nothing here
    pids = sorted({(info["ActorClassName"], int(info["Pid"])) for info in actors
                   if info["State"] == "ALIVE" and info.get("Pid") and info["Address"]["NodeID"] == here})
    if spy is None:
        return ["  actor stacks: py-spy is not installed (pip install py-spy)"] if pids else []
    lines = []
    for name, pid in pids:
        try:
            out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                 timeout=PY_SPY_TIMEOUT_S)
            text = (out.stdout or out.stderr).strip().splitlines()
        except (OSError, subprocess.TimeoutExpired) as err:
            text = [f"py-spy failed: {err!r}"]
        cut = len(text) - STACK_LINES
        lines.append(f"  {name} (pid {pid}):")
        lines += ["    " + line for line in text[:STACK_LINES]]
        if cut > 0:
            lines.append(f"    ... {cut} more lines")
    return lines


def _beside_python(name: str) -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.access(path, os.X_OK) else None
