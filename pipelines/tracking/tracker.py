"""MLflow lineage: what a user needs to walk from a checkpoint back to its prompts.

Per job: the flattened config as params; code and package versions as tags; the prompt
dataset as a dataset input (digest + source); one set of metrics per train step; each
step's rollouts as Parquet (prompt_id, group_uid, policy_version, train_step, ...); the
checkpoints, tagged with the step that made them; the final checkpoint's policy as an MLflow model
with its lineage (pipelines/tracking/policy_model.py).

A tracking server that goes away mid-job must not stop training nor lose a record: after the
start of a job (which talks to MLflow directly, and fails before anything starts when it cannot),
every write is appended to the run's spool on local disk and a background thread delivers it
(pipelines/tracking/spool.py says how). The run's code, package versions and dataset inputs are
recorded by pipelines/tracking/run_inputs.py.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd

from operators.common.durable import is_disk_full
from pipelines.config.job import JobConfig
from pipelines.config.load import flatten
from pipelines.tracking.run_inputs import code_version, dataset_name, log_dataset_input, package_versions
from pipelines.tracking.spool import BATCH_LIMIT, SPOOL_FOLDER, Delivery, Spool, describe, refused, short_error

NON_METRIC_COLUMNS = {"step", "rollouts_parquet", "rollouts_path", "stopped"}  # stopped: the last step of a graceful stop
# The line a job prints when its run starts; `streamrl submit` finds it in the job's logs.
RUN_ANNOUNCEMENT = re.compile(r"^streamrl: MLflow run (?P<run_id>\w+) (?P<url>\S+)", re.MULTILINE)
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
MAX_TAG_CHARS = 5000


def announce_run(tracker) -> str:
    if tracker.run_id is None:
        return "streamrl: MLflow tracking disabled"
    return f"streamrl: MLflow run {tracker.run_id} {tracker.run_url}"


class Tracker:
    """Records one job as one MLflow run. All MLflow calls of a job go through here.

    `resume_run_id` re-opens that run (a resumed job): the undelivered tail of its spool goes
    first, params already recorded are not logged again, the dataset input is not repeated,
    and the tag `resume.count` counts the resumes. `echo` prints the few lines a user must see
    (MLflow unreachable, reachable again, records left undelivered)."""

    def __init__(
        self, cfg: JobConfig, prompts: pd.DataFrame, source: str, resume_run_id: str | None = None,
        echo: Callable[[str], None] = print,
    ):
        import mlflow
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.tracking.context.registry import resolve_tags
        from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

        self.mlflow = mlflow
        self.echo = echo
        self.output_dir = Path(cfg.output_dir).resolve()
        self.log_rollouts = cfg.tracking.log_rollouts
        self.flush_timeout_s = cfg.tracking.flush_timeout_s
        self.tracking_uri = cfg.tracking_uri()
        if self.tracking_uri.startswith(("http://", "https://")):
            # MLflow's HTTP client retries a failed request 7 times with growing backoff (about 4
            # minutes) and waits 120 s for an answer. The writer below does its own retrying, and
            # must notice an outage in seconds to buffer instead of stalling the queue, so one
            # request here is tried twice and waits request_timeout_s. A user's own settings win.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(cfg.tracking.request_timeout_s))
        mlflow.set_tracking_uri(self.tracking_uri)  # callers read the run back through mlflow.*
        # Explicit run ids through a client, never the fluent active run: the writer thread has no
        # active run, and an abandoned tracker must not block the next one in the same process.
        self.client = client = MlflowClient(self.tracking_uri)

        if resume_run_id:
            run = client.get_run(resume_run_id)
            if run.info.lifecycle_stage == "deleted":
                raise ValueError(f"--resume {resume_run_id}: that MLflow run is deleted; restore it or start anew")
            experiment = client.get_experiment(run.info.experiment_id)
            if experiment.name != cfg.tracking.experiment:
                raise ValueError(
                    f"--resume {resume_run_id}: that run is in experiment {experiment.name!r}, the config's "
                    f"tracking.experiment is {cfg.tracking.experiment!r}"
                )
            client.update_run(resume_run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(cfg.tracking.experiment)
            if experiment is None:
                # With the default sqlite store, keep artifacts beside the database, not in ./mlruns.
                location = (self.output_dir / "mlartifacts").as_uri() if cfg.tracking.uri is None else None
                experiment_id = client.create_experiment(cfg.tracking.experiment, artifact_location=location)
            else:
                experiment_id = experiment.experiment_id
            user_tags = {MLFLOW_RUN_NAME: cfg.tracking.run_name} if cfg.tracking.run_name else {}
            run = client.create_run(experiment_id, tags=resolve_tags(user_tags), run_name=cfg.tracking.run_name)
        self.run = run
        self.run_id = run_id = run.info.run_id
        self.resumed = bool(resume_run_id)

        params = {key: str(value)[:MAX_PARAM_CHARS] for key, value in flatten(cfg).items()}
        tags = {"code_version": code_version(), **package_versions()}
        if self.resumed:
            # MLflow refuses a param logged again with another value: keep the run's, and say which differ.
            recorded = run.data.params
            changed = sorted(key for key, value in params.items() if key in recorded and recorded[key] != value)
            params = {key: value for key, value in params.items() if key not in recorded}
            tags["resume.count"] = str(int(run.data.tags.get("resume.count", "0")) + 1)
            if changed:
                tags["resume.changed_params"] = ",".join(changed)[:MAX_TAG_CHARS]
            elif "resume.changed_params" in run.data.tags:
                client.delete_tag(run_id, "resume.changed_params")  # it described an earlier resume
        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), BATCH_LIMIT):
            client.log_batch(run_id, params=items[start:start + BATCH_LIMIT])
        self._log_tags_now(tags)
        self.datasets: dict[str, dict] = {}  # the run's dataset inputs by context: name and digest
        self.dataset_digest = self.log_dataset(prompts, source, "training")

        # From here on, every write goes through the spool and the writer thread.
        self.spool = Spool(self.output_dir / SPOOL_FOLDER, run_id)
        self.spool_path = self.spool.path
        self.delivery = Delivery(client, run_id, self.tracking_uri, self.spool_path, self._say)
        ops, delivered = self.spool.load()
        # (record, whether it is a spool line): undelivered, in order; a record the spool could not take
        # (a full disk) is delivered all the same, and does not move the spool's delivered counter.
        self._queue = collections.deque((op, True) for op in ops[delivered:])
        self._appended, self._delivered, self._spool_delivered = len(ops), delivered, delivered
        self._memory_only = 0  # records held in memory only (the spool's disk was full)
        self._cond = threading.Condition()
        self._stop = self._poke = self._closed = False
        self._outage: dict | None = None  # since when, how many delivered then
        if self._queue:
            self._say(f"streamrl: resuming MLflow run {run_id}; delivering {len(self._queue)} records "
                      f"left undelivered in {self.spool_path}")
        self._writer = threading.Thread(target=self._write_loop, name=f"mlflow-writer-{run_id[:8]}", daemon=True)
        self._writer.start()

    @property
    def refused(self) -> int:
        """Records the server rejected outright (kept in the spool, not retried)."""
        return self.delivery.refused

    def metric_steps(self, key: str) -> set[int]:
        """Steps at which the run already has metric `key` (a resumed run asks; none if MLflow cannot say)."""
        try:
            return {m.step for m in self.client.get_metric_history(self.run_id, key)}
        except Exception:  # noqa: BLE001 - unreachable: the caller just does the work again
            return set()

    def train_steps_logged(self) -> set[int]:
        """Train steps this run has logged (a row carries `policy_version`): what its spool holds, delivered
        or not (so also while MLflow is unreachable), and what MLflow has (a spool left on another machine)."""
        ops, _ = self.spool.load()
        spooled = {int(op["step"]) for op in ops if op.get("op") == "metrics" and "policy_version" in op["metrics"]}
        return spooled | self.metric_steps("policy_version")

    def log_dataset(self, prompts: pd.DataFrame, source: str, context: str) -> str:
        """Record a dataset as an input of the run ("training", "eval"), once per digest; its digest."""
        digest = log_dataset_input(self.client, self.run, prompts, source, context)
        self.datasets[context] = {"name": dataset_name(source), "digest": digest}
        return digest

    @property
    def run_url(self) -> str:
        """The run's page on a tracking server, else the tracking URI (open it with `mlflow ui`)."""
        uri = self.tracking_uri
        if uri.startswith(("http://", "https://")):
            return f"{uri.rstrip('/')}/#/experiments/{self.run.info.experiment_id}/runs/{self.run_id}"
        return uri

    @property
    def pending(self) -> int:
        """Records written to the spool and not yet delivered to MLflow."""
        with self._cond:
            return self._appended - self._delivered

    # -- what callers log; each returns after a local append, never waiting on MLflow ------------

    def log_step(self, row: dict) -> None:
        step = int(row["step"])
        metrics = {
            key: float(value) for key, value in row.items()
            if key not in NON_METRIC_COLUMNS and isinstance(value, (int, float)) and not math.isnan(value)
        }
        if metrics:
            self._enqueue({"op": "metrics", "step": step, "timestamp": int(time.time() * 1000), "metrics": metrics})
        if self.log_rollouts and row.get("rollouts_path"):  # written by the Train operator, atomically
            self.log_artifact(row["rollouts_path"], "rollouts")

    def log_artifact(self, file: Path | str, artifact_path: str | None = None) -> None:
        """Upload a local file; it must stay where it is until delivered (see `pending`)."""
        self._enqueue({"op": "artifact", "path": str(Path(file).resolve()), "artifact_path": artifact_path})

    def log_checkpoint(self, path: Path, step: int, exclude: tuple[str, ...] = ("engine",)) -> str:
        """Upload a checkpoint folder, except its top-level subfolders named in `exclude` (a
        resumable checkpoint keeps the DeepSpeed optimizer state in engine/: large, and only
        useful to this job's resume, so it stays local), and point the run's tags at it. The tags
        follow the files in the queue: once `checkpoint.latest` is set, its files are there."""
        path = Path(path).resolve()
        artifact_path = f"checkpoints/step_{step:06d}"
        if not path.is_dir():
            # Pruned (train.checkpoint_keep) by newer checkpoints before this driver got to its row: nothing
            # to upload, and no reason to stop a job that trains on. The tags keep pointing at the last one.
            self._say(f"streamrl: checkpoint {path} was pruned (train.checkpoint_keep) before it was logged; "
                      "not uploaded")
            return artifact_path
        for entry in sorted(path.iterdir()):
            if entry.is_dir():
                if entry.name not in exclude:
                    self._enqueue({"op": "artifacts", "path": str(entry), "artifact_path": f"{artifact_path}/{entry.name}"})
            else:
                self._enqueue({"op": "artifact", "path": str(entry), "artifact_path": artifact_path})
        self.set_tags({
            "checkpoint.latest": artifact_path, "checkpoint.latest_step": str(step), "checkpoint.latest_path": str(path),
        })
        # Delivered after its files: from then on the Train operator may prune it (CheckpointDir.prune).
        self._enqueue({"op": "uploaded", "path": str(path)})
        return artifact_path

    def log_model(self, record: dict) -> None:
        """Log a checkpoint's policy as an MLflow model of the run (`record`: policy_model.model_record).
        Its folder must stay where it is until delivered; then the run's `model.latest_*` tags name it."""
        self._enqueue({"op": "model", **record})

    def set_tags(self, tags: dict) -> None:
        if tags:
            self._enqueue({"op": "tags", "tags": {key: str(value)[:MAX_TAG_CHARS] for key, value in tags.items()}})

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything logged before this call is delivered (True), or `timeout_s`
        passes (False). A writer backing off after a failure tries again right away."""
        with self._cond:
            target = self._appended
            self._poke = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._delivered >= target or self._stop, timeout=timeout_s) and \
                self._delivered >= target

    def close(self, status: str = "FINISHED", timeout_s: float | None = None) -> None:
        """Deliver what is buffered (up to tracking.flush_timeout_s, or `timeout_s` when shorter: a
        graceful stop's grace period), then end the run. Never raises: the job's result must not depend
        on the tracking server; what is not delivered stays in the spool for a resume."""
        if self._closed:
            return
        started = time.monotonic()
        self._enqueue({"op": "end", "status": status})  # the run's end, delivered last like any record
        self._closed = True
        drained = self.flush(self.flush_timeout_s if timeout_s is None else min(self.flush_timeout_s, timeout_s))
        self._stop_writer()
        if not drained:
            self._say(
                f"streamrl: {self.pending} MLflow records still undelivered after "
                f"{time.monotonic() - started:.0f}s (tracking.flush_timeout_s), the run's end ({status}) "
                f"among them; they are kept in {self.spool_path}; `streamrl sync CONFIG {self.run_id}` will "
                "deliver them"
            )

    # -- the spool and the writer thread --------------------------------------------------------

    def _log_tags_now(self, tags: dict) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(key, str(value)[:MAX_TAG_CHARS]) for key, value in tags.items()]
        for start in range(0, len(items), BATCH_LIMIT):
            self.client.log_batch(self.run_id, tags=items[start:start + BATCH_LIMIT])

    def _enqueue(self, op: dict) -> None:
        with self._cond:
            try:
                self.spool.append(op)  # under the lock: spool line order is delivery order
                spooled = True
            except OSError as err:
                if not is_disk_full(err):
                    raise
                spooled = False
                self._memory_only += 1
                if self._memory_only == 1:
                    self._say(f"streamrl: the disk of {self.spool_path} is full ({err.strerror}); MLflow records are "
                              "held in memory until delivered (the checkpoints keep each step's metrics for a "
                              "resume); training continues")
            self._queue.append((op, spooled))
            self._appended += 1
            self._cond.notify_all()

    def _stop_writer(self, join_s: float = 5.0) -> None:
        """Stop retrying. A request in flight may still complete (the thread is a daemon)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._writer.join(join_s)

    def _say(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a broken terminal must not stop delivery
            self.echo(line)

    def _write_loop(self) -> None:
        delay = BACKOFF_FIRST_S
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stop)
                if self._stop:
                    return
                op, spooled = self._queue[0]
                self._poke = False
            try:
                self.delivery.deliver(op, live=not self._closed)
            except Exception as err:  # noqa: BLE001 - anything else is an outage: keep the op, retry
                if refused(err):
                    self.delivery.refused += 1
                    self._say(f"streamrl: MLflow refused a record ({short_error(err)}); skipped, it stays in "
                              f"{self.spool_path}: {describe(op)}")
                else:
                    with self._cond:
                        first = self._outage is None
                        if first:
                            self._outage = {"since": time.monotonic(), "delivered": self._delivered}
                    if first:
                        self._say(f"streamrl: MLflow unreachable ({short_error(err)}); buffering records in "
                                  f"{self.spool_path}; training continues")
                    with self._cond:
                        self._cond.wait_for(lambda: self._stop or self._poke, timeout=delay)
                        self._poke = False
                    delay = min(delay * 2, BACKOFF_MAX_S)
                    continue
            delay = BACKOFF_FIRST_S
            recovered = None
            with self._cond:
                self._queue.popleft()
                self._delivered += 1
                self._spool_delivered += spooled
                try:
                    self.spool.mark_delivered(self._spool_delivered)
                except OSError:
                    pass  # the counter only saves a resume from re-sending; delivery itself succeeded
                if self._outage is not None and not self._queue:
                    recovered = self._delivered - self._outage["delivered"]
                    self._outage = None
                self._cond.notify_all()
            if recovered is not None:
                self._say(f"streamrl: MLflow reachable again; delivered {recovered} buffered records")


class NullTracker:
    """Tracking off: same interface, records nothing."""

    run_id = None
    run_url = "(tracking disabled)"
    dataset_digest = None
    datasets: dict[str, dict] = {}
    spool_path = None
    pending = 0
    resumed = False

    def __init__(self, *args, resume_run_id: str | None = None, echo: Callable[[str], None] = print, **kwargs): ...

    def log_step(self, row: dict) -> None: ...

    def log_dataset(self, prompts: pd.DataFrame, source: str, context: str) -> None: ...

    def metric_steps(self, key: str) -> set[int]:
        return set()

    def train_steps_logged(self) -> set[int]:
        return set()

    def log_artifact(self, file: Path | str, artifact_path: str | None = None) -> None: ...

    def log_checkpoint(self, path: Path, step: int, exclude: tuple[str, ...] = ("engine",)) -> str:
        return str(path)

    def log_model(self, record: dict) -> None: ...

    def set_tags(self, tags: dict) -> None: ...

    def flush(self, timeout_s: float | None = None) -> bool:
        return True

    def close(self, status: str = "FINISHED", timeout_s: float | None = None) -> None: ...
