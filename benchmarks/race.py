"""Time to quality: a config run in several modes, one after another, over several seeds, with the held-out
accuracy measured on each run's checkpoints after the run, so the measurement never slows what it measures.

    python benchmarks/real_model.py race configs/smollm2_basic_arithmetic.yaml
    python benchmarks/race.py configs/smollm2_basic_arithmetic.yaml --modes 0,default,2 --seeds 3 --every 4

Each run is the config as `streamrl run` runs it, with `train.max_staleness` set by the mode (`default`: the
config's own), `train.seed` by the seed, no evaluation in the job (`eval=null`), a checkpoint with its Hugging
Face folder every `--every` steps and after the last, and tracking off (the record is the JSON below). Mode
`plain` is the baseline instead: the config as one synchronous loop in one process, no Ray
(pipelines/plain_loop.py: transformers' generate on every core), its weights saved at the same steps. The
wall time of a step is from the job's start (Ray, engines, ranks: start-up counts) to the end of that step's
training. After each run one evaluator (the config's `eval` section: its held-out data, engine and
max_new_tokens; greedy decoding) loads each checkpoint's weights in turn and scores the held-out prompts;
version 0 (the model before training) is scored once per race.

It writes benchmarks/results/<name>_race.json (every run's points, each mode's median curve with the seeds'
spread, and the headline: the wall time to reach step 0 + 0.15 and to reach 0.85, per seed and the median;
`None` = never reached) and benchmarks/results/<name>_race.png (accuracy against wall time and against steps,
one curve a mode). Figures move with machine load: run nothing else beside it. `--continue` adds the runs a
record lacks (a third seed, or what a stopped race did not reach) and keeps the ones it has. A run's
checkpoints are deleted once scored (`--keep-checkpoints` keeps them: 8.5 GB a run for 16 steps of the real
model, checkpointed every 4 steps with their optimizer state).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from benchmarks import race_curves
from benchmarks.command_line import run_command

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("0", "default", "2")
PLAIN = "plain"  # the mode that runs the config as one synchronous loop in one process (no Ray): the baseline
RISE, TARGET = 0.15, 0.85
# A point's scores: greedy held-out accuracy, and with the answer_format reward the share of answers stated in
# the asked format and the accuracy among those (a rise that is only the format shows as such).
# Each step's training figures kept in the record (columns starting so, per staleness too): what was learned
# from, how far the samples' policy lay from the trainer's (rho = pi_prox / pi_behave), and how much of the
# step's gradient the clip removed.
TRAIN_METRICS = ("success_rate", "reward_mean", "staleness_", "clip_fraction", "dual_clip_fraction", "ratio_",
                 "approx_kl", "is_ratio", "mismatch_k3", "tis_fraction", "entropy", "grad_norm")
SCORES = {"accuracy": "success_rate", "answered_rate": "answered_rate",
          "accuracy_among_answered": "success_among_answered"}


def run_overrides(mode: str, seed: int, every: int, output_dir: Path) -> list[str]:
    """What a race run sets on top of the config and the user's --set."""
    staleness = [] if mode == "default" else [f"train.max_staleness={int(mode)}"]
    return [*staleness, f"train.seed={seed}", "eval=null", f"train.checkpoint_every={every}",
            "train.checkpoint_keep=0", "train.checkpoint_hf_export=every", "tracking.enabled=false",
            f"output_dir={output_dir}"]


