"""`streamrl` command line: run, validate and submit jobs.

    streamrl run CONFIG [--set a.b=value ...] [--resume RUN_ID|latest]
    streamrl validate CONFIG [--set ...]
    streamrl submit CONFIG --address http://HEAD:8265 [--set ...]   (to a Ray cluster)
    streamrl lineage RUN_ID [--step N] [--output-dir DIR] | --checkpoint PATH   [--json]
    streamrl eval CHECKPOINT | RUN_ID [--step N] [--data FILE] [--reward NAME ...] [--set ...]
    streamrl sync CONFIG RUN_ID|latest [--set ...]   (deliver records MLflow did not get before the job ended)
    streamrl plan CONFIG [--gpus N --gpu-memory-gb G [--nodes K] [--cpus C]] [--model-config FILE] [--set ...]
                  (placement, memory per GPU and per host, object store, /dev/shm, weight plane: no cluster needed)

Exit codes: 0 done, 1 the job failed (the command that resumes it is printed), 2 the config
or input is invalid or the cluster cannot take the job (nothing was started), 75 stopped on
SIGTERM after a checkpoint (train.on_preempt; resumable, the command is printed), 130 interrupted;
`sync`: 1 when MLflow stopped answering (run it again).
"""

from __future__ import annotations

import argparse
import sys

from pipelines.config.base import ConfigError
from pipelines.config.load import load_config
from pipelines.runtime.quiet import quiet_driver

EXIT_BAD_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description="Asynchronous streaming RL post-training on Ray Data.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("run", "run a job"), ("validate", "check a config and everything it reads (every dataset row, the "
                                    "models, the reward functions' columns) as `run` does, and print it resolved"),
        ("submit", "submit a job to a running Ray cluster and follow it"),
        ("sync", "deliver to MLflow what a run could not before it ended (an outage at its end)"),
        ("plan", "what the config needs from a cluster, worked out without one: placement, memory per GPU and "
                 "per host, object store, /dev/shm, weight plane (estimates)"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("config", help="YAML config, e.g. configs/tiny_grpo.yaml")
        command.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
            help="override a field, e.g. --set train.max_staleness=0 (repeatable)",
        )
    commands.choices["run"].add_argument(
        "--resume", metavar="RUN_ID|latest",
        help="continue a run from its newest checkpoint, in the same MLflow run ('latest': the newest run "
        "under the config's output_dir)",
    )
    commands.choices["sync"].add_argument("run", metavar="RUN_ID|latest", help="the run ('latest': the newest "
                                          "run under the config's output_dir)")
    plan = commands.choices["plan"]
    plan.add_argument("--gpus", type=int, help="GPUs per node of the cluster to plan on (default: the config's "
                      "ray.cluster)")
    plan.add_argument("--gpu-memory-gb", type=float, help="memory of each GPU in GiB, e.g. 80")
    plan.add_argument("--nodes", type=int, default=1, help="nodes of that shape (default 1)")
    plan.add_argument("--cpus", type=float, help="CPUs per node (default 12 per GPU; 8 without GPUs)")
    plan.add_argument("--model-config", help="the model's config.json, when model.path is a Hub id not in the "
                      "local cache")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    lineage = commands.add_parser("lineage", help="what produced a checkpoint: steps, groups, policy versions, prompts")
    lineage.add_argument("run_id", nargs="?", help="the run (its newest checkpoint)")
    lineage.add_argument("--step", type=int, help="list every group trained at this step")
    lineage.add_argument("--checkpoint", help="a checkpoint folder (.../checkpoints/RUN_ID/step_NNNNNN)")
    lineage.add_argument("--output-dir", help="the job's output_dir (default: searched under ./runs)")
    lineage.add_argument("--json", action="store_true", help="print JSON")
    evaluate = commands.add_parser(
        "eval", help="score a checkpoint on held-out prompts (a Ray Data batch job, logged in MLflow under its run)"
    )
    evaluate.add_argument("target", help="a checkpoint folder (.../checkpoints/RUN_ID/step_NNNNNN), a run folder, "
                          "or a run id (its newest checkpoint)")
    evaluate.add_argument("--step", type=int, help="the run's checkpoint of this step instead of its newest")
    evaluate.add_argument("--data", help="held-out prompts: .parquet/.jsonl/.csv with a prompt column, or "
                          "builtin:arithmetic-heldout (default: the run's eval.data)")
    evaluate.add_argument("--reward", dest="rewards", action="append", metavar="NAME",
                          help="reward function instead of the run's (builtin name or module:function; repeatable)")
    evaluate.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                          help="override a field of the run's config, e.g. --set eval.n=16 (repeatable); "
                          "--set model.trust_remote_code=true runs the checkpoint's own code (never taken from "
                          "the checkpoint)")
    evaluate.add_argument("--output-dir", help="the job's output_dir, to find a run id (default: searched under ./runs)")
    evaluate.add_argument("--output", help="Parquet file for the scored responses "
                          "(default: <output_dir>/eval/RUN_ID/checkpoint_step_NNNNNN.parquet)")
    evaluate.add_argument("--json", action="store_true", help="print the result as JSON")
    submit = commands.choices["submit"]
    submit.add_argument("--address", required=True, help="the Ray job server (head's dashboard), e.g. http://127.0.0.1:8265")
    submit.add_argument("--working-dir", default=".", help="folder uploaded as the job's code (default: here)")
    submit.add_argument("--no-wait", dest="wait", action="store_false", help="print the job id and return")
    submit.add_argument(
        "--skip-cluster-checks", dest="check_cluster", action="store_false",
        help="skip checking that tracking.uri answers and that the job fits the cluster's current nodes "
        "(an autoscaler will add them)",
    )
    return parser


