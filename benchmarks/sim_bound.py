"""The simulation's bound: the shortest step any schedule could reach under simulate_cluster.py's cost model.

    python benchmarks/sim_bound.py            # adds the bound to results/simulation*.json, prints the table

Beside each simulated speed-up (benchmarks/simulate_cluster.py, results/simulation.json) stands the
speed-up no schedule could beat at the same staleness and GPU count: run a's simulated step time over
the bound's (the simulation's speed-up is samples/s over run a's), and the ratio of the two, which is
the bound's step time over the run's. The simulation is not re-run: the records are post-processed (the
workload is reproduced from the schedule and the prompt-seeded lengths, as the sim engine drew them).

Notation (the cost model's fields, benchmarks/sim_engine.py `CostModel`): a step has responses of
lengths L_i (simulated tokens), D = sum L_i tokens decoded, the longest Lmax; the trainer is charged
R = sum ceil(L_i / token_unit) x token_unit + responses x prompt_tokens tokens. tick(x) = decode_step_s
+ decode_per_seq_s x x is one decode tick with x sequences active, at most m = max_num_seqs per
instance; w = weight_sync_s; a layout puts generation on G GPUs (I = G / gpus_per_instance engine
instances) and training on T, either apart (G + T = N) or colocated (G = T = N, in turn).

Per step, every schedule pays at least:
  train  t   = train_seconds_per_token x R / T + train_step_fixed_s    (the trainer's own cost, exactly)
  tail   lam = Lmax x tick(1)       the longest response needs Lmax ticks of its instance, each costing
                                    at least tick(1) (it is active itself)
  work   D x (decode_step_s / m + decode_per_seq_s) instance-seconds: an instance busy for k ticks
                                    decoding d tokens spends decode_step_s x k + decode_per_seq_s x d,
                                    and k >= d / m; spread over I instances, at least work / I seconds
  gen    = max(lam, work / I)       at least the time from the step's first token to its last

The staleness gate (a group of step k may start once the loaded version is >= k - s; staleness counts
a group's oldest token) means every token of step k is decoded after train step k - s - 1 has ended
(version k - s published) and w has passed (its load): the whole of gen lies after that. So, with E_k
the end of train step k (which publishes version k + 1),

  (1) E_k >= E_{k-s-1} + w + gen + t      generation of step k overlaps training of steps k-s..k-1 only
  (2) E_k >= E_{k-1} + t                  train steps run one after another

and in a steady state with period P (seconds per step), over many steps:

  P >= (w + gen + t) / (s + 1)   from (1)
  P >= t                         from (2)
  P >= work / I                  apart: the generation GPUs decode every step's tokens
  P >= work / I + t              colocated: the same GPUs generate or train, never both at once
  P >= lam / (s + 1) + t         colocated: between E_{k-s-1} and E_k the tail's decode and the s + 1
                                 train steps k-s..k all run, on the same GPUs, so one after another

(chaining (1) K times gives E_{k + K(s+1)} - E_k >= K (w + gen + t), hence the first line).
The bound is the largest of these. Each inequality holds for every order of work, admission, batching
and weight loading the cost model allows, so no schedule on that layout beats it; the best over every
layout (`best_bound`: G from 1 to N - 1 apart, and colocated, where the GPUs are counted once) is what
any schedule could do. Staleness enters only through (1) and the colocated tail, each divided by s + 1:
every term stays or falls as s grows, so the bound never rises with staleness. At staleness 0, (1) is
load, generate, train in turn, and the best layout is colocated on all N (apart, each phase has part
of them): the bound is the synchronous schedule with perfect decoding (`sync_step_s`).

What the bound takes as perfect, and the simulation does not have: no DAG overhead (Ray Data, the
rollout loop, the Train operator's hops); no prefill (the cost model has none either); the longest
response decodes alone (batch 1) while every other token decodes in full batches of m; decoding
balanced over instances; every group admitted the moment its gate opens; the training of a step
starting the moment its last token is out; one load of w per version on the critical path and none
elsewhere (loads off it are not charged at all); free publishing. It is a bound on the long-run step
time; the simulation times a 5-step window after start-up, which a pipeline filled before the window
could in principle beat, so the unit tests check the recorded runs against it.

The bound's tail at tick(1) beside full batches for everything else takes foresight: knowing which
response will be the longest. Each record also gets `age_batched` (benchmarks/sim_tiers.py): the same
inequalities for schedules that choose a response's batch by how long it has run, the only sign of its
length in this cost model, with the best such policy and layout. It is what a tail-isolating scheduler
could reach at most; its ratio to a run is how much of the gap such a scheduler could close.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.sim_cost import CostModel
from benchmarks.sim_terms import layout_terms, train_step_s
from benchmarks.sim_tiers import best_tiered, one_batch_policies, tier_policies, tiers

RESULTS = Path(__file__).parent / "results"
RESULT_FILES = ("simulation.json", "simulation_check_128.json")


@dataclass(frozen=True)
class StepWork:
    """One step's workload, in the terms the cost model prices."""

    decoded_tokens: float  # D: simulated tokens decoded
    trained_tokens: float  # R: tokens the trainer is charged (responses in whole fake ids, plus prompts)
    longest: float  # Lmax: the longest response, simulated tokens


