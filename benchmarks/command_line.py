"""Every benchmark script's entry, so that it behaves as `streamrl run` does (pipelines/cli.py): the driver's
quiet settings first (pipelines/runtime/quiet.py); a config or input that is refused before anything starts
is `error: <the problems>` on stderr and exit code 2, not a traceback; Ctrl-C is exit code 130.

    if __name__ == "__main__":
        sys.exit(run_command(main))
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

EXIT_BAD_CONFIG = 2  # pipelines/cli.py's
EXIT_INTERRUPTED = 130


class BadConfig(Exception):
    """A `streamrl` command that a benchmark ran in a process of its own refused its config or input (exit code
    2); the message is that command's, or empty when it reached the terminal already."""


def check_config(config: str, overrides: list[str]) -> None:
    """ConfigError now, in this process, for a config a `streamrl` subprocess would refuse: before the benchmark
    starts anything or writes a result."""
    from pipelines.config.load import load_config

    load_config(config, overrides)


def refused(stderr: str) -> BadConfig:
    """The BadConfig of a `streamrl` subprocess that exited with EXIT_BAD_CONFIG, with its `error:` message."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("error:")), len(lines))
    return BadConfig("\n".join(lines[start:]))


def run_child(command: list[str], **kwargs) -> None:
    """`subprocess.run(command, check=True, **kwargs)` for a child that is itself a benchmark or a `streamrl`
    command: its refusal of the config (exit code 2, its message on the terminal already) is this command's."""
    done = subprocess.run(command, **kwargs)
    if done.returncode == EXIT_BAD_CONFIG:
        raise BadConfig("")
    done.check_returncode()


def run_command(main: Callable[[], object]) -> int:
    """Run a benchmark's `main`; its exit code (an int it returns, else 0)."""
    from pipelines.config.base import ConfigError
    from pipelines.runtime.quiet import quiet_driver

    quiet_driver()
    try:
        code = main()
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except BadConfig as err:
        if str(err):
            print(err, file=sys.stderr)
        return EXIT_BAD_CONFIG
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return code if isinstance(code, int) else 0
