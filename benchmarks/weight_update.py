"""Latency of one weight update, trainer to vLLM, through the real channel: publish -> pull -> load.

    flock /tmp/streamrl-bench.lock python benchmarks/weight_update.py [--sizes medium,large] [--repeats 5]

One local Ray session, one real `PolicyStore`, real `TrainWorker`s (DeepSpeed, world of one) and one
real vLLM engine (`VLLMEngine`, dtype float32 as in the tiny job) in this process. Per model size it
times, interleaved (A B C A B C ...) so machine drift hits every channel alike:

* `before`: the channel as it was before operators/weights.py, re-done here with the same calls:
  the trainer's whole fp32 state dict as numpy, a NaN check, one `ray.put` of the dict, the store's
  publish; the generator's `get_latest` + `ray.get`, `safetensors.numpy.save_file` to /dev/shm, the
  workers' `load_weights_file`, a prefix-cache reset.
* `after_fp32`: the bucket channel with an fp32 trainer: `TrainWorker._publish` (module-by-module
  walk, buckets of `train.weight_bucket_mb`, one object each, manifest to the store); the
  generator's `get_latest` + `operators.weights.fetch`, `VLLMEngine.load_weights`.
* `after_bf16`: the same with a bf16 trainer (`train.dtype: bf16`, ZeRO-1): half the bytes; vLLM
  casts the bf16 weights to its float32 on load.

Each is split into publish (trainer side), pull (store to generator) and load (into vLLM) seconds.
The first recorded figures (0.70 s at 12.7M, 2.98 s at 42.5M, benchmarks/generate_throughput.py on
2026-11-30) timed the load alone through an older path (a pickled blob through `collective_rpc`).
Writes benchmarks/results/weight_update.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS = ROOT / "benchmarks" / "results"
CHANNELS = ("before", "after_fp32", "after_bf16")


def trainer(path: Path, dtype: str, store, port: int):
    from operators.workers.settings import LrSchedule, TrainerSettings
    from operators.workers.train_worker import TrainWorker

    settings = TrainerSettings(model_path=str(path), lr=1e-5, zero_stage=0 if dtype == "fp32" else 1, dtype=dtype,
                               torch_threads=2, lr_schedule=LrSchedule(warmup_steps=0))
    return TrainWorker(0, 1, port, settings, store)


def before(worker, store, engine) -> dict:
    """The channel before the buckets (see the module docstring), with the same calls."""
    import numpy as np
    import ray
    from safetensors.numpy import save_file

    start = time.perf_counter()
    weights = worker.state_dict()  # fp32 numpy, whole model
    assert not [name for name, array in weights.items() if not np.isfinite(array).all()]
    worker.version = ray.get(store.get_version.remote()) + 1
    ray.get(store.publish.remote(worker.version, [ray.put(weights)]))
    published = time.perf_counter()
    del weights
    version, (ref,) = ray.get(store.get_latest.remote())
    pulled_weights = ray.get(ref)
    pulled = time.perf_counter()
    engine.weight_file.count += 1
    path = f"{engine.weight_file.dir.name}/before-{engine.weight_file.count % 2}.safetensors"
    save_file({name: np.ascontiguousarray(array) for name, array in pulled_weights.items()}, path)
    engine.llm.collective_rpc("load_weights_file", args=(path,))
    engine.llm.reset_prefix_cache()
    loaded = time.perf_counter()
    return {"publish_s": published - start, "pull_s": pulled - published, "load_s": loaded - pulled,
            "bytes": sum(array.nbytes for array in pulled_weights.values())}


def after(worker, store, engine) -> dict:
    import ray

    from operators.weights import fetch

    start = time.perf_counter()
    worker.version = ray.get(store.get_version.remote()) + 1
    worker._publish()
    published = time.perf_counter()
    version, (ref,) = ray.get(store.get_latest.remote())
    weights = fetch(ref)
    pulled = time.perf_counter()
    engine.load_weights(weights)
    loaded = time.perf_counter()
    return {"publish_s": published - start, "pull_s": pulled - published, "load_s": loaded - pulled,
            "bytes": weights.nbytes, "buckets": len(weights.buckets)}


def written_error(engine, expected: dict) -> float:
    """Greatest |difference| between the file the vLLM workers last read and the trainer's weights
    (0 when the bf16 buckets went through unchanged)."""
    import numpy as np
    from safetensors.torch import load_file

    path = f"{engine.weight_file.dir.name}/weights-{engine.weight_file.count % 2}.safetensors"
    written = {name: tensor.float().numpy() for name, tensor in load_file(path).items()}
    return max(float(np.abs(written[name] - array).max()) for name, array in expected.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="medium,large", help="model sizes of generate_throughput.py")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="/tmp/streamrl-bench-models")
    parser.add_argument("--out", default=str(RESULTS / "weight_update.json"))
    args = parser.parse_args()

    import ray

    from generate_throughput import build_model
    from operators.engines.vllm import VLLMEngine
    from pipelines.runtime.policy_store import create_policy_store
    from operators.workers.deepspeed_setup import free_port

    ray.init(num_cpus=2, object_store_memory=1536 * 2**20, include_dashboard=False, log_to_driver=False)
    records = []
    for size in args.sizes.split(","):
        path, params = build_model(size, Path(args.models))
        store_name = f"weights-bench-{size}"
        store = create_policy_store(store_name)
        ray.get(store.get_version.remote())
        workers = {"fp32": trainer(path, "fp32", store, free_port()),
                   "bf16": trainer(path, "bf16", store, free_port())}
        engine = VLLMEngine(str(path), gpu_memory_utilization=0.2, max_model_len=512, dtype="float32")
        times = {channel: [] for channel in CHANNELS}
        for repeat in range(args.repeats + 1):  # the first round warms every path up and is not kept
            for channel in CHANNELS:
                if channel == "before":
                    timing = before(workers["fp32"], store, engine)
                else:
                    timing = after(workers[channel.removeprefix("after_")], store, engine)
                timing["total_s"] = timing["publish_s"] + timing["pull_s"] + timing["load_s"]
                if repeat:
                    times[channel].append(timing)
                print(f"{size} {channel:<11} " + " ".join(f"{k} {v:.3f}" for k, v in timing.items() if k.endswith("_s")),
                      flush=True)
        error = written_error(engine, workers["bf16"].state_dict())  # after_bf16 ran last
        record = {"model": size, "parameters": params, "bf16_written_max_abs_error": error, "channels": {}}
        for channel, rows in times.items():
            record["channels"][channel] = {
                key: round(statistics.median(row[key] for row in rows), 4)
                for key in ("publish_s", "pull_s", "load_s", "total_s")
            } | {"bytes": rows[0]["bytes"], "buckets": rows[0].get("buckets", 1)}
        base = record["channels"]["before"]["total_s"]
        record["speedup_vs_before"] = {c: round(base / record["channels"][c]["total_s"], 2) for c in CHANNELS[1:]}
        records.append(record)
        engine.close()
        del workers
        ray.kill(store)
    print(f"\n{'model':<8}{'params':>8} {'channel':<11}{'MB':>7}{'publish':>9}{'pull':>8}{'load':>8}{'total':>8}{'vs before':>10}")
    for r in records:
        for channel, c in r["channels"].items():
            ratio = r["speedup_vs_before"].get(channel)
            print(f"{r['model']:<8}{r['parameters'] / 1e6:>7.1f}M {channel:<11}{c['bytes'] / 2**20:>7.0f}{c['publish_s']:>9.3f}"
                  f"{c['pull_s']:>8.3f}{c['load_s']:>8.3f}{c['total_s']:>8.3f}{(f'{ratio:.2f}x' if ratio else ''):>10}")
    out = {
        "command": "python benchmarks/weight_update.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "recorded_before_load_only_s": {"medium": 0.70, "large": 2.98},
        "records": records,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    ray.shutdown()


if __name__ == "__main__":
    main()