@dataclass(frozen=True)
class Bound:
    """A lower bound on seconds per step, the layout it is for, and which term sets it."""

    step_s: float
    gen_gpus: int
    train_gpus: int
    colocated: bool
    limit: str  # "staleness chain", "trainer", "generation throughput", "colocated work", "colocated tail"


def step_work(lengths: np.ndarray, cost: CostModel) -> StepWork:
    """A step's workload from its response lengths (simulated tokens), as sim_trainer charges it."""
    lengths = np.asarray(lengths)
    ids = np.ceil(lengths / cost.token_unit)
    return StepWork(float(lengths.sum()), float(ids.sum() * cost.token_unit + lengths.size * cost.prompt_tokens),
                    float(lengths.max()))


def mean_work(steps: list[np.ndarray], cost: CostModel) -> StepWork:
    """The mean workload of several steps (every term of the bound is linear in it)."""
    works = [step_work(lengths, cost) for lengths in steps]
    return StepWork(*(float(np.mean([getattr(w, f) for w in works])) for f in StepWork.__dataclass_fields__))


def train_s(work: StepWork, cost: CostModel, train_gpus: int) -> float:
    """t: one train step on `train_gpus` (sim_trainer's sleep)."""
    return train_step_s(cost, work.trained_tokens, train_gpus)


def decode_work_s(work: StepWork, cost: CostModel) -> float:
    """Instance-seconds to decode the step's tokens in full batches of max_num_seqs."""
    return work.decoded_tokens * (cost.decode_step_s / cost.max_num_seqs + cost.decode_per_seq_s)


def generation_s(work: StepWork, cost: CostModel, gen_gpus: int) -> float:
    """gen: the step's first token to its last, at best: max(the tail alone at batch 1, the work spread)."""
    instances = gen_gpus // cost.gpus_per_instance
    return max(work.longest * cost.tick_seconds(1), decode_work_s(work, cost) / instances)


def step_bound(work: StepWork, cost: CostModel, gen_gpus: int, train_gpus: int, staleness: int,
               colocated: bool = False) -> Bound:
    """The least seconds per step on one layout at `staleness` (the module docstring's inequalities)."""
    if staleness < 0 or gen_gpus < cost.gpus_per_instance or train_gpus < 1:
        raise ValueError(f"staleness {staleness}, gen_gpus {gen_gpus}, train_gpus {train_gpus}: staleness must be "
                         f">= 0, gen_gpus >= gpus_per_instance ({cost.gpus_per_instance}), train_gpus >= 1")
    terms = layout_terms(np.array([work.longest * cost.tick_seconds(1)]), np.array([decode_work_s(work, cost)]),
                         train_s(work, cost, train_gpus), cost, gen_gpus, staleness, colocated)
    limit = max(terms, key=lambda name: terms[name][0])
    return Bound(float(terms[limit][0]), gen_gpus, train_gpus, colocated, limit)


