"""Throughput of one job in five schedules: where streaming with bounded staleness wins.

    python benchmarks/throughput.py [--steps 12] [--engine hf|vllm] [--modes plain,sync,stream0,stream1,stream2]

The same job (model, prompts, seeds, steps; benchmarks/throughput.yaml) runs as:

  plain    one Python process, no Ray: generate -> reward -> advantage -> train -> load
           weights, in turn, 2 torch threads each (the floor for framework overhead)
  sync     the DAG at max_staleness 0, colocated: generation and training take turns,
           each with the whole machine (2 threads each)
  stream0  the DAG at max_staleness 0, disjoint resources (1 thread generation, 1 training)
  stream1  the DAG at max_staleness 1, disjoint resources
  stream2  the DAG at max_staleness 2, disjoint resources

Each mode runs in its own process (fresh Ray, fresh memory). Printed per mode: samples/s
and tokens/s over the steady window (first generate start -> last train end), the whole
wall time including start-up, trainer and generator idle fractions and the overlap
efficiency (pipelines/tracking/timeline.py). Writes benchmarks/results/throughput.json and
throughput.png and logs both, with every figure, to MLflow (runs/bench/mlflow.db).

On the real model (SmolLM2-135M-Instruct on reasoning-gym, configs/smollm2_basic_arithmetic.yaml,
evaluation off):

    python benchmarks/throughput.py --size smollm2 --engine vllm --steps 6 --modes real_ablation \
        --name throughput_smollm2

Mode suffixes change one thing of their mode: "_padded" right-padded micro-batches (train.packing false),
"_bf16" the trainer and vLLM in bf16, "_shared" each group's prompt trained once (train.share_prompts; every
other mode sets it off, whatever the config says).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.command_line import run_child
from benchmarks.throughput_runs import run_dag, run_plain

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
CONFIG = HERE / "throughput.yaml"

MODES = {
    "plain": dict(staleness=0, gen_threads=2, train_threads=2, text="plain loop, no Ray, 2 threads"),
    "sync": dict(staleness=0, gen_threads=2, train_threads=2, text="DAG, staleness 0, colocated (turns, 2 threads each)"),
    "stream0": dict(staleness=0, gen_threads=1, train_threads=1, text="DAG, staleness 0, disjoint (1 + 1 thread)"),
    "stream1": dict(staleness=1, gen_threads=1, train_threads=1, text="DAG, staleness 1, disjoint (1 + 1 thread)"),
    "stream2": dict(staleness=2, gen_threads=1, train_threads=1, text="DAG, staleness 2, disjoint (1 + 1 thread)"),
    # Work-conserving variants (not disjoint): the slower stage gets both cores' threads and
    # shares one core with the other stage while that one is busy.
    "stream2_g2": dict(staleness=2, gen_threads=2, train_threads=1, text="DAG, staleness 2, generator 2 threads, trainer 1"),
    "stream2_t2": dict(staleness=2, gen_threads=1, train_threads=2, text="DAG, staleness 2, generator 1 thread, trainer 2"),
    # Two generate actors (data-parallel generation, 1 thread each): HF decoding of small
    # batches is bound by Python per-token overhead, so processes scale where threads do not.
    "sync_dp": dict(staleness=0, gen_threads=1, train_threads=2, actors=2,
                    text="DAG, staleness 0, colocated: 2 generate actors, then trainer 2 threads"),
    "stream2_dp": dict(staleness=2, gen_threads=1, train_threads=1, actors=2,
                       text="DAG, staleness 2, 2 generate actors + trainer (1 thread each, 3 on 2 cores)"),
}
# The in-flight ablation (engine vllm; issue 11): the engine as an AsyncLLM fed by several calls at once,
# with and without partial rollout, against the call-synchronous engine of before.
MODES.update({
    "sync_call": dict(staleness=0, gen_threads=2, train_threads=2, in_flight=False,
                      text="DAG, staleness 0, colocated, call-synchronous engine (one call at a time)"),
    "stream2_call": dict(staleness=2, gen_threads=1, train_threads=1, in_flight=False,
                         text="DAG, staleness 2, disjoint, call-synchronous engine"),
    **{f"inflight{k}": dict(staleness=k, gen_threads=1, train_threads=1, in_flight=True,
                            text=f"DAG, staleness {k}, disjoint, in-flight engine, drain on update")
       for k in (0, 1, 2)},
    **{f"partial{k}": dict(staleness=k, gen_threads=1, train_threads=1, in_flight=True, partial=True,
                           text=f"DAG, staleness {k}, disjoint, in-flight engine + partial rollout")
       for k in (1, 2, 4)},
})
MODES["partial2_t2"] = dict(staleness=2, gen_threads=1, train_threads=2, in_flight=True, partial=True,
                            text="DAG, staleness 2, in-flight + partial rollout, generator 1 thread, trainer 2")
# Issue 28: the trainer's layout and the CPU's dtype, mode by mode in one run. "_padded": right-padded
# micro-batches (train.packing: false, the layout before packing); "_bf16": packed, the trainer in bf16
# (ZeRO-1: DeepSpeed's bf16 needs it) and vLLM in bfloat16.
BF16 = ["train.dtype=bf16", "train.zero_stage=1", "rollout.vllm.dtype=bfloat16"]
for _base in ("plain", "sync", "inflight2", "partial2"):
    MODES[f"{_base}_padded"] = dict(MODES[_base], sets=["train.packing=false"],
                                    text=MODES[_base]["text"] + "; padded micro-batches")
    MODES[f"{_base}_bf16"] = dict(MODES[_base], sets=BF16, text=MODES[_base]["text"] + "; bf16 trainer and vLLM")
# Issue 28: each group's prompt laid out once in the trainer's packed micro-batches (train.share_prompts);
# "_shared" on top of any mode above, the rest of the mode unchanged.
for _base in ("plain", "sync", "inflight2", "partial2", "partial2_t2", "plain_bf16", "inflight2_bf16"):
    MODES[f"{_base}_shared"] = dict(MODES[_base], sets=MODES[_base].get("sets", []) + ["train.share_prompts=true"],
                                    text=MODES[_base]["text"] + "; each group's prompt trained once")
TRAINER = ["plain_padded", "inflight2_padded", "plain", "sync", "inflight2", "plain_bf16", "sync_bf16",
           "inflight2_bf16", "partial2_bf16"]
ABLATION = ["sync_call", "sync", "stream2_call", "inflight0", "inflight1", "inflight2", "partial1", "partial2",
            "partial4", "partial2_t2"]
# Issue 28 on the real model (--size smollm2): the ablation on SmolLM2-135M-Instruct and reasoning-gym.
REAL_ABLATION = ["sync", "inflight1", "inflight2", "partial2", "partial4"]
DEFAULT_MODES = ["plain", "sync", "stream0", "stream1", "stream2"]
# Real pretrained models (--size): the job's own config (its data, chat template, rewards, lengths), evaluation
# off; the builtin is converted once, no download.
REAL_SIZES = {"smollm2": (ROOT / "configs" / "smollm2_basic_arithmetic.yaml", "builtin:smollm2-135m-instruct")}


def mode_config(mode: str, model_path: str, args):
    from pipelines.config.load import load_config

    spec = MODES[mode]
    overrides = [
        f"model.path={model_path}", f"rollout.engine={args.engine}", f"train.steps={args.steps}",
        f"train.max_staleness={spec['staleness']}",
        f"rollout.torch_threads={spec['gen_threads']}", f"train.torch_threads={spec['train_threads']}",
        # Ray's CPU accounting: both stages fit on the 2 CPUs with room for reward/advantage/train ops.
        f"rollout.num_actors={spec.get('actors', 1)}", f"rollout.num_cpus={0.8 / spec.get('actors', 1)}",
        "train.num_cpus=0.8",
        f"tracking.run_name=throughput-{mode}",
        *([f"rollout.in_flight={str(spec['in_flight']).lower()}"] if "in_flight" in spec else []),
        # explicit both ways: partial rollout is the default for an in-flight vllm engine (issue 26, 4h)
        f"rollout.partial_rollout={str(bool(spec.get('partial'))).lower()}",
        # explicit both ways: the real-model config shares prompts, and a mode without "_shared" trains each
        # prompt per response, as every record before train.share_prompts did
        "train.share_prompts=false",
        *spec.get("sets", []),
        *(["eval=null", "train.checkpoint_every=1000", "output_dir=runs/bench-real"] if args.size in REAL_SIZES else []),
        *args.set,
    ]
    return load_config(config_of(args.size), overrides)


def config_of(size: str) -> Path:
    return REAL_SIZES[size][0] if size in REAL_SIZES else CONFIG


def run_one(mode: str, model_path: str, args) -> dict:
    """Runs in a child process; returns this mode's figures."""
    from pipelines.tracking.timeline import overlap_report

    cfg = mode_config(mode, model_path, args)
    start = time.time()
    run_id, figures = None, {}
    if mode.split("_")[0] == "plain":
        timelines = run_plain(cfg, model_path)
    else:
        timelines, run_id, figures = run_dag(cfg, args.ray_timeline and str(RESULTS / f"ray_timeline_{mode}.json"))
    wall = time.time() - start
    report = overlap_report(timelines)
    samples = sum(t["samples"] for t in timelines)
    tokens = sum(t["generated_tokens"] for t in timelines)
    return {
        "mode": mode, **MODES[mode], "mlflow_run_id": run_id, "steps": len(timelines),
        "samples": samples, "generated_tokens": tokens, "wall_s": wall,
        "samples_per_s": samples / report["window_s"], "tokens_per_s": tokens / report["window_s"],
        "samples_per_s_incl_startup": samples / wall,
        "staleness_max": max(t["staleness_max"] for t in timelines),
        "reward_first": timelines[0]["reward_mean"], "reward_last": timelines[-1]["reward_mean"],
        **report, **figures, "timelines": timelines,
    }