def run_once(config: str, overrides: list[str], mode: str, seed: int, every: int, output_dir: Path, echo=print) -> dict:
    """One timed run: its steps' wall times from the job's start and its checkpoints."""
    if mode == PLAIN:
        return run_plain(config, overrides, seed, every, output_dir, echo)
    from pipelines.config.load import load_config
    from pipelines.job import run_job
    from pipelines.recovery.checkpoint import CheckpointDir

    cfg = load_config(config, [*overrides, *run_overrides(mode, seed, every, output_dir)])
    start = time.time()
    result = run_job(cfg, echo=echo)
    wall = time.time() - start
    step_end = {int(row["step"]): json.loads(row["timeline"])["train"][1] - start
                for row in result.metrics.to_dict("records")}
    trained = {int(row["step"]): {key: round(float(value), 4) for key, value in row.items()
                                  if key.startswith(TRAIN_METRICS) and isinstance(value, (int, float))
                                  and value == value}  # NaN (a skipped step's loss) is left out
               for row in result.metrics.to_dict("records")}
    checkpoints = [{"step": step, "path": str(path)}
                   for step, path in CheckpointDir.of_run(result.output_dir, result.resume_id).steps()]
    return {"mode": mode, "seed": seed, "max_staleness": int(cfg.train.max_staleness), "wall_s": round(wall, 1),
            "first_step_s": round(step_end.get(1, float("nan")), 1), "steps": len(step_end),
            "step_end_s": {str(k): round(v, 2) for k, v in sorted(step_end.items())},
            "trained": {str(k): v for k, v in sorted(trained.items())}, "checkpoints": checkpoints,
            "model_path": result.model_path}


def run_plain(config: str, overrides: list[str], seed: int, every: int, output_dir: Path, echo=print) -> dict:
    """The synchronous baseline: the same config as one plain loop in this process (pipelines/plain_loop.py:
    transformers' generate, then the reward, then one train step, then the new weights into the engine; no
    Ray), on every core of the machine. Its weights are saved every `every` steps and after the last (as a
    safetensors file of the trainer's arrays), out of the step's time; the wall time counts from before the
    model loads, as a job's counts from before Ray starts."""
    from safetensors.numpy import save_file

    from pipelines.config.load import load_config
    from pipelines.data.models import resolve_model_path
    from pipelines.plain_loop import ONE_PROCESS, run, unsupported

    cfg = load_config(config, [*overrides, *ONE_PROCESS, "rollout.partial_rollout=false", f"train.seed={seed}",
                               "eval=null", f"train.torch_threads={os.cpu_count()}"])
    left_out = unsupported(cfg)
    if left_out:
        raise SystemExit(f"race --modes {PLAIN}: the plain loop leaves out {', '.join(left_out)}: race the job's "
                         "modes only")
    output_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model_path(cfg.model)
    step_end, checkpoints, saving = {}, [], [0.0]

    def watch(record, generate, worker):
        step = record["step"]
        step_end[step] = time.time() - start - saving[0]
        if step % every == 0 or step == cfg.train.steps:
            began = time.time()
            path = output_dir / f"step-{step}.safetensors"
            save_file(worker.state_dict(), str(path))
            checkpoints.append({"step": step, "path": str(path)})
            saving[0] += time.time() - began

    start = time.time()
    records = run(cfg, model_path, watch=watch, echo=echo)
    wall = time.time() - start - saving[0]
    trained = {record["step"]: {key: round(float(record[key]), 4) for key in ("success_rate", "reward_mean",
                                                                            "grad_norm") if key in record}
               for record in records}
    return {"mode": PLAIN, "seed": seed, "max_staleness": 0, "wall_s": round(wall, 1),
            "first_step_s": round(step_end.get(1, float("nan")), 1), "steps": len(step_end),
            "step_end_s": {str(k): round(v, 2) for k, v in sorted(step_end.items())},
            "trained": {str(k): v for k, v in sorted(trained.items())}, "checkpoints": checkpoints,
            "model_path": model_path}


def checkpoint_weights(folder: str) -> dict:
    """A checkpoint's policy (its Hugging Face folder, or the plain loop's safetensors file of the trainer's
    arrays) as fp32 arrays under the trainer's names (tied tables included: from_pretrained restores them)."""
    if folder.endswith(".safetensors"):
        from safetensors.numpy import load_file

        return load_file(folder)
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    return {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}