def sync_step_s(work: StepWork, cost: CostModel, gpus: int) -> float:
    """The synchronous schedule, colocated on all `gpus`, with perfect decoding: load, generate, train."""
    return cost.weight_sync_s + generation_s(work, cost, gpus) + train_s(work, cost, gpus)


def best_bound(work: StepWork, cost: CostModel, gpus: int, staleness: int) -> Bound:
    """The least seconds per step of any schedule on `gpus`: the best layout (colocated, or any split)."""
    layouts = [step_bound(work, cost, gpus, gpus, staleness, colocated=True)]
    layouts += [step_bound(work, cost, gen, gpus - gen, staleness)
                for gen in range(cost.gpus_per_instance, gpus, cost.gpus_per_instance)]
    return min(layouts, key=lambda bound: bound.step_s)


# --- the recorded runs ---------------------------------------------------------------------

def timed_steps(step_lengths: list[np.ndarray]) -> list[np.ndarray]:
    """The steps sim_runs.summarize times (the end of step 2 to the end of the last; 1-based)."""
    return step_lengths[2:]


AGES = (0, 512, 1024, 2048, 4096, 8192, 16320)  # ages at which a record gives the age-batched policy's batch


def steady_seconds_per_step(times: list[float], first: int, drained: int, time_scale: float) -> float | None:
    """Simulated seconds per step in steady state: from the end of step `first` (0-based) to that of the
    last step but `drained`, the run's last steps, which were generated before they came up (nothing was
    left to start) and only waited for the trainer; None when fewer than 2 steps remain. `times`: each
    step's end, real seconds."""
    steps = len(times) - 1 - first - drained
    return (times[-1 - drained] - times[first]) * time_scale / steps if steps >= 2 else None


