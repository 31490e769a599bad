"""The spool of a run's MLflow records, and their delivery.

A tracking server that goes away mid-job must not stop training nor lose a record. Only
the start of a job talks to MLflow directly (it needs MLflow up, and fails before anything
starts). Every later write is first appended to a spool file on local disk,

    <output_dir>/mlflow_spool/<run_id>.jsonl       one JSON line per record, in order
    <output_dir>/mlflow_spool/<run_id>.delivered   how many of those lines MLflow has

and a background thread (the Tracker's writer, pipelines/tracking/tracker.py) delivers the lines
in order, retrying one that fails (1 s backoff, doubling to 30 s) until it goes through. The driver
loop never waits on MLflow. Records keep their own step and wall-clock time, so late delivery changes
nothing in the run; the server drops a metric it already has (same key, step, time and value), so
delivering a line twice (a crash between delivery and the counter update) is harmless. What a job
could not deliver before it ended (its end status included: the spool's last record) is
delivered by `streamrl sync CONFIG RUN_ID` (pipelines/tracking/sync.py), or by a resume
(`Tracker(..., resume_run_id=...)`), which replays the spool's undelivered tail first.

A full disk does not stop the job either: a record the spool cannot take is held in memory
until delivered (said once). Should the driver die before that, the metric rows are still in
the checkpoints (`steps.jsonl`), which a resume logs again; the rollouts files are on disk.

`Spool` is the file, `Delivery` sends one record; `refused` tells an error that retrying cannot
help from an outage, and `short_error` says an error in one line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

SPOOL_FOLDER = "mlflow_spool"
BATCH_LIMIT = 100  # MLflow takes at most 100 params or tags per log_batch (1000 metrics)
# The server answered and said no: sending the same record again cannot succeed. Not in this set,
# so retried: 401/403 (credentials may be renewed), 408/429 (timeouts, rate limits), 5xx and
# everything that never reached a server (connection refused, timeouts, DNS).
REFUSED_HTTP_STATUSES = {400, 404, 405, 409, 410, 411, 413, 414, 415, 422}


def short_error(err: BaseException) -> str:
    """One line for the terminal: 'Connection refused' rather than three nested exception reprs.
    Never contains parentheses, so the line that quotes it stays easy to parse."""
    text = str(err)
    errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    caused = re.search(r"Caused by (.*)", text)
    if errno:
        short = errno.group(1).strip()
    elif "timed out" in text.lower() or "timeout" in type(err).__name__.lower():
        short = "request timed out"
    elif caused and re.findall(r"'([^']+)'", caused.group(1)):
        short = re.findall(r"'([^']+)'", caused.group(1))[-1]  # the innermost message: the actual cause
    else:
        short = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    short = short.replace("(", "[").replace(")", "]")
    return short if len(short) <= 160 else short[:157] + "..."


def refused(err: BaseException) -> bool:
    """True when the server (or store) answered and rejected the record itself."""
    import requests
    from mlflow.exceptions import MlflowException

    status = None
    if isinstance(err, MlflowException):  # a failed connection is INTERNAL_ERROR, i.e. 500: retried
        status = err.get_http_status_code()
    elif isinstance(err, requests.HTTPError) and err.response is not None:
        status = err.response.status_code
    return status in REFUSED_HTTP_STATUSES


def describe(op: dict) -> str:
    """A spool record in a few words, for the line that says it was refused."""
    if op["op"] == "metrics":
        return f"metrics of step {op['step']}"
    if op["op"] in ("artifact", "artifacts"):
        return f"{op['path']} -> {op.get('artifact_path') or '/'}"
    if op["op"] == "model":
        return f"MLflow model of {op['path']}"
    return f"tags {', '.join(op['tags'])}"


class Spool:
    """The durable record of one run's writes: an append-only JSON-lines file and a counter of
    how many lines MLflow has. Appends are fsynced: a crash (or a reboot) after `log_step`
    returned cannot lose the record. The counter is replaced atomically; if it lags behind a
    delivery, the line is delivered again, which MLflow takes without duplicating."""

    def __init__(self, folder: Path, run_id: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{run_id}.jsonl"
        self.counter_path = folder / f"{run_id}.delivered"

    def load(self) -> tuple[list[dict], int]:
        """All records so far and how many were delivered. A line torn by a crash mid-append is
        cut off (its `log_*` call never returned)."""
        if not self.path.exists():
            return [], 0
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1
        if whole < len(data):
            with open(self.path, "r+b") as file:
                file.truncate(whole)
        ops = [json.loads(line) for line in data[:whole].splitlines() if line.strip()]
        try:
            delivered = int(self.counter_path.read_text().strip() or 0)
        except (OSError, ValueError):
            delivered = 0
        return ops, min(max(delivered, 0), len(ops))

    def append(self, op: dict) -> None:
        line = (json.dumps(op, separators=(",", ":")) + "\n").encode()
        with open(self.path, "ab") as file:
            file.write(line)  # one write per line: only the last line can be torn by a crash
            file.flush()
            os.fsync(file.fileno())

    def mark_delivered(self, count: int) -> None:
        tmp = self.counter_path.with_name(self.counter_path.name + ".tmp")
        tmp.write_text(str(count))
        os.replace(tmp, self.counter_path)


class Delivery:
    """Sends one spool record to MLflow (the Tracker's writer thread, `streamrl sync`). Raises on an
    outage (the caller retries); a record that cannot succeed is counted in `refused` and skipped."""

    def __init__(self, client, run_id: str, tracking_uri: str, spool_path: Path, say: Callable[[str], None]):
        self.client, self.run_id, self.tracking_uri, self.spool_path, self.say = client, run_id, tracking_uri, spool_path, say
        self.refused = 0

    def deliver(self, op: dict, live: bool = False) -> None:
        """`live`: a job is training the run now, so an `end` record (an earlier process's, replayed by a
        resume) is not delivered: it would end the run the job is training."""
        from mlflow.entities import Metric, RunTag

        kind = op["op"]
        if kind == "metrics":
            # The time of the log_step call, not of delivery: a chart of a delayed step is unchanged.
            self.client.log_batch(self.run_id, metrics=[
                Metric(key, value, op["timestamp"], op["step"]) for key, value in op["metrics"].items()
            ])
        elif kind == "tags":
            items = [RunTag(key, value) for key, value in op["tags"].items()]
            for start in range(0, len(items), BATCH_LIMIT):
                self.client.log_batch(self.run_id, tags=items[start:start + BATCH_LIMIT])
        elif kind in ("artifact", "artifacts"):
            if not os.path.exists(op["path"]):
                # Deleted before it could be sent (e.g. a replay after the folder was cleaned up).
                self.refused += 1
                self.say(f"streamrl: {op['path']} no longer exists; its MLflow upload is skipped")
                return
            upload = self.client.log_artifact if kind == "artifact" else self.client.log_artifacts
            upload(self.run_id, op["path"], op.get("artifact_path"))
        elif kind == "uploaded":  # local: the checkpoint's files are in MLflow, so it may be pruned now
            from pipelines.recovery.checkpoint import STEP_DIR, CheckpointDir

            path = Path(op["path"])
            if path.is_dir() and (match := STEP_DIR.match(path.name)):
                CheckpointDir(path.parent).mark_uploaded(int(match.group(1)))
        elif kind == "end":
            if not live:
                self.client.set_terminated(self.run_id, op["status"])
        elif kind == "model":
            self._deliver_model(op)
        else:  # written by another version of streamrl: retrying cannot help
            self.refused += 1
            self.say(f"streamrl: unknown record in {self.spool_path} skipped: {op!r}")

    def _deliver_model(self, op: dict) -> None:
        import mlflow
        from mlflow.entities import RunTag

        from pipelines.tracking import policy_model

        if not os.path.isdir(op["path"]):
            self.refused += 1
            self.say(f"streamrl: {op['path']} no longer exists; its MLflow model is not logged")
            return
        mlflow.set_tracking_uri(self.tracking_uri)  # MLflow's model logging uses the process's URI
        models = policy_model.deliver(self.client, self.run_id, op)
        model, adapter = models["policy"], models["adapter"]
        tags = [RunTag("model.latest_step", str(op["step"]))]
        if model is not None:
            tags += [RunTag("model.latest_id", model.model_id), RunTag("model.latest_uri", model.model_uri)]
            self.say(f"streamrl: policy of step {op['step']} logged as MLflow model {model.model_uri} "
                     f"(mlflow.transformers.load_model loads it)")
        if adapter is not None:
            tags += [RunTag("model.adapter_id", adapter.model_id), RunTag("model.adapter_uri", adapter.model_uri)]
            self.say(f"streamrl: LoRA adapter of step {op['step']} logged as MLflow model {adapter.model_uri} "
                     f"(peft's PeftModel.from_pretrained loads it on the base model, streamrl.base_model)")
        self.client.log_batch(self.run_id, tags=tags)