def evaluate(config: str, overrides: list[str], model_path: str, versions: list[tuple[int, str | None]],
             echo=print) -> dict[int, dict[str, float]]:
    """Greedy held-out scores (`SCORES`) of each (version, checkpoint folder or None for the model itself),
    one evaluator and one engine for all of them."""
    from pipelines.config.load import load_config
    from pipelines.evaluation.in_training import EvalSettings, Evaluator, load_eval_prompts
    from pipelines.runtime.session import ray_session
    from pipelines.stages import engine_options

    cfg = load_config(config, [*overrides, "eval.n=0", "eval.greedy=true", "tracking.enabled=false"])
    if cfg.eval is None:
        raise SystemExit(f"{config}: the race scores held-out prompts: the config needs an eval section")
    settings = EvalSettings.of(cfg)
    prompts, _ = load_eval_prompts(cfg, model_path, echo)
    scores = {}
    with ray_session(cfg):
        # whole checkpoints (a LoRA one's export is merged): no adapters on the engine
        evaluator = Evaluator(prompts, settings, model_path, engine_options(cfg, settings.engine, adapters=False))
        try:
            for version, folder in versions:
                started = time.perf_counter()
                if folder is not None:
                    evaluator.generate.load_policy(version, checkpoint_weights(folder))
                metrics = evaluator.evaluate(version)["metrics"]
                scores[version] = {name: float(metrics[f"eval/greedy_{key}"]) for name, key in SCORES.items()
                                   if f"eval/greedy_{key}" in metrics}
                echo(f"race: version {version}: held-out greedy {scores[version]['accuracy']:.3f} "
                     f"({time.perf_counter() - started:.0f}s)")
        finally:
            evaluator.generate.close()
    return scores


def race(config: str, overrides: list[str], modes: list[str], seeds: int, every: int, name: str,
         results: Path = RESULTS, scratch: Path = Path("runs/race"), echo=print, resume: bool = False,
         keep_checkpoints: bool = False) -> dict:
    results.mkdir(parents=True, exist_ok=True)
    record = {"command": _command(config, overrides, modes, seeds, every, name), **machine(), "config": config,
              "modes": modes, "seeds": seeds, "every": every, "rise": RISE, "target": TARGET, "runs": []}
    out = results / f"{name}_race.json"
    if resume and out.exists():
        record = resumed(json.loads(out.read_text()), record, echo)
    for mode in modes:  # this invocation's modes and seeds; the record may hold more (resumed)
        for seed in range(seeds):
            if any(run["mode"] == mode and run["seed"] == seed for run in record["runs"]):
                continue
            echo(f"race: mode {mode}, seed {seed}")
            run = run_once(config, overrides, mode, seed, every, scratch / f"{name}-{mode}-s{seed}", echo)
            if "step0" not in record:
                record["step0"] = evaluate(config, overrides, run["model_path"], [(0, None)], echo)[0]
                record["step0_accuracy"] = record["step0"]["accuracy"]
            saved = [(point["step"], point["path"]) for point in run["checkpoints"]]
            scores = evaluate(config, overrides, run["model_path"], saved, echo)
            run["points"] = [{"step": 0, "wall_s": 0.0, **record["step0"]}] + [
                {"step": step, "wall_s": run["step_end_s"][str(step)], **scores[step]} for step, _ in saved]
            record["runs"].append(run)
            if not keep_checkpoints:  # scored: a run's checkpoints (8.5 GB for 16 steps of the real model) go
                shutil.rmtree(scratch / f"{name}-{mode}-s{seed}", ignore_errors=True)
            out.write_text(json.dumps(record, indent=1) + "\n")  # a partial record survives a stopped race
    summarize(record, results / f"{name}_race.png", title=f"{name}: {config}")
    out.write_text(json.dumps(record, indent=1) + "\n")
    for mode, figures in record["headline"].items():
        echo(f"race: max_staleness {mode}: to {figures['rise_threshold']:.3f} "
             f"{race_curves.say(figures['median_wall_s_to_rise'])}, to {TARGET} "
             f"{race_curves.say(figures['median_wall_s_to_target'])} (median of {len(figures['wall_s_to_rise'])})")
    echo(f"race: {out}, {results / f'{name}_race.png'}")
    return record