def add_bounds(result: dict, step_lengths: list[np.ndarray]) -> list[dict]:
    """Add the bound, and the estimate without foresight (benchmarks/sim_tiers.py), to every record of a
    simulate_cluster result (in place); `step_lengths`: each step's response lengths as the run drew them.
    Returns the records."""
    cost = CostModel.from_dict(result["cost_model"])
    timed = timed_steps(step_lengths)
    work = mean_work(timed, cost)
    result["bound_workload"] = {**vars(work), "steps": "the timed ones, mean (train_step 2 to the last, 0-based)",
                                "derivation": "benchmarks/sim_bound.py"}
    tiered = tiers(timed, cost)
    policies, one_batch = tier_policies(tiered, cost), one_batch_policies(tiered, cost)
    best_by_case = {}  # (gpus, staleness) -> the age-batched estimate, and with one batch
    for record in result["records"]:
        gpus, staleness = record["gpus"], record["max_staleness"]
        # the run's steady state where it has one (sim_runs.summarize), else its whole window
        measured = record.get("steady_sim_seconds_per_step") or record["sim_seconds_per_step"]
        sync = next((r for r in result["records"] if r["gpus"] == gpus and r["run"] == "a"), None)
        best = best_bound(work, cost, gpus, staleness)
        own = step_bound(work, cost, record["gen_gpus"], record["train_gpus"], staleness,
                         colocated=record["gen_gpus"] + record["train_gpus"] > gpus)
        record["bound"] = {
            "sim_seconds_per_step": round(best.step_s, 2), "gen_gpus": best.gen_gpus, "train_gpus": best.train_gpus,
            "colocated": best.colocated, "limit": best.limit,
            "sim_seconds_per_step_at_this_layout": round(own.step_s, 2), "limit_at_this_layout": own.limit,
            "sync_sim_seconds_per_step": round(sync_step_s(work, cost, gpus), 2),
            # the simulated speed-up is samples/s over run a's, so its bound is a's step time over the bound's
            "speedup_over_sync": round(sync["sim_seconds_per_step"] / best.step_s, 2) if sync else None,
            "ratio": round(best.step_s / measured, 3),
            "ratio_at_this_layout": round(own.step_s / measured, 3),
        }
        if (gpus, staleness) not in best_by_case:
            best_by_case[gpus, staleness] = (
                best_tiered(policies, work.trained_tokens, cost, gpus, staleness),
                best_tiered(one_batch, work.trained_tokens, cost, gpus, staleness, edges=False))
        aged, capped = best_by_case[gpus, staleness]
        aged_own = best_tiered(policies, work.trained_tokens, cost, gpus, staleness, layouts=[
            (record["gen_gpus"], record["train_gpus"], record["gen_gpus"] + record["train_gpus"] > gpus)])
        record["age_batched"] = {
            "sim_seconds_per_step": round(aged.step_s, 2), "gen_gpus": aged.gen_gpus, "train_gpus": aged.train_gpus,
            "colocated": aged.colocated, "limit": aged.limit,
            "batch_at_age": {age: int(aged.policy.batches[min(age // tiered.width, len(aged.policy.batches) - 1)])
                             for age in AGES},
            "tail_s": round(aged.tail_s, 1), "work_instance_s": round(aged.work_s, 1),
            "sim_seconds_per_step_at_this_layout": round(aged_own.step_s, 2), "limit_at_this_layout": aged_own.limit,
            "bound_over_age_batched": round(best.step_s / aged.step_s, 3),
            "ratio": round(aged.step_s / measured, 3),
            "ratio_at_this_layout": round(aged_own.step_s / measured, 3),
            # the same with one batch at every age (a cap per instance, as the runs have)
            "one_batch": {"sim_seconds_per_step": round(capped.step_s, 2), "batch": int(capped.policy.batches[0]),
                          "gen_gpus": capped.gen_gpus, "train_gpus": capped.train_gpus, "colocated": capped.colocated,
                          "limit": capped.limit},
            "derivation": "benchmarks/sim_tiers.py",
        }
    return result["records"]


def print_table(records: list[dict], echo=print) -> None:
    # sim s/step: the run's steady state where it has one (sim_runs.summarize), else its whole window
    echo(f"{'GPUs':>5} {'run':<4}{'staleness':>10}{'simulated':>10}{'bound':>8}{'ratio':>7}   "
         f"{'sim s/step':>10}{'bound s/step':>13}  bound layout (limit)          "
         f"{'at this layout':>15}{'ratio':>7}   {'age-batched':>11}{'ratio':>7}  layout")
    for r in records:
        b, a = r["bound"], r.get("age_batched")
        layout = "colocated" if b["colocated"] else f"{b['gen_gpus']}/{b['train_gpus']}"
        speedup = f"{r['speedup_over_sync']:.2f}x" if "speedup_over_sync" in r else "-"
        bound = f"{b['speedup_over_sync']:.2f}x" if b["speedup_over_sync"] is not None else "-"
        aged = "" if a is None else (f"   {a['sim_seconds_per_step']:>11.1f}{a['ratio']:>7.2f}  "
                                     + ("colocated" if a["colocated"] else f"{a['gen_gpus']}/{a['train_gpus']}"))
        echo(f"{r['gpus']:>5} {r['run']:<4}{r['max_staleness']:>10}{speedup:>10}{bound:>8}{b['ratio']:>7.2f}   "
             f"{r.get('steady_sim_seconds_per_step') or r['sim_seconds_per_step']:>10.1f}{b['sim_seconds_per_step']:>13.1f}  "
             f"{layout + ' (' + b['limit'] + ')':<30}{b['sim_seconds_per_step_at_this_layout']:>15.1f}"
             f"{b['ratio_at_this_layout']:>7.2f}{aged}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", default=[str(RESULTS / name) for name in RESULT_FILES],
                        help="simulate_cluster results to add the bound to (rewritten in place)")
    args = parser.parse_args()
    from benchmarks.sim_layout import scheduled_lengths  # the workload as the runs drew it

    for name in args.files:
        path = Path(name)
        result = json.loads(path.read_text())
        lengths = scheduled_lengths(result["steps_per_run"], CostModel.from_dict(result["cost_model"]))
        print(f"\n{path.name}: SIMULATION against its bound (speed-ups over run a; bound: the best any "
              f"schedule could do under the cost model, at the same staleness)")
        print_table(add_bounds(result, lengths))
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
