"""`streamrl sync CONFIG RUN_ID|latest`: deliver what a job could not send to MLflow before it ended.

A job that finishes while the tracking server is down keeps its undelivered records in its spool
(pipelines/tracking/spool.py), its end status last among them. A finished run cannot be resumed, so this
delivers them: in spool order, from where MLflow's delivered counter stands, then the run's end.
It takes the run's lease first (pipelines/recovery/run_lease.py): a job still writing the run delivers its
own records.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from pipelines.recovery.checkpoint import CheckpointDir
from pipelines.config.base import ConfigError
from pipelines.config.job import JobConfig
from pipelines.tracking.spool import SPOOL_FOLDER, Delivery, Spool, refused, short_error
from pipelines.recovery.resume import resolve_run
from pipelines.recovery.run_lease import LeaseHeld, RunLease

PROGRESS_EVERY = 200  # records between progress lines


class SyncFailed(RuntimeError):
    """MLflow went away mid-sync; what was delivered stays delivered, a later sync goes on from there."""


def sync_run(cfg: JobConfig, run: str, echo: Callable[[str], None] = print) -> int:
    """Deliver run `run`'s undelivered records (ConfigError for a bad run or config, SyncFailed when MLflow
    stops answering); returns how many were delivered."""
    from mlflow.tracking import MlflowClient

    if not cfg.tracking.enabled:
        raise ConfigError([("tracking.enabled", "is false: this config's runs record nothing to MLflow, so "
                                                "there is nothing to sync; use the config the run was started with")])
    output_dir = Path(cfg.output_dir).resolve()
    run_id = resolve_run(output_dir, run, field="RUN_ID")
    spool = Spool(output_dir / SPOOL_FOLDER, run_id)
    ops, delivered = spool.load()
    if delivered == len(ops):
        echo(f"streamrl: run {run_id}: all {len(ops)} records are in MLflow already; nothing to deliver")
        return 0
    try:
        lease = RunLease(CheckpointDir.of_run(output_dir, run_id).root, echo=echo).acquire()
    except LeaseHeld as err:
        raise ConfigError([("RUN_ID", f"{err}; that job delivers its own records")]) from None
    try:
        uri = cfg.tracking_uri()
        if uri.startswith(("http://", "https://")):  # one try per request here; the sync is run again instead
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(cfg.tracking.request_timeout_s))
        client = MlflowClient(uri)
        try:
            client.get_run(run_id)
        except Exception as err:  # noqa: BLE001 - unreachable, or no such run: either way say which
            raise ConfigError([("tracking.uri", f"cannot read MLflow run {run_id} at {uri} ({short_error(err)}); "
                                                "check that the server is up and this is the run's tracking.uri")]) from None
        delivery = Delivery(client, run_id, uri, spool.path, echo)
        left = len(ops) - delivered
        echo(f"streamrl: run {run_id}: delivering {left} records from {spool.path} to {uri}")
        for number, op in enumerate(ops[delivered:], start=1):
            try:
                delivery.deliver(op)
            except Exception as err:  # noqa: BLE001
                if not refused(err):
                    raise SyncFailed(f"MLflow stopped answering after {number - 1} of {left} records "
                                     f"({short_error(err)}); run `streamrl sync` again to deliver the rest") from None
                delivery.refused += 1
                echo(f"streamrl: MLflow refused a record ({short_error(err)}); skipped")
            spool.mark_delivered(delivered + number)
            if number % PROGRESS_EVERY == 0:
                echo(f"streamrl: {number}/{left} records delivered")
        echo(f"streamrl: run {run_id}: {left - delivery.refused} records delivered"
             + (f", {delivery.refused} refused or skipped" if delivery.refused else ""))
        return left - delivery.refused
    finally:
        lease.release()