def build_bench_model(size: str) -> tuple[str, int]:
    if size in REAL_SIZES:
        from types import SimpleNamespace

        from safetensors import safe_open

        from pipelines.data.models import resolve_model_path

        path = resolve_model_path(SimpleNamespace(path=REAL_SIZES[size][1], revision=None))
        params = 0
        for file in Path(path).glob("*.safetensors"):
            with safe_open(str(file), "np") as weights:
                params += sum(int(np.prod(weights.get_slice(name).get_shape())) for name in weights.keys())
        return path, params
    from benchmarks.generate_throughput import build_model  # an untrained Llama with the character tokenizer

    path, params = build_model(size, Path.home() / ".cache" / "streamrl" / "bench-models")
    return str(path), params


def summarise(results: dict[str, dict]) -> dict:
    ratios = {}
    def ratio(a: str, b: str, key: str = "samples_per_s") -> None:
        if a in results and b in results:
            ratios[f"{a}/{b} {key}"] = results[a][key] / results[b][key]
    ratio("stream2", "stream0")
    ratio("stream2", "sync")
    ratio("stream1", "stream0")
    ratio("stream2", "plain")
    ratio("stream2_dp", "sync_dp")
    ratio("stream2_dp", "stream0")
    for variant in ("stream2_g2", "stream2_t2", "stream2_dp"):
        ratio(variant, "sync")
        ratio(variant, "stream0")
    for variant in ("inflight0", "inflight1", "inflight2", "partial1", "partial2", "partial4", "partial2_t2"):
        ratio(variant, "sync")
        ratio(variant, "sync_call")
        ratio(variant, "stream2_call")
    ratio("sync", "sync_call")
    # issue 28: the trainer's work per token against the padded fp32 layout, and each async mode against the
    # plain loop of the same layout and dtype (and of the layout before packing)
    for name, r in results.items():
        r["trainer_busy_s_per_step"] = r["trainer_busy_s"] / max(r["steps"], 1)
        r["trainer_busy_s_per_1k_tokens"] = 1e3 * r["trainer_busy_s"] / max(r["generated_tokens"], 1)
    for name in results:
        for base in ("inflight2_padded", "plain_padded"):
            if name != base and base in results and name.split("_")[0] == base.split("_")[0]:
                ratios[f"{name}/{base} trainer busy per token"] = (results[name]["trainer_busy_s_per_1k_tokens"]
                                                                   / results[base]["trainer_busy_s_per_1k_tokens"])
    for suffix in ("", "_bf16", "_padded", "_shared", "_bf16_shared"):
        for variant in ("sync", "inflight2", "partial2", "partial2_t2"):
            ratio(f"{variant}{suffix}", f"plain{suffix}")
            if suffix:
                ratio(f"{variant}{suffix}", "plain_padded")
    for name in results:  # each shared mode against the same mode without sharing, and its async modes against sync
        if name.endswith("_shared"):
            ratio(name, name.removesuffix("_shared"))
            if name != "sync_shared":
                ratio(name, "sync_shared")
    if "sync" in results and "plain" in results:
        ratios["sync/plain window (framework overhead)"] = results["sync"]["window_s"] / results["plain"]["window_s"]
        ratios["sync/plain wall incl. start-up"] = results["sync"]["wall_s"] / results["plain"]["wall_s"]
    return ratios


