"""Elastic generation, for real: `rollout.num_actors: 1-3` on a cluster of `ray start` processes.

The head has room for the trainer and one generate actor. Mid-job a second node joins (`ray start
--address`): Ray Data's autoscaling actor pool starts generate actors there, which begin from the
policy version the job is at, not from the base model. Then the node goes (every process of it
SIGKILLed): the groups its actors held are generated again on the head, and the job finishes with
every group trained exactly once within the staleness bound.
"""

from __future__ import annotations

import re

import mlflow
import pytest
from test_faults import assert_exactly_once, final_ledger

from benchmarks.real_servers import add_node, start_head, submit_and_follow

STEPS, GROUPS = 16, 4


def generate_actors(address: str) -> dict[str, tuple[str, int]]:
    """The live generate actors: actor id -> (node id, pid)."""
    from ray.util.state import list_actors

    return {actor.actor_id: (actor.node_id, actor.pid)
            for actor in list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
            if "Generate" in actor.class_name}


@pytest.mark.slow
@pytest.mark.extended  # ~2.5 min; CI keeps the node-loss test (tests/e2e/test_node_loss.py): make test-extended
def test_generators_join_with_a_node_and_leave_with_it(servers, tmp_path):
    # CPUs are logical: the head holds the trainer rank (0.5), the DAG's helpers (0.1) and 1 generate actor
    # (1 CPU) but not 2; the node that joins holds 2 more.
    cluster = start_head(servers, cpus=2)
    out = tmp_path / "job"
    sets = {
        "train.steps": STEPS, "train.groups_per_step": GROUPS, "rollout.n": 4, "rollout.groups_per_call": 1,
        "data.num_prompts": STEPS * GROUPS, "train.checkpoint_every": 2, "train.checkpoint_keep": 0,
        "rollout.num_actors": "1-3", "rollout.num_cpus": 1, "rollout.replace_wait_s": 20, "train.max_staleness": 1,
        "eval": "null",
        "output_dir": str(out), "tracking.uri": f"sqlite:///{out / 'mlflow.db'}",
        # a reward a second late: one actor is always busy, so the pool wants more
        "reward.functions": "[{name: 'tests.reward_fixtures:slower_exact'}]",
    }
    node, joined_at_step, joiners, alive_at_step, removed_at_step, step = None, None, {}, None, None, 0

    def on_line(line: str) -> None:
        nonlocal node, joined_at_step, alive_at_step, removed_at_step, step
        if match := re.match(r"step\s+(\d+)/", line):
            step = int(match.group(1))
        if node is None and "streamrl: checkpoint " in line:  # the job is under way: a node joins
            node = add_node(servers, cluster, "node2", cpus=2)
            joined_at_step = step
            print(f"--- node {node['node_id'][:8]} joined after step {step} ---", flush=True)
        elif node is not None and removed_at_step is None:
            joiners.update({actor: pid for actor, (where, pid) in generate_actors(cluster["address"]).items()
                            if where == node["node_id"]})
            if joiners and alive_at_step is None:
                alive_at_step = step
                print(f"--- {len(joiners)} generate actor(s) up on the new node after step {step} ---", flush=True)
            # two steps with the joiners at work are in a checkpoint, which the restart below keeps: the node goes
            if alive_at_step is not None and "streamrl: checkpoint " in line and step >= alive_at_step + 2:
                servers.kill_session(node["session"])
                removed_at_step = step
                print(f"--- node {node['node_id'][:8]} killed after step {step} ---", flush=True)

    code, text = submit_and_follow(cluster["address"], sets, on_line)
    assert node is not None and joiners, ("no generate actor started on the node that joined", text[-3000:])
    assert removed_at_step is not None and removed_at_step < STEPS, text[-3000:]
    assert code == 0, text[-3000:]
    assert f"streamrl: lost node {node['node_id'][:8]}" in text, text[-3000:]
    # Its actors had no room on the head (which holds one): Ray Data would have waited for their groups
    # forever; the attempt restarted from the last checkpoint with the one actor that fits.
    assert "actor(s) of the DAG lost with a node were not restarted within 20 s" in text, text[-3000:]
    assert "restarting the trainer group and the DAG from step " in text
    run_id = re.search(r"MLflow run (\w+)", text).group(1)
    mlflow.set_tracking_uri(f"sqlite:///{out / 'mlflow.db'}")
    run = mlflow.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1", run.data.tags
    ledger = final_ledger(out, run_id, steps=STEPS)
    assert_exactly_once(ledger, max_staleness=1, steps=STEPS, groups=GROUPS)
    # The joiners sampled groups, every one with a policy the job had reached when they joined (the store's
    # newest, pulled before their first group), not the base model's version 0.
    assert ledger["generator_id"].notna().all(), ledger
    pids = {str(pid) for pid in joiners.values()}
    by_joiners = ledger[ledger["generator_id"].str.rsplit(":", n=1).str[-1].isin(pids)]
    assert len(by_joiners) > 0, ledger["generator_id"].value_counts()
    assert (by_joiners["policy_version"] >= joined_at_step).all(), by_joiners[["train_step", "policy_version"]]
