"""The driver's side of quiet runs: third-party lines that would reach a user's terminal from the driver
(`streamrl`, benchmarks/command_line.py) and tell them nothing they can act on, filtered where they start,
each with the reason it is noise. Warnings of any other kind, and every error, still show. The actors' side
(vLLM's engines): operators/common/quiet.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings

# MLflow 3.17 registers its local-file dataset source twice (for the URI schemes "" and "file"), so every
# local dataset file resolves "in multiple ways" to the one class, and MLflow warns before it picks it.
MLFLOW_TWO_LOCAL_SOURCES = ("The specified dataset source can be interpreted in multiple ways: "
                            "LocalArtifactDatasetSource, LocalArtifactDatasetSource.")


def quiet_driver() -> None:
    """First thing in a command that runs jobs in this process."""
    # MLflow's INFO lines on creating or upgrading the sqlite store's tables (every first run).
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    # The driver never trains; transformers imports DeepSpeed there (its integration, when the driver builds or
    # converts a builtin model), and DeepSpeed, told no accelerator, warns that it fell back to the CPU. The
    # ranks get theirs from the trainer group (pipelines/runtime/trainer_group.py), every other Ray worker the
    # same CPU default (pipelines/runtime/session.py WORKER_ENV).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    quiet_transformers_progress()
    quiet_mlflow_dataset_sources()


def quiet_transformers_progress() -> None:
    """transformers' own progress bars ("Writing model shards", "Loading weights") over a model the driver
    builds or converts in seconds go; the Hub's download bars stay (a download can take minutes). The user's
    HF_HUB_DISABLE_PROGRESS_BARS, either way, wins."""
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") is not None:
        return
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    disable_progress_bars()  # what transformers reads once, when it is imported
    enable_progress_bars("huggingface_hub")  # the Hub's own bars are a group of their own
    if "transformers.utils.logging" in sys.modules:  # imported already: tell it directly
        sys.modules["transformers.utils.logging"].disable_progress_bar()


def quiet_mlflow_dataset_sources() -> None:
    warnings.filterwarnings("ignore", message=re.escape(MLFLOW_TWO_LOCAL_SOURCES), category=UserWarning)


@contextlib.contextmanager
def stderr_to_devnull():
    """File descriptor 2 of this process points at /dev/null inside the block (what C++ writes there too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def spend_actor_restart_warning() -> None:
    """Ray's core worker logs once per process, as an error on stderr, that an actor which may restart has
    constructor arguments in the object store (ray-project/ray#53727: a restart fails if they are gone). Ray
    Data starts every actor of a pool that way (its UDF and DataContext, ray.put by the driver, max_restarts
    -1), so every job's first actor pool would print it, for arguments that live as long as the dataset. Spent
    here, on the driver's connection to Ray, with a throwaway actor and stderr on /dev/null for that one call;
    Ray's own driver log (logs/python-core-driver-*.log) still records it."""
    import ray

    @ray.remote(num_cpus=0, max_restarts=1)
    class _Spend:
        def __init__(self, argument):
            pass

    argument = ray.put(b"")
    with stderr_to_devnull():
        actor = _Spend.remote(argument)
    ray.kill(actor, no_restart=True)
