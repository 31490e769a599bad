"""`streamrl` command line: run, validate and submit jobs.

    streamrl run CONFIG [--set a.b=value ...]
    streamrl validate CONFIG [--set ...]
    streamrl submit CONFIG --address http://HEAD:8265 [--set ...]   (to a Ray cluster)

Exit codes: 0 done, 1 the job failed, 2 the config is invalid or the cluster cannot take
the job (nothing was started).
"""

from __future__ import annotations

import argparse
import sys

from pipelines.config import ConfigError, load_config

EXIT_BAD_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description="Asynchronous streaming RL post-training on Ray Data.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("run", "run a job"), ("validate", "check a config and print it resolved"),
        ("submit", "submit a job to a running Ray cluster and follow it"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("config", help="YAML config, e.g. configs/tiny_grpo.yaml")
        command.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
            help="override a field, e.g. --set train.max_staleness=0 (repeatable)",
        )
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
    from pipelines.submit import SubmitError, submit

    try:
        job = submit(args.config, args.address, args.overrides, args.working_dir, args.wait,
                     check_cluster=args.check_cluster)
    except (ConfigError, SubmitError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except KeyboardInterrupt:
        return 130
    return 0 if not args.wait or job.status == "SUCCEEDED" else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "submit":
        return _submit(args)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.command == "validate":
        print(cfg.model_dump_json(indent=2))
        return 0
    from pipelines.grpo import run_job

    result = run_job(cfg)
    first, last = result.metrics.head(10), result.metrics.tail(10)
    print(
        f"streamrl: success rate first 10 steps {first['success_rate'].mean():.3f} -> "
        f"last 10 steps {last['success_rate'].mean():.3f}; "
        f"reward {first['reward_mean'].mean():.3f} -> {last['reward_mean'].mean():.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
