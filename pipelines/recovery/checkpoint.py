"""Resumable checkpoints, written atomically, and the sample ledger they carry.

One folder per run, one per checkpoint:

    <output_dir>/checkpoints/<run_id>/
        run.json                 the job's config and dataset digest (written at start)
        step_000004/             a checkpoint after 4 optimizer steps (policy version 4)
            engine/              DeepSpeed engine state of every rank: model, optimizer, scheduler
            rng/rank_N.json      torch / numpy / python RNG states of rank N
            critic/              PPO with a critic: the critic ranks' engine/ and rng/ (and model/, a
                                 Hugging Face export, when the policy has one)
            ledger.parquet       the data cursor: every group trained so far (step, group, prompt id, version)
            state.json           step, policy version, run id, dataset digest, config digest
            MANIFEST.json        size and sha256 of every file above; written last
            (config.json, model.safetensors, tokenizer files: a Hugging Face export, final checkpoint)

A checkpoint is written into a hidden `.tmp-*` folder and renamed into place only when
complete, so a crash mid-write leaves the previous checkpoint as the latest valid one;
`latest_valid` also skips any folder whose manifest is missing or does not match its
files. Checkpoints need a filesystem that every trainer rank and the Train operator see
(local disk on one machine, shared storage on a cluster).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from operators.common.durable import (DiskFullError, folder_bytes, fsync_dir, is_disk_full, sha256_of, space_problem,
                               write_json_atomic)

MANIFEST = "MANIFEST.json"
STATE = "state.json"
LEDGER = "ledger.parquet"
# The metric rows of the steps since the previous checkpoint, as the Train operator had them when it wrote
# this one: a driver that died before it logged them finds them here (pipelines/recovery/step_log.py).
STEP_ROWS = "steps.jsonl"
RUN_FILE = "run.json"
ENGINE_DIR = "engine"
RNG_DIR = "rng"
CRITIC_DIR = "critic"
# <run>/uploaded/step_NNNNNN: an empty file the driver's MLflow writer leaves once a checkpoint's upload is
# delivered (pipelines/tracking/tracker.py). With tracking on, pruning removes only checkpoints that have one.
UPLOADED_DIR = "uploaded"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, or made by a different job)."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict

    def ledger(self) -> pd.DataFrame:
        return pd.read_parquet(self.path / LEDGER)

    def step_rows(self) -> list[dict]:
        """The metric rows this checkpoint keeps, oldest first: of every step before it."""
        return [json.loads(line) for line in (self.path / STEP_ROWS).read_text().splitlines() if line.strip()]


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def verify(folder: Path, hashes: bool = True) -> dict:
    """The checkpoint's state if its manifest matches its files; raises CheckpointError otherwise."""
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"{folder} has no {MANIFEST}: it was not completely written")
    try:
        manifest = json.loads(manifest_file.read_text())
        entries = [(folder / name, int(entry["size"]), str(entry["sha256"])) for name, entry in manifest["files"].items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # not JSON, or not a manifest's shape
        raise CheckpointError(f"{manifest_file} is unreadable ({type(err).__name__}: {err})") from None
    for file, size, sha256 in entries:
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(f"{file} is missing or has the wrong size: the checkpoint is damaged")
        if hashes and sha256_of(file) != sha256:
            raise CheckpointError(f"{file} does not match its sha256 in {MANIFEST}: the checkpoint is damaged")
    try:
        return json.loads((folder / STATE).read_text())
    except (OSError, ValueError) as err:  # listed in no manifest of ours: a manifest written by hand
        raise CheckpointError(f"{folder / STATE} is unreadable ({type(err).__name__}: {err})") from None


class CheckpointDir:
    """The checkpoints of one run."""

    def __init__(self, root: Path):
        self.root = Path(root)

    @classmethod
    def of_run(cls, output_dir: Path, run_id: str) -> "CheckpointDir":
        return cls(Path(output_dir) / "checkpoints" / run_id)

    # --- the run's identity -----------------------------------------------------------

    def write_run_file(self, info: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.root / RUN_FILE, info)

    def run_file(self) -> dict | None:
        """The run's run.json, None when there is none; CheckpointError when it is not readable JSON."""
        return read_run_file(self.root / RUN_FILE)

    # --- writing ------------------------------------------------------------------------

    def next_attempt(self) -> int:
        """Count one more try of this run (its first start, each restart, each resume) in the run file;
        returns its number, 1 for the first."""
        info = self.run_file()
        if info is None:
            raise CheckpointError(f"{self.root} has no {RUN_FILE}: it is not a streamrl run folder")
        attempt = int(info.get("attempts", 0)) + 1
        self.write_run_file({**info, "attempts": attempt})
        return attempt

    def begin(self, step: int) -> Path:
        """A fresh hidden folder to write the checkpoint of `step` into."""
        tmp = self.root / f".tmp-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        return tmp

    def commit(self, tmp: Path, step: int, state: dict, ledger: pd.DataFrame) -> Path:
        """Add state and ledger (the Train operator's, operators.stages.train.LEDGER_COLUMNS), fsync every file, write
        the manifest last, rename into place."""
        ledger.to_parquet(tmp / LEDGER, index=False)
        (tmp / STATE).write_text(json.dumps({**state, "step": step, "written_at": time.time()}, indent=1, default=str))
        entries = {}
        for file in _files(tmp):
            with open(file, "rb+") as handle:
                os.fsync(handle.fileno())
            entries[str(file.relative_to(tmp))] = {"size": file.stat().st_size, "sha256": sha256_of(file)}
        write_json_atomic(tmp / MANIFEST, {"step": step, "files": entries})
        for folder in {p.parent for p in tmp.rglob("*")} | {tmp}:
            fsync_dir(folder)
        final = self.root / step_dir_name(step)
        if final.exists():  # left by an attempt that was rolled back past this step
            stale = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, final)
        fsync_dir(self.root)
        return final

    def discard(self, tmp: Path) -> None:
        shutil.rmtree(tmp, ignore_errors=True)

    # --- reading ------------------------------------------------------------------------

    def steps(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
        return sorted(found)

    def latest_valid(self, echo=print, hashes: bool = True) -> Checkpoint | None:
        """The newest checkpoint whose files match its manifest; damaged ones are reported and skipped."""
        for step, path in reversed(self.steps()):
            try:
                return Checkpoint(path, step, verify(path, hashes=hashes))
            except CheckpointError as err:
                echo(f"streamrl: skipping checkpoint {path}: {err}")
        return None

    def at_step(self, step: int) -> Checkpoint:
        path = self.root / step_dir_name(step)
        return Checkpoint(path, step, verify(path))

    # --- housekeeping -----------------------------------------------------------------

    def clean_partial(self) -> list[Path]:
        """Remove folders of checkpoints that were being written when a job died."""
        if not self.root.is_dir():
            return []
        partial = [p for p in self.root.iterdir() if p.name.startswith((".tmp-", ".old-"))]
        for path in partial:
            shutil.rmtree(path, ignore_errors=True)
        return partial

    def mark_uploaded(self, step: int) -> None:
        marker = self.root / UPLOADED_DIR / step_dir_name(step)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()

    def uploaded(self, step: int) -> bool:
        return (self.root / UPLOADED_DIR / step_dir_name(step)).exists()

    def prune(self, keep: int, protect: Path | None = None, require_uploaded: bool = False) -> list[Path]:
        """Keep the newest `keep` checkpoints (0 keeps all) and `protect`; with `require_uploaded`, also every
        one whose MLflow upload is not delivered yet (its `checkpoint.latest` tags may point at it)."""
        if keep <= 0:
            return []
        old = [(step, path) for step, path in self.steps()[:-keep]
               if path != protect and (not require_uploaded or self.uploaded(step))]
        for step, path in old:
            shutil.rmtree(path, ignore_errors=True)
            (self.root / UPLOADED_DIR / step_dir_name(step)).unlink(missing_ok=True)
        return [path for _, path in old]

    def needed_bytes(self) -> int:
        """About what the next checkpoint takes: the newest one's size and a tenth (0 before the first)."""
        steps = self.steps()
        return int(folder_bytes(steps[-1][1]) * 1.1) if steps else 0


class StepCheckpoints:
    """What the Train operator (operators/stages/train.py) calls between steps to write a job's checkpoints:
    every `every` steps (0: only after the last one) into `root`, the newest `keep` kept (0: all), a
    Hugging Face export (weights and tokenizer) in the last one, or in every one with hf_export "every".
    Picklable: it travels to the Train stage's actor with the operator's arguments.

    Each checkpoint keeps the metric rows of every step before it (`steps.jsonl`), not only those since
    the previous one: the driver reads the Train stage's rows through Ray Data's output queue, which can
    lag training by tens of steps, so when an attempt ends the driver may not have heard of several
    checkpoints, and the rows of all of them are needed (pipelines/recovery/step_log.py; the chaos run lost two
    steps' rows when only the newest checkpoint's were kept). `prior_rows`: those of the checkpoint the
    attempt starts from; `attempt`: the try of the run training now, recorded in each new row. The
    rows grow like the ledger does (one small row of numbers per step against one ledger row per group)."""

    def __init__(self, root: str, every: int = 0, keep: int = 0, hf_export: str = "last", run_info: dict | None = None,
                 prior_rows: list[dict] | None = None, attempt: int | None = None, prune_uploaded_only: bool = False,
                 fence=None):
        """`prune_uploaded_only`: prune only checkpoints MLflow has (tracking on: CheckpointDir.prune). `fence`:
        the run's lease token (pipelines/recovery/run_lease.py), checked before each commit: a writer whose lease
        another process took commits nothing."""
        self.root, self.every, self.keep, self.hf_export = str(root), every, keep, hf_export
        self.prune_uploaded_only, self.fence = prune_uploaded_only, fence
        self.run_info = dict(run_info or {})
        self.rows = list(prior_rows or [])  # every step's row so far, oldest first
        self.attempt = attempt

    def rows_through(self, step_rows: list[dict]) -> list[dict]:
        """The rows a checkpoint keeps: those of the steps before, then `step_rows` (the steps since the
        previous checkpoint), tagged with the attempt unless they say theirs."""
        tag = {} if self.attempt is None else {"attempt": self.attempt}
        return self.rows + [{**tag, **row} for row in step_rows]

    def due(self, steps_done: int, last: bool) -> bool:
        return last or bool(self.every and steps_done % self.every == 0)

    def write(self, steps_done: int, workers, critics, ledger: pd.DataFrame, last: bool,
              step_rows: list[dict] | None = None) -> Path:
        """Every rank's engine and RNG state (and the critic's), the ledger, the metric rows of every step
        (`step_rows`: those since the previous checkpoint; see rows_through), an export when due; atomically."""
        import ray

        folder = CheckpointDir(Path(self.root))
        self._make_room(folder, steps_done)
        tmp = folder.begin(steps_done)
        try:
            rows = self.rows_through(step_rows or [])
            (tmp / STEP_ROWS).write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
            ray.get([worker.save_checkpoint.remote(str(tmp)) for worker in workers]
                    + [critic.save_checkpoint.remote(str(tmp / CRITIC_DIR)) for critic in critics])
            if last or self.hf_export == "every":
                # the policy, loadable with from_pretrained / vLLM / streamrl eval (rank 0 adds the tokenizer:
                # it has transformers loaded already; importing it in the Train actor would cost seconds); the
                # critic beside it, loadable by operators.stages.value.Value
                ray.get([worker.save_pretrained.remote(str(tmp), tokenizer=True) for worker in workers]
                        + [critic.save_pretrained.remote(str(tmp / CRITIC_DIR / "model"), tokenizer=True)
                           for critic in critics])
            state = {**self.run_info, "policy_version": steps_done, "groups": len(ledger), "world_size": len(workers)}
            if self.fence is not None:
                self.fence.check()  # raises LeaseLost: another process writes this run now
            final = folder.commit(tmp, steps_done, state, ledger)
            self.rows = rows
        except BaseException as err:
            folder.discard(tmp)
            if is_disk_full(err) and not isinstance(err, DiskFullError):  # the space freed by discarding counts
                # the newest checkpoint's size when there is one; else no estimate, only the error itself
                raise DiskFullError(err.errno, space_problem(folder.root, folder.needed_bytes(),
                                                             f"the checkpoint of step {steps_done}")
                                    or f"the checkpoint of step {steps_done}: {err}") from None
            raise
        folder.prune(self.keep, protect=final, require_uploaded=self.prune_uploaded_only)
        return final

    def _make_room(self, folder: CheckpointDir, steps_done: int) -> None:
        """Check there is room for the next checkpoint (the newest one's size) before writing it. Short of
        room, prune down to `keep` - 1 first (normally the oldest goes after the commit, so `keep` + 1 are on
        disk while one is written); still short, DiskFullError saying what is needed."""
        needed = folder.needed_bytes()
        what = f"the checkpoint of step {steps_done}"
        if not needed or space_problem(folder.root, needed, what) is None:
            return
        if self.keep > 1:
            pruned = folder.prune(self.keep - 1, require_uploaded=self.prune_uploaded_only)
            if pruned:
                print(f"streamrl: low on disk at {folder.root}: removed {', '.join(p.name for p in pruned)} "
                      f"before writing step {steps_done}'s checkpoint, not after (train.checkpoint_keep {self.keep})")
        problem = space_problem(folder.root, needed, what)
        if problem:
            raise DiskFullError(errno.ENOSPC, problem)


# A run id as MLflow makes and accepts them (its validation uses this pattern, in a private module): a letter or
# digit, then letters, digits, '_' or '-'. Local run ids ("local-20261203-064013-1a2b3c") fit it too. A run id
# becomes a folder name, so one from a command line or a state.json is checked against it before any path is
# made of it ('..' or an absolute path would reach folders outside the run's).
RUN_ID_PATTERN = re.compile(r"^[a-zA-Z0-9][\w\-]{0,255}$")


def checked_run_id(run_id, where: str) -> str:
    """`run_id` if it is a valid run id, else CheckpointError saying `where` it came from."""
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.match(run_id):
        raise CheckpointError(f"{where}: {run_id!r} is not a run id (letters, digits, '_' and '-', starting with a "
                              "letter or digit); give the id streamrl printed, or 'latest'")
    return run_id


def read_run_file(file: Path) -> dict | None:
    """A run.json as a dict; None when the file is not there; CheckpointError naming it when it is not a
    JSON object (a torn copy, an edit gone wrong)."""
    if not file.is_file():
        return None
    try:
        info = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} is unreadable ({type(err).__name__}: {err}); restore it from a copy, or move "
                              "the run's folder away") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{file} holds a JSON {type(info).__name__}, not a run's record; restore it from a "
                              "copy, or move the run's folder away")
    return info


