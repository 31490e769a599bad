"""A node lost mid-job: notice it, wait for Ray to confirm it, and re-plan the job on what is left.

When a whole node goes (its machine, or every process of it, raylet included):

- During an attempt, `NodeWatch` (a driver thread) sees Ray mark the node dead. If it held a
  trainer rank, or the job no longer fits the nodes left, the attempt cannot go on: nothing may
  ever call the dead rank (the DAG can wait forever for a group whose generate actor Ray Data
  cannot re-place), so the watch interrupts the driver's main thread and the attempt ends as a
  process death. Otherwise Ray restarts the generate and reward actors that ran there on the
  nodes left and Ray Data retries their groups there; the attempt goes on. If some cannot be
  restarted (no room left for them: an autoscaled pool that had grown onto the lost node), Ray
  Data would wait for them forever; after `rollout.replace_wait_s` the watch ends the attempt the same way, and
  the restart runs the pool at the size that fits. Nodes that join mid-attempt are watched too.
- A restart (pipelines/recovery/attempts.py) first confirms which nodes are gone: Ray's GCS takes a while to
  mark a node dead (missed health checks, ~10-15 s with Ray's defaults) and until then it still
  schedules actors there, so a restart that started at once would put a trainer bundle on the dead
  node and die again. A node that does not answer (a TCP connect to its raylet: nothing is
  scheduled) is waited for until Ray marks it dead. Then `replan` checks that the job fits the
  nodes left (pipelines/runtime/resources.py, the plan `streamrl submit` checks). If only the generate or
  reward actors do not all fit, it goes on with as many as fit (their count sets throughput, not
  what is learned). Otherwise it waits up to `train.node_wait_s` for nodes to join (a node coming
  back, an autoscaler replacing it) before it fails with the command that resumes the run.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import ray

from pipelines.config.job import JobConfig
from pipelines.runtime.resources import live_nodes, plan_problems
from pipelines.recovery.resume import AttemptFailed

# How long Ray may take to mark a node dead whose raylet no longer answers (its health checks:
# health_check_period_ms 3 s x health_check_failure_threshold 5, plus timeouts, by default).
CONFIRM_DEATH_S = 60.0
PROBE_TIMEOUT_S = 2.0
POLL_S = 1.0


def _alive() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def alive_node_ids() -> set[str]:
    return {node["NodeID"] for node in _alive()}


def _answers(node: dict) -> bool:
    try:
        socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


def describe(node: dict) -> str:
    return f"node {node['NodeID'][:8]} ({node['NodeManagerAddress']})"


def _problems_on(cfg: JobConfig, alive: list[dict]) -> list[str]:
    return plan_problems(cfg, live_nodes({node["NodeID"]: node["Resources"] for node in alive}))


def confirm_lost_nodes(known: set[str], echo: Callable[[str], None], confirm_s: float = CONFIRM_DEATH_S) -> list[dict]:
    """The nodes of `known` (alive when the attempt started) that are gone: those Ray marked dead, and
    those whose raylet does not answer, once Ray has marked them dead too (at most `confirm_s`; one that
    answers again meanwhile is not lost). Empty, at once, when every node is alive and answers."""
    began = time.monotonic()
    nodes = {node["NodeID"]: node for node in ray.nodes() if node["NodeID"] in known}
    silent = {node_id for node_id, node in nodes.items() if node.get("Alive") and not _answers(node)}
    if silent:
        echo(f"streamrl: {', '.join(describe(nodes[n]) for n in silent)} stopped answering; waiting for Ray to "
             f"mark {'it' if len(silent) == 1 else 'them'} dead before restarting")
    while silent and time.monotonic() - began < confirm_s:
        time.sleep(POLL_S)
        alive = {node["NodeID"]: node for node in _alive()}
        silent = {n for n in silent if n in alive and not _answers(alive[n])}  # dead now, or answering again
    alive = alive_node_ids()
    lost = [node for node_id, node in nodes.items() if node_id not in alive or node_id in silent]
    for node in lost:
        echo(f"streamrl: lost {describe(node)}: the actors that ran there are gone; the trainer group and the "
             f"DAG restart on the {len(alive)} node(s) left")
    return lost


class NodeWatch:
    """While an attempt's DAG runs: when Ray marks a node dead that held a trainer rank (from the
    group's `placement`), or without which the job no longer fits, set `lost` (why) and call `on_lost`,
    the caller's way to end its wait (pipelines/recovery/attempts.py passes interrupt_main_thread: the main
    thread blocks in Ray Data's iterator, an untimed wait only a signal ends; it turns the KeyboardInterrupt
    into a process death when `lost` is set).
    A lost node that held only generate or reward actors, with room left for them, is only reported,
    unless those actors are still not restarted `rollout.replace_wait_s` later (then the same interrupt). Nodes
    that join during the attempt (an autoscaled pool grows onto them) are watched from then on. Does
    nothing on a one-node cluster: the driver's node is lost only with the driver."""

    def __init__(self, cfg: JobConfig, placement: list[dict], echo: Callable[[str], None], on_lost: Callable[[], None],
                 poll_s: float = 2.0):
        self.cfg, self.echo, self.poll_s, self.replace_s = cfg, echo, poll_s, cfg.rollout.replace_wait_s
        self.on_lost = on_lost
        self.ranks = {rank["rank"]: rank["node_id"] for rank in placement}
        self.known = alive_node_ids()
        self.lost: str | None = None
        self._replaced_by: float | None = None  # when the DAG's actors of a lost node must be back
        self._job_id = ray.get_runtime_context().get_job_id()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="streamrl-node-watch", daemon=True)

    def start(self) -> "NodeWatch":
        if len(self.known) > 1 or isinstance(self.cfg.rollout.num_actors, tuple):  # an elastic pool: nodes may join
            self._thread.start()
        return self

    def stop(self) -> None:
        """No interrupt after this returns (one sent before lands in the caller's next bytecodes)."""
        with self._lock:
            self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            why = self._check()
            if why is not None:
                with self._lock:
                    if not self._done.is_set():
                        self.lost = why
                        self.on_lost()
                return

    def _check(self) -> str | None:
        """Why the attempt cannot go on, or None."""
        nodes = ray.nodes()
        self.known |= {node["NodeID"] for node in nodes if node.get("Alive")}  # joined since the last look
        gone = [node for node in nodes if node["NodeID"] in self.known and not node.get("Alive")]
        if gone:
            self.known -= {node["NodeID"] for node in gone}
            ranks = [rank for rank, node_id in sorted(self.ranks.items()) if node_id not in self.known]
            where = ", ".join(map(describe, gone))
            if ranks:
                return f"{where} was lost with trainer rank(s) {', '.join(map(str, ranks))}"
            if problems := _problems_on(self.cfg, [node for node in nodes if node.get("Alive")]):
                return f"{where} was lost, and the job no longer fits the nodes left ({problems[0]})"
            self.echo(f"streamrl: lost {where}: Ray restarts the generate and reward actors that ran there on the "
                      f"nodes left and Ray Data generates their groups again (at most {self.replace_s:g} s, or the "
                      "attempt restarts from the last checkpoint)")
            self._replaced_by = time.monotonic() + self.replace_s
        if self._replaced_by is not None and time.monotonic() >= self._replaced_by:
            stuck = self._restarting_actors()
            if stuck != 0:
                count = "some" if stuck is None else str(stuck)
                return (f"{count} actor(s) of the DAG lost with a node were not restarted within {self.replace_s:g} s "
                        "(no room left for them on the nodes left; Ray Data would wait for their groups forever)")
            self._replaced_by = None
        return None

    def _restarting_actors(self) -> int | None:
        """This job's Ray Data actors (class MapWorker(...)) that Ray is still restarting; None when the state
        API (the dashboard) cannot say."""
        from ray.util.state import list_actors

        try:
            actors = list_actors(filters=[("state", "=", "RESTARTING"), ("job_id", "=", self._job_id)], limit=10000)
        except Exception:  # a cluster started without its dashboard: assume the worst (a restart loses nothing)
            return None
        return sum(1 for actor in actors if actor.class_name.startswith("MapWorker("))


