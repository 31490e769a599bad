"""`streamrl lineage`: from a checkpoint back to the steps, groups, policy versions and prompts
that produced it (read from the checkpoint's ledger; no MLflow needed).

    streamrl lineage RUN_ID                      the run's newest checkpoint, summarised per step
    streamrl lineage RUN_ID --step N             every group trained at step N
    streamrl lineage --checkpoint PATH           any checkpoint folder
    ... --json                                   the same as JSON, for scripts
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from operators.common.plain import plain
from pipelines.recovery.checkpoint import Checkpoint, CheckpointDir, CheckpointError, checked_run_id, find_run_dirs, verify


class LineageError(Exception):
    """The run or checkpoint asked for cannot be found or read."""


def find_run_dir(run_id: str, output_dir: str | None, instead: str = "--checkpoint PATH") -> Path:
    """`output_dir/checkpoints/RUN_ID`; without output_dir, searched under ./runs. `instead`: what the
    error suggests passing instead of a run id.
    Not pipelines.recovery.resume.resolve_run, which takes one output_dir (a job's), knows 'latest' and
    says a problem as a ConfigError of a field: this one searches every output_dir under ./runs and says
    what to pass instead. Both check the id and list the runs with pipelines/recovery/checkpoint.py."""
    try:
        checked_run_id(run_id, "the run")
    except CheckpointError as err:
        raise LineageError(str(err)) from None
    roots = [Path(output_dir)] if output_dir else sorted({p.parent.parent for p in Path("runs").glob("**/checkpoints/*")})
    for root in roots:
        run_dir = CheckpointDir.of_run(root, run_id).root
        if run_dir.is_dir():
            return run_dir
    known = [p.name for root in roots for p in find_run_dirs(root)][-5:]
    where = output_dir or "./runs"
    raise LineageError(f"no run {run_id!r} under {where} (recent runs: {', '.join(known) or 'none'}); "
                       f"pass --output-dir (the job's output_dir) or {instead}")


def open_checkpoint(path: Path) -> Checkpoint:
    try:
        state = verify(path)
    except CheckpointError as err:
        raise LineageError(str(err)) from None
    return Checkpoint(path, int(state["step"]), state)


def newest_checkpoint(run_dir: Path) -> Checkpoint:
    checkpoint = CheckpointDir(run_dir).latest_valid(echo=lambda _: None)
    if checkpoint is None:
        raise LineageError(f"{run_dir} has no complete checkpoint yet")
    return checkpoint


def lineage(checkpoint: Checkpoint, step: int | None = None) -> dict:
    """What produced `checkpoint`: a header, a per-step summary, and the groups (of `step`, or all).

    Steps count from 1 as everywhere a user reads one (the terminal's `step 40/40`, MLflow, the checkpoint
    `step_000040` that holds steps 1-40, group ids `s000040-g0000`): step N is the ledger's `train_step`
    N - 1, the step's 0-based index (the policy version it trained from)."""
    ledger = checkpoint.ledger()
    if step is not None:
        if not 1 <= step <= checkpoint.step:
            raise LineageError(
                f"step {step} is not in checkpoint {checkpoint.path} (it holds steps 1-{checkpoint.step}); "
                "a later checkpoint holds it, or the run's MLflow artifact rollouts/step_NNNNNN.parquet does"
            )
        ledger = ledger[ledger["train_step"] == step - 1]
    per_step = ledger.assign(step=ledger["train_step"] + 1).groupby("step").agg(
        groups=("group_uid", "size"),
        version_min=("policy_version", "min"), version_max=("policy_version", "max"),
        staleness_max=("staleness", "max"), trained=("trained", "all"),
        prompt_ids=("prompt_id", lambda ids: list(ids)),
    ).reset_index()
    state = checkpoint.state
    return {
        "checkpoint": str(checkpoint.path), "run_id": state.get("run_id"), "step": checkpoint.step,
        "policy_version": state.get("policy_version"), "dataset": state.get("dataset"),
        "dataset_digest": state.get("dataset_digest"),
        "model_path": state.get("model_path"),
        "groups": int(len(ledger)), "distinct_prompts": int(ledger["prompt_id"].nunique()),
        "skipped_steps": [int(s) for s in per_step.loc[~per_step["trained"], "step"]],
        "steps": per_step.to_dict("records"),
        "ledger": ledger.to_dict("records"),
        **({"episodes": step_episodes(checkpoint, step), "prompts": step_prompts(checkpoint, step)}
           if step is not None else {}),
    }


def step_prompts(checkpoint: Checkpoint, step: int) -> dict[str, str]:
    """Each group of step `step` and its prompt as the model read it (`prompt_text`: the chat template
    applied, operators/common/prompts.py), from the step's rollouts Parquet ({} without the file)."""
    path = rollouts_file(checkpoint, step)
    if not path.is_file():
        return {}
    table = pd.read_parquet(path)
    column = "prompt_text" if "prompt_text" in table.columns else "prompt"
    return {str(uid): str(text) for uid, text in zip(table["group_uid"], table[column])}


def rollouts_file(checkpoint: Checkpoint, step: int) -> Path:
    """Where the job kept step `step`'s rollouts (tracking.log_rollouts), for this checkpoint's run."""
    run_dir = checkpoint.path.parent
    return find_rollouts(run_dir.parent.parent, run_dir.name, step)


def find_rollouts(output_dir: Path | str, run_id: str, step: int) -> Path:
    """Step `step`'s rollouts Parquet: output_dir/rollouts/RUN_ID/attempt_N/ of the newest attempt that trained
    the step (a restart trains the steps after its checkpoint again: the newest is the one the later
    checkpoints carry on from); where no attempt kept it, the path it would have in attempt_1 (not a file)."""
    base = Path(output_dir) / "rollouts" / run_id
    name = f"step_{step:06d}.parquet"
    attempts = [(int(folder.name.removeprefix("attempt_")), folder) for folder in base.glob("attempt_*")
                if folder.name.removeprefix("attempt_").isdigit() and (folder / name).is_file()]
    return max(attempts)[1] / name if attempts else base / "attempt_1" / name


def step_episodes(checkpoint: Checkpoint, step: int) -> list[dict]:
    """The multi-turn episodes of step `step` (rollout.environment), from its rollouts Parquet: per episode
    its group, reward, what ended it and its turns ([] for single-turn steps or without the file)."""
    path = rollouts_file(checkpoint, step)
    if not path.is_file():
        return []
    table = pd.read_parquet(path)
    if "turns" not in table.columns:
        return []
    episodes = []
    for row in table.to_dict("records"):
        for index, turns in enumerate(row["turns"]):
            episodes.append({
                "group_uid": row["group_uid"], "prompt_id": row["prompt_id"], "episode": index,
                "prompt": row.get("prompt_text", row["prompt"]), "reward": float(row["rewards"][index]),
                "end": str(row["episode_ends"][index]), "turns": json.loads(turns),
            })
    return episodes


def _versions(row: dict) -> str:
    low, high = int(row["version_min"]), int(row["version_max"])
    return str(low) if low == high else f"{low}-{high}"


def format_lineage(info: dict, step: int | None) -> str:
    lines = [
        f"checkpoint {info['checkpoint']}",
        f"  run {info['run_id']} | step {info['step']} | policy version {info['policy_version']}",
        f"  dataset {info['dataset']} (digest {info['dataset_digest']})",
        f"  model {info['model_path']}",
    ]
    steps = info["steps"]
    if not steps:
        return "\n".join(lines + ["  (no groups)"])
    if step is None:
        first, last = steps[0]["step"], steps[-1]["step"]
        lines.append(f"  produced by steps {first}-{last}: {info['groups']} groups, {info['distinct_prompts']} distinct "
                     f"prompt ids, skipped steps: {info['skipped_steps'] or 'none'}")
        lines.append(f"  {'step':>5} {'groups':>6} {'versions':>9} {'stale':>5}  prompt ids")
        for row in steps:
            ids = " ".join(map(str, row["prompt_ids"][:6])) + (" ..." if len(row["prompt_ids"]) > 6 else "")
            lines.append(f"  {row['step']:>5} {row['groups']:>6} {_versions(row):>9} {row['staleness_max']:>5}  {ids}")
        return "\n".join(lines)
    lines.append(f"  step {step}: {info['groups']} groups" + ("" if steps[0]["trained"] else " (skipped: loss not finite)"))
    lines.append(f"  {'group_uid':<16} {'prompt_id':<16} {'epoch':>5} {'version':>7} {'stale':>5}")
    for row in info["ledger"]:
        lines.append(f"  {row['group_uid']:<16} {str(row['prompt_id']):<16} {row['epoch']!s:>5} "
                     f"{row['policy_version']:>7} {row['staleness']:>5}")
    if info.get("prompts"):
        lines.append("  prompts as the model read them (prompt_text: the chat template applied, if any):")
        for uid, text in info["prompts"].items():
            lines.append(f"  {uid:<16} {text!r}")
    if info.get("episodes"):
        lines.append(f"  episodes ({len(info['episodes'])}): turn: model text -> tool call -> observation [reward]")
        for episode in info["episodes"]:
            lines.append(f"  {episode['group_uid']} #{episode['episode']} {episode['prompt']!r}: reward "
                         f"{episode['reward']:g}, ended by {episode['end']}")
            for number, turn in enumerate(episode["turns"], start=1):
                parts = [repr(turn.get("text", ""))]
                if turn.get("tool_call"):
                    parts.append(f"call {turn['tool_call']}")
                if turn.get("observation"):
                    parts.append(f"-> {turn['observation']!r}")
                if turn.get("error"):
                    parts.append(f"(error: {turn['error']})")
                if turn.get("trained") is False:  # an agent's call outside the chain its sample trains on
                    parts.append("(not trained: a later call did not extend it)")
                if turn.get("reward") is not None:
                    parts.append(f"[{turn['reward']:g}]")
                lines.append(f"      {number}. " + " ".join(parts))
    return "\n".join(lines)


def lineage_command(run_id: str | None, step: int | None, checkpoint: str | None, output_dir: str | None,
                    as_json: bool) -> str:
    if checkpoint:
        opened = open_checkpoint(Path(checkpoint))
    elif run_id:
        opened = newest_checkpoint(find_run_dir(run_id, output_dir))
    else:
        raise LineageError("give a RUN_ID or --checkpoint PATH")
    info = lineage(opened, step)
    if as_json:
        return json.dumps(info, indent=1, default=lambda value: plain(value, otherwise=str))
    return format_lineage(info, step)


