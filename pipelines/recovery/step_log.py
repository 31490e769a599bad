"""What a job logs per step reaches MLflow once: held until a checkpoint covers it.

A restart (a trainer rank died) or a resume (the driver died, or was preempted) goes back to
the last checkpoint and trains the steps after it again, with other samples and other weights.
MLflow cannot delete a metric value, so a step logged as soon as it was trained would appear
twice in its metric's history, the second time with the values of the policy that was kept.
So each step's row (metrics and its rollouts artifact) and each evaluation of a policy version
are held here until a checkpoint at or after them is written, then logged; whatever an attempt
trained past its last checkpoint is dropped with it. The console progress stays live; MLflow
lags by at most `train.checkpoint_every` steps (the last step always gets a checkpoint).

Every step row also carries `attempt`: which try of the run trained it (1, then one more per
restart and per resume; the run's tag `attempts` holds the count).

A step is logged once even when it is trained twice after a checkpoint had covered it: a resume
that falls back past a damaged newest checkpoint trains steps whose rows MLflow already has. Those
keep their first values in the metric history (MLflow cannot replace them); the retrained rows go to
the run's artifact `retrained/attempt_<n>.jsonl`, and the job says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Held:
    needs: int  # the checkpoint step that commits it
    row: dict
    artifacts: list = field(default_factory=list)  # (path, artifact_path) logged after the row
    train: bool = True  # a train step's row (not an evaluation's)


class StepLog:
    """Holds rows until `commit(step)` says a checkpoint of `step` steps is written, then logs them
    with `tracker.log_step` (and their artifacts with `tracker.log_artifact`), in the order held."""

    def __init__(self, tracker, committed: int = 0, attempt: int = 1, retrained_dir=None, echo=None):
        """`retrained_dir`: where rows of steps logged before are kept (write_dropped), `echo` says so."""
        self.tracker, self.retrained_dir, self.echo = tracker, retrained_dir, echo
        self.retrained: list[dict] = []  # rows of steps trained again after they were logged
        self.committed = committed  # steps covered by the newest checkpoint
        self.attempt = attempt  # the try of the run now training (the caller counts them)
        self.held: list[_Held] = []
        self.last: _Held | None = None  # the row held last, which hold_artifact adds to
        self.logged: set[int] = set()  # train steps this process logged

    def hold(self, row: dict, needs: int, train: bool = True) -> None:
        """Log `row` once a checkpoint of at least `needs` steps exists (at once if one does). `train`: a
        train step's row (step s, counted from 1, needs s), which `backfill` then knows is logged."""
        self.last = _Held(needs, row, train=train)
        self.held.append(self.last)
        self.commit(self.committed)

    def hold_artifact(self, path, artifact_path: str | None) -> None:
        """An artifact of the row held last, logged with it (at once if that row is logged already)."""
        if self.last is not None and any(held is self.last for held in self.held):
            self.last.artifacts.append((path, artifact_path))
        else:
            self.tracker.log_artifact(path, artifact_path)

    def commit(self, step: int) -> int:
        """A checkpoint of `step` steps is written: log what it covers; returns how many rows."""
        self.committed = max(self.committed, step)
        ready = [held for held in self.held if held.needs <= self.committed]
        self.held = [held for held in self.held if held.needs > self.committed]
        again = [held.row for held in ready if held.train and int(held.row["step"]) in self.logged]
        for held in ready:
            if held.train and int(held.row["step"]) in self.logged:
                continue  # logged by an earlier attempt: its values stay, this row goes to `retrained`
            self.tracker.log_step(held.row)
            if held.train:
                self.logged.add(int(held.row["step"]))
            for path, artifact_path in held.artifacts:
                self.tracker.log_artifact(path, artifact_path)
        if again:
            self._keep_retrained(again)
        return len(ready) - len(again)

    def _keep_retrained(self, rows: list[dict]) -> None:
        self.retrained += rows
        if self.retrained_dir is not None:  # one file per attempt, rewritten whole
            mine = [row for row in self.retrained if row.get("attempt", self.attempt) == self.attempt]
            write_dropped(mine, self.retrained_dir, self.attempt, self.tracker, "retrained")
        if self.echo is not None:
            self.echo(f"streamrl: step(s) {', '.join(str(int(row['step'])) for row in rows)} were logged to MLflow "
                      "by an earlier attempt (its newer checkpoint was damaged, so they were trained again); "
                      f"MLflow keeps those values, this attempt's rows are the artifact retrained/attempt_{self.attempt}.jsonl")

    def drop(self, step: int) -> list[dict]:
        """The attempt ends, and the next (a restart, or a resume) goes back to the checkpoint of `step`
        steps: log what it covers (a checkpoint this process had not heard of yet) and drop the rest,
        which is trained again; returns the dropped rows."""
        self.commit(step)
        dropped = [held.row for held in self.held]
        self.held.clear()
        return dropped


    def backfill(self, checkpoint, attempt: int, logged_before: set[int] = frozenset()) -> list[int]:
        """Log the rows a checkpoint kept (its steps.jsonl) of the steps before it that nobody logged:
        this process (`logged`) nor an earlier one (`logged_before`, what the run's spool and MLflow hold).
        That is a driver that died, or an attempt whose last rows never reached it (the driver reads them
        through Ray Data's output queue, tens of steps behind at times), after the Train operator wrote the
        checkpoint, or several. `attempt`: the try that trained them, for rows that do not say. Returns the
        steps logged."""
        self.logged |= set(logged_before)  # a restart later in this process must not log them again
        if checkpoint is None:
            return []
        rows = [row for row in checkpoint.step_rows() if int(row["step"]) <= checkpoint.step
                and int(row["step"]) not in self.logged]
        for row in rows:
            self.tracker.log_step({"attempt": attempt, **row})  # a row says its own attempt (rows_through)
            self.logged.add(int(row["step"]))
        return [int(row["step"]) for row in rows]


def write_dropped(rows: list[dict], folder, attempt: int, tracker, artifact_path: str = "dropped") -> str | None:
    """Keep what an attempt trained past its last checkpoint for diagnosis (the loss before a failure,
    say) without putting it into the metric history: a JSON-lines file, logged as the run's artifact
    `<artifact_path>/attempt_<n>.jsonl`. Returns its path (None when nothing was dropped)."""
    import json
    import math
    from pathlib import Path

    if not rows:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"attempt_{attempt}.jsonl"

    def plain(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)

    path.write_text("".join(json.dumps({key: plain(value) for key, value in row.items()
                                        if key not in ("rollouts_parquet", "timeline")}) + "\n" for row in rows))
    tracker.log_artifact(path, artifact_path)
    return str(path)


class EvalRows:
    """An evaluator's rows into a StepLog, as the tracker it logs to: policy version v (row `step` v) is
    committed by a checkpoint of v steps."""

    def __init__(self, log: StepLog):
        self.log = log

    def log_step(self, row: dict) -> None:
        self.log.hold(row, int(row["step"]), train=False)

    def log_artifact(self, path, artifact_path: str | None = None) -> None:
        self.log.hold_artifact(path, artifact_path)
