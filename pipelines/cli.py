"""`streamrl` command line: run and validate jobs.

    streamrl run CONFIG [--set a.b=value ...]
    streamrl validate CONFIG [--set ...]

Exit codes: 0 done, 1 the job failed, 2 the config is invalid (nothing was started).
"""

from __future__ import annotations

import argparse
import sys

from pipelines.config import ConfigError, load_config

EXIT_BAD_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description="Asynchronous streaming RL post-training on Ray Data.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("run", "run a job"), ("validate", "check a config and print it resolved")):
        command = commands.add_parser(name, help=text)
        command.add_argument("config", help="YAML config, e.g. configs/tiny_grpo.yaml")
        command.add_argument(
            "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
            help="override a field, e.g. --set train.max_staleness=0 (repeatable)",
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