def replan(cfg: JobConfig, echo: Callable[[str], None], poll_s: float = 2.0) -> JobConfig:
    """The config the restart runs with on the live nodes: `cfg` when it fits; with fewer generate (then
    reward) actors when only those do not fit (their count changes throughput, not what is learned);
    else, once it fits again, after waiting up to `train.node_wait_s` for nodes to join. Past that,
    AttemptFailed (not a process death: run_job fails with the resume command)."""
    wait_s = cfg.train.node_wait_s
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        alive = _alive()
        nodes = live_nodes({node["NodeID"]: node["Resources"] for node in alive})
        problems = plan_problems(cfg, nodes)
        fitted = cfg if not problems else _fewer_actors(cfg, nodes, echo)
        if fitted is not None:
            if waited:
                echo(f"streamrl: the job fits the {len(alive)} live node(s) again")
            return fitted
        if time.monotonic() >= deadline:
            raise AttemptFailed(
                f"the job does not fit the {len(alive)} node(s) left after a node loss, and none joined within "
                f"train.node_wait_s={wait_s:g}: {problems[0]}", "\n".join(problems), process_death=False)
        if not waited:
            echo(f"streamrl: the job does not fit the {len(alive)} node(s) left ({problems[0]}); waiting up to "
                 f"{wait_s:g} s (train.node_wait_s) for nodes to join")
            waited = True
        time.sleep(poll_s)


# The actor pools (config sections with num_actors) a restart may shrink to fit the nodes left, in order.
_ELASTIC_POOLS = ("rollout", "reward")


def _with_actors(cfg: JobConfig, counts: dict[str, int]) -> JobConfig:
    return cfg.model_copy(update={name: getattr(cfg, name).model_copy(update={"num_actors": count})
                                  for name, count in counts.items()})


def _fewer_actors(cfg: JobConfig, nodes: list, echo: Callable[[str], None]) -> JobConfig | None:
    """`cfg` with the generate, then the reward, pool as large as fits beside the rest of the job (one
    actor each at least); None when even that does not fit."""
    fitted = _with_actors(cfg, {name: 1 for name in _ELASTIC_POOLS})
    if plan_problems(fitted, nodes):
        return None
    for name in _ELASTIC_POOLS:
        section = getattr(cfg, name)
        wanted = getattr(section, "min_actors", section.num_actors)  # a range (rollout) must fit its min
        count = next((n for n in range(wanted, 1, -1) if not plan_problems(_with_actors(fitted, {name: n}), nodes)), 1)
        fitted = _with_actors(fitted, {name: section.num_actors if count == wanted else count})
        if count < wanted:
            echo(f"streamrl: the nodes left hold {count} of the {wanted} actors of {name}.num_actors; going on "
                 f"with {count}")
    return fitted


def placement_line(placement: list[dict]) -> str:
    """Where each trainer rank runs, e.g. 'rank 0 on node 2edd763e, rank 1 on node 2edd763e'."""
    return ", ".join(f"rank {rank['rank']} on node {rank['node_id'][:8]}" for rank in placement)