def print_table(results: dict[str, dict], ratios: dict) -> None:
    print(f"\n{'mode':<16} {'samples/s':>9} {'tok/s':>7} {'window':>7} {'wall':>6} {'gen busy':>8} {'train busy':>10} "
          f"{'gen idle':>8} {'train idle':>10} {'overlap eff':>11} {'staleness (oldest token)':>26} {'spanning':>8} "
          f"{'pause/update':>12} {'train s/step':>12} {'train s/1k tok':>14}")
    for mode, r in results.items():
        histogram = " ".join(f"{k}:{v}" for k, v in r.get("staleness_histogram", {}).items()) or "-"
        pause = f"{r['weight_pause_s_median'] * 1e3:.0f} ms" if "weight_pause_s_median" in r else "-"
        print(f"{mode:<16} {r['samples_per_s']:>9.2f} {r['tokens_per_s']:>7.1f} {r['window_s']:>6.1f}s {r['wall_s']:>5.0f}s "
              f"{r['generator_busy_s']:>7.1f}s {r['trainer_busy_s']:>9.1f}s {r['generator_idle_fraction']:>8.2f} "
              f"{r['trainer_idle_fraction']:>10.2f} {r['overlap_efficiency']:>11.2f} {histogram:>26} "
              f"{r.get('groups_spanning_versions', '-'):>8} {pause:>12} {r.get('trainer_busy_s_per_step', 0):>12.2f} "
              f"{r.get('trainer_busy_s_per_1k_tokens', 0):>14.3f}")
    print()
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}x")


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    modes = list(results)
    left.bar(modes, [results[m]["samples_per_s"] for m in modes], color="tab:blue")
    for index, mode in enumerate(modes):
        left.text(index, results[mode]["samples_per_s"], f"{results[mode]['samples_per_s']:.2f}\n"
                  f"eff {results[mode]['overlap_efficiency']:.2f}", ha="center", va="bottom", fontsize=8)
    left.set_ylabel("samples / s (steady window)")
    left.set_title("throughput")
    for index, mode in enumerate(modes):  # Gantt: generate (top) and train (bottom) busy intervals per mode
        timelines = results[mode]["timelines"]
        origin = min(s for t in timelines for _, s, _ in t["generate"])
        y = index * 3
        right.broken_barh([(s - origin, e - s) for t in timelines for _, s, e in t["generate"]], (y + 1, 0.9),
                          color="tab:orange")
        right.broken_barh([(t["train"][0] - origin, t["train"][1] - t["train"][0]) for t in timelines], (y, 0.9),
                          color="tab:green")
    right.set_yticks([i * 3 + 1 for i in range(len(modes))], modes)
    right.set_xlabel("seconds from first generate (orange: generate, green: train)")
    right.set_title("busy intervals")
    fig.suptitle(f"streamrl throughput, {platform.node()} ({os.cpu_count()} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def log_to_mlflow(record: dict, json_path: Path, png_path: Path) -> str:
    import mlflow

    from pipelines.config.load import load_config

    cfg = load_config(CONFIG)
    mlflow.set_tracking_uri(cfg.tracking_uri())
    if mlflow.get_experiment_by_name("streamrl-benchmarks") is None:
        mlflow.create_experiment("streamrl-benchmarks",
                                 artifact_location=(Path(cfg.output_dir).resolve() / "mlartifacts").as_uri())
    mlflow.set_experiment("streamrl-benchmarks")
    with mlflow.start_run(run_name="throughput") as run:
        mlflow.log_params({k: v for k, v in record["settings"].items()})
        for mode, r in record["modes"].items():
            mlflow.log_metrics({f"{mode}.{k}": float(r[k]) for k in (
                "samples_per_s", "tokens_per_s", "window_s", "wall_s", "overlap_efficiency",
                "trainer_idle_fraction", "generator_idle_fraction")})
            if r.get("mlflow_run_id"):
                mlflow.set_tag(f"run.{mode}", r["mlflow_run_id"])
        mlflow.log_metrics({k.replace("/", "_over_").replace(" ", "_").replace("(", "").replace(")", ""): v
                            for k, v in record["ratios"].items()})
        mlflow.log_artifact(str(json_path))
        mlflow.log_artifact(str(png_path))
        return run.info.run_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--size", default="medium",
                        help=f"model size from generate_throughput.SIZES, or a real model: {', '.join(REAL_SIZES)}")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"any of {', '.join(MODES)}; 'ablation' = {','.join(ABLATION)} (engine vllm); "
                             f"'trainer' = {','.join(TRAINER)}; 'real_ablation' = {','.join(REAL_ABLATION)}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every mode")
    parser.add_argument("--name", default="throughput", help="results file stem")
    parser.add_argument("--ray-timeline", action="store_true", help="also dump Ray's trace per DAG mode")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child process: run this mode only
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model_path, params = build_bench_model(args.size)
    if args.one:
        Path(args.out).write_text(json.dumps(run_one(args.one, model_path, args)))
        return
    groups = {"real_ablation": REAL_ABLATION, "ablation": ABLATION, "trainer": TRAINER}
    modes = [m.strip() for part in args.modes.split(",") for m in groups.get(part.strip(), [part])
             if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    needs_vllm = [m for m in modes if "in_flight" in MODES[m]]
    if needs_vllm and args.engine != "vllm":
        parser.error(f"modes {needs_vllm} set rollout.in_flight, which only the vllm engine has; add --engine vllm")
    RESULTS.mkdir(parents=True, exist_ok=True)
    print(f"model {model_path} ({params / 1e6:.1f}M parameters), engine {args.engine}, {args.steps} steps, modes {modes}")
    results = {}
    for mode in modes:
        out = RESULTS / f".{args.name}-{mode}.json"
        print(f"\n=== {mode}: {MODES[mode]['text']}", flush=True)
        command = [sys.executable, __file__, "--one", mode, "--out", str(out), "--steps", str(args.steps),
                   "--engine", args.engine, "--size", args.size] + [x for s in args.set for x in ("--set", s)]
        command += ["--ray-timeline"] if args.ray_timeline else []
        run_child(command, cwd=ROOT)
        results[mode] = json.loads(out.read_text())
        out.unlink()
        r = results[mode]
        print(f"=== {mode}: {r['samples_per_s']:.2f} samples/s, window {r['window_s']:.1f}s, wall {r['wall_s']:.0f}s, "
              f"overlap efficiency {r['overlap_efficiency']:.2f}", flush=True)
    ratios = summarise(results)
    print_table(results, ratios)
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpus": os.cpu_count(),
        "settings": {"engine": args.engine, "model_size": args.size, "params": params, "steps": args.steps,
                     "overrides": " ".join(args.set) or "-", "config": str(config_of(args.size).relative_to(ROOT))},
        "modes": results, "ratios": ratios,
    }
    json_path, png_path = RESULTS / f"{args.name}.json", RESULTS / f"{args.name}.png"
    json_path.write_text(json.dumps(record, indent=1))
    plot(results, png_path)
    run_id = log_to_mlflow(record, json_path, png_path)
    print(f"\nwrote {json_path.relative_to(ROOT)} and {png_path.relative_to(ROOT)}; MLflow run {run_id}")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