def _submit(args) -> int:
    from pipelines.runtime.submit import SubmitError, submit

    try:
        job = submit(args.config, args.address, args.overrides, args.working_dir, args.wait,
                     check_cluster=args.check_cluster)
    except (ConfigError, SubmitError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except KeyboardInterrupt:
        return 130
    return 0 if not args.wait or job.status == "SUCCEEDED" else 1


def _plan(args) -> int:
    import json

    from pipelines.runtime.plan import PlanError, cluster_overrides, find_shape, job_plan, plan_text

    try:
        cfg = load_config(args.config, args.overrides + cluster_overrides(args.gpus, args.gpu_memory_gb, args.nodes,
                                                                          args.cpus))
        record = job_plan(cfg, *find_shape(cfg, args.model_config))
    except (ConfigError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(json.dumps(record, indent=1) if args.json else plan_text(args.config, record))
    return EXIT_BAD_CONFIG if record["problems"] else 0


def _lineage(args) -> int:
    from pipelines.tracking.lineage import LineageError, lineage_command

    try:
        print(lineage_command(args.run_id, args.step, args.checkpoint, args.output_dir, args.json))
    except LineageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return 0


def _eval(args) -> int:
    import json

    from pipelines.evaluation.job import EvalError, eval_command

    echo = (lambda line: print(line, file=sys.stderr)) if args.json else print
    try:
        summary = eval_command(args, echo)
    except (EvalError, ConfigError) as err:  # nothing was started
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0


def _sync(args, cfg) -> int:
    from pipelines.tracking.sync import SyncFailed, sync_run

    try:
        sync_run(cfg, args.run)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except SyncFailed as err:
        print(f"streamrl: {err}", file=sys.stderr)
        return 1
    return 0


def _run(args, cfg) -> int:
    from pipelines.job import JobFailed, run_job
    from pipelines.recovery.resume import resume_command

    try:
        result = run_job(cfg, resume=args.resume)
    except ConfigError as err:  # bad input found before anything started (data, --resume)
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except JobFailed as err:
        from pipelines.recovery.preemption import PREEMPTED_EXIT

        what = "stopped" if err.preempted else "interrupted" if err.interrupted else "failed"
        print(f"streamrl: job {what}: {err}", file=sys.stderr)
        print(f"streamrl: resume with: {resume_command(args.config, args.overrides, err.run_id)}", file=sys.stderr)
        return PREEMPTED_EXIT if err.preempted else 130 if err.interrupted else 1
    if result.metrics.empty:  # a resumed run has at least one step left (a finished one is refused)
        print("streamrl: nothing was trained")
        return 0
    from pipelines.tracking.progress import summary_window

    edge = summary_window(len(result.metrics))
    first, last = result.metrics.head(edge), result.metrics.tail(edge)
    print(
        f"streamrl: success rate first {edge} steps {first['success_rate'].mean():.3f} -> "
        f"last {edge} steps {last['success_rate'].mean():.3f}; "
        f"reward {first['reward_mean'].mean():.3f} -> {last['reward_mean'].mean():.3f}"
    )
    held_out = result.eval_metrics
    if "eval/success_rate" in held_out:
        start, end = held_out.iloc[0], held_out.iloc[-1]
        print(f"streamrl: held-out success (eval) step {int(start['step'])} {start['eval/success_rate']:.3f} -> "
              f"step {int(end['step'])} {end['eval/success_rate']:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_driver()  # streamrl's own lines only: pipelines/runtime/quiet.py says what goes and why
    if args.command == "submit":
        return _submit(args)
    if args.command == "lineage":
        return _lineage(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "eval":
        return _eval(args)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    for line in cfg.algorithm.chosen():  # fields the algorithm set because the config left them unset
        print(f"streamrl: {line}", file=sys.stderr if args.command == "validate" else sys.stdout)
    if args.command == "validate":
        from pipelines.data.inputs import check_inputs

        try:  # the check `streamrl run` makes before it starts anything; nothing is downloaded or built
            check_inputs(cfg, lambda line: print(line, file=sys.stderr), source=args.config)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        print(cfg.model_dump_json(indent=2))
        return 0
    if args.command == "sync":
        return _sync(args, cfg)
    return _run(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