def next_run_sequence(output_dir: Path) -> int:
    """The number the next run under `output_dir` takes: one more than any run's there (0 for the first).
    `--resume latest` follows these numbers, not the wall clocks of the drivers that started the runs."""
    numbers = [info.get("sequence", -1) for _, info in _run_infos(output_dir)]
    return max([n for n in numbers if isinstance(n, int)], default=-1) + 1


def _run_infos(output_dir: Path) -> list[tuple[Path, dict]]:
    """(folder, run.json) of each run under `output_dir/checkpoints` whose run.json reads; one that does not
    is left out with a line saying so (it cannot be resumed, and must not stop the others being found)."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    runs = []
    for folder in sorted(root.iterdir()):
        try:
            info = read_run_file(folder / RUN_FILE)
        except CheckpointError as err:
            print(f"streamrl: skipping run {folder.name}: {err}")
            continue
        if info is not None:
            runs.append((folder, info))
    return runs


def find_run_dirs(output_dir: Path) -> list[Path]:
    """Run folders under `output_dir/checkpoints`, oldest first: by the run's sequence number (next_run_sequence),
    then by when it started for runs without one; a run whose run.json is unreadable is skipped."""
    def order(item: tuple[Path, dict]):
        sequence = item[1].get("sequence")
        started = item[1].get("started_at", 0)
        return (isinstance(sequence, int), sequence if isinstance(sequence, int) else 0,
                started if isinstance(started, (int, float)) else 0)

    return [folder for folder, _ in sorted(_run_infos(output_dir), key=order)]


def dataset_digest(prompts: pd.DataFrame) -> str:
    """Content digest of the prompts a job schedules (ids and text, in order)."""
    hashed = pd.util.hash_pandas_object(prompts[["prompt_id", "prompt"]].astype(str), index=False)
    return hashlib.sha256(hashed.values.tobytes()).hexdigest()[:16]