def resumed(earlier: dict, record: dict, echo=print) -> dict:
    """An earlier record of the same race, to be continued: its runs (and step-0 score) are kept and the
    missing (mode, seed) runs added. Refused when it raced another config, other --set or another --every."""
    for key in ("config", "every"):
        if earlier.get(key) != record[key]:
            raise SystemExit(f"race --continue: the record has {key} {earlier.get(key)!r}, this race "
                             f"{record[key]!r}: give another --name, or the same arguments")
    if _overrides(earlier["command"]) != _overrides(record["command"]):
        raise SystemExit(f"race --continue: the record was measured with --set {_overrides(earlier['command'])}, "
                         f"this race with {_overrides(record['command'])}: give another --name")
    kept = {key: earlier[key] for key in ("runs", "step0", "step0_accuracy") if key in earlier}
    dates = sorted({earlier["date"], *earlier.get("continued", [])})
    echo(f"race: continuing {len(kept['runs'])} run(s) of {earlier['date']}")
    # the record covers every mode raced under this name, not only this invocation's (--modes plain added to a
    # record of the default mode keeps the default's curve and headline)
    modes = [*earlier.get("modes", []), *(mode for mode in record["modes"] if mode not in earlier.get("modes", []))]
    commands = [*earlier.get("commands", [earlier["command"]]), record["command"]]
    return {**record, **kept, "modes": modes, "seeds": max(int(earlier.get("seeds", 0)), int(record["seeds"])),
            "command": commands[0], "commands": commands, "date": dates[0],
            "continued": [*dates[1:], record["date"]]}


def _overrides(command: str) -> list[str]:
    return sorted(part for part in command.split(" --set ")[1:])


def summarize(record: dict, picture: Path, title: str) -> None:
    """Add each mode's curve and headline figures to `record` and draw the picture."""
    base = record["step0_accuracy"]
    curves, heads = {}, {}
    for mode in record["modes"]:
        runs = [run for run in record["runs"] if run["mode"] == mode]
        label = {"default": f"default ({runs[0]['max_staleness']})", PLAIN: "plain loop (sync)"}.get(mode, mode)
        curves[label] = race_curves.mode_curve(runs)
        heads[label] = race_curves.headline(runs, base, TARGET, RISE)
    record["curves"], record["headline"] = curves, heads
    race_curves.plot(curves, picture, title, base, TARGET, RISE)
    record["picture"] = picture.name


def _command(config, overrides, modes, seeds, every, name) -> str:
    return (f"python benchmarks/real_model.py race {config} --modes {','.join(modes)} --seeds {seeds} --every {every}"
            f" --name {name}" + "".join(f" --set {o}" for o in overrides))


def machine() -> dict:
    """Where a record was measured."""
    return {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated max_staleness values; 'default' is the config's; 'plain' runs the "
                             "config as one synchronous loop in one process, no Ray (pipelines/plain_loop.py: the "
                             "HF engine, every core), the baseline (default: 0,default,2)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per mode (train.seed 0, 1, ...; default 3)")
    parser.add_argument("--every", type=int, default=4, help="checkpoint (and score) every this many steps (default 4)")
    parser.add_argument("--continue", dest="resume", action="store_true",
                        help="keep the runs of the record already written under --name (same config, --set and "
                             "--every) and run only the (mode, seed) pairs it lacks: more seeds, or a stopped race")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep each run's checkpoints under --scratch after scoring them (default: deleted; "
                             "16 steps of the real model every 4 steps are 8.5 GB a run)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="where the record and the picture go (default: benchmarks/results)")
    parser.add_argument("--scratch", type=Path, default=Path("runs/race"),
                        help="where the runs write their checkpoints (default: runs/race)")


def from_arguments(args: argparse.Namespace) -> dict:
    return race(args.config, args.overrides, args.modes.split(","), args.seeds, args.every,
                args.name or Path(args.config).stem, results=args.results, scratch=args.scratch, resume=args.resume,
                keep_checkpoints=args.keep_checkpoints)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="KEY=VALUE, as streamrl run")
    parser.add_argument("--name", help="the results' file stem (default: the config's)")
    add_arguments(parser)
    from_arguments(parser.parse_args(argv))


if __name__ == "__main__":  # vLLM starts its engine with spawn
    sys.exit(run_command(main))
