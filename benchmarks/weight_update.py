"""One weight update, trainer to an in-flight vLLM engine, old plane against new, in one run.

    flock /tmp/streamrl-bench.lock python benchmarks/weight_update.py [--sizes medium,large,smollm2] [--repeats 5]

Real parts in one local Ray session: per plane a policy store (`PolicyStoreClient`), a `TrainWorker` (DeepSpeed, a world
of one, fp32 as on CPU) and an `AsyncVLLMEngine` under a `RolloutLoop` (dtype float32, partial rollout),
exactly as a job wires them (operators/weights/publisher.py `Publisher.publish`, operators/engines/rollout.py):

* `object_store` (the plane before operators/weights/gloo_plane.py): rank 0 packs buckets, puts each in the
  object store and publishes the manifest; the engine's watcher pulls the buckets, writes a safetensors
  file, pauses, loads it through the worker extension, resumes.
* `gloo` (the weight plane): rank 0 packs the buckets and hands them to its sender, whose thread
  broadcasts them over gloo to the engine's receiver (vLLM's weight-transfer API, our backend); the
  engine pauses only to apply the staged version and confirm it.

Per update (interleaved A B A B so machine drift hits both alike; the first round warms up and is not
kept): `trainer_blocked_s` (what `_publish` held the rank: gather, pack, NaN check, then the put and
publish, or the hand-over), `update_s` (from the publish's start to the engine running the version) and
`pause_s` (the engine's stall, from its UpdateRecord). The engine is idle during the update: the pause
is the apply alone, without requests to freeze. Also the bandwidths the 7B estimate reads: pack (gather
to host buckets), the gloo broadcast, and the apply.

With `--lora R` both sides train LoRA adapters of rank R on every linear layer: `gloo` then sends the base model
with the adapters merged (rollout.lora_adapters: false), against `adapters` (rollout.lora_adapters, the
default): the adapters alone on the object-store plane, added by the engine with no pause
(operators/engines/adapters.py).

Sizes: `medium` (12.7M) and `large` (42.5M) of benchmarks/generate_throughput.py, and `smollm2`, the
real SmolLM2-135M-Instruct (pipelines/data/smollm2.py). Writes benchmarks/results/weight_update.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "benchmarks" / "results"
PLANES = ("object_store", "gloo")


def model_path(size: str, models: Path) -> tuple[Path, int]:
    if size == "smollm2":
        from pipelines.data.smollm2 import build_smollm2

        path = build_smollm2()
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        return path, 134_515_008 if config.tie_word_embeddings else 0
    from benchmarks.generate_throughput import build_model

    return build_model(size, models)


def side(path: Path, plane: str, port: int, lora_r: int | None = None):
    """A (store, trainer rank, rollout loop) wired as a job wires them for `plane` (`adapters`: a LoRA job's
    adapters alone; with `lora_r` the trainer trains adapters of that rank)."""
    from operators.engines.factory import make_in_flight_engine
    from operators.engines.rollout import RolloutLoop
    from operators.workers.lora import LoraSettings
    from operators.workers.settings import LrSchedule, TrainerSettings
    from operators.workers.train_worker import TrainWorker
    from operators.weights.store import PolicyStoreClient

    store = PolicyStoreClient.create(0)
    store.version()
    adapters = plane == "adapters"
    lora = LoraSettings(r=lora_r, alpha=2 * lora_r) if lora_r else None
    settings = TrainerSettings(model_path=str(path), lr=1e-5, torch_threads=1, lr_schedule=LrSchedule(warmup_steps=0),
                               weight_transfer="object_store" if adapters else plane, verify_weights_every=0,
                               lora=lora, serve_adapters=adapters)
    worker = TrainWorker(0, 1, port, settings, store)
    options = {"weight_transfer": "gloo", "weight_timeout_s": 300} if plane == "gloo" else {}
    if adapters:
        options["adapters"] = {"r": lora_r, "alpha": 2 * lora_r, "keep": 3}
    engine = make_in_flight_engine("vllm", str(path), gpu_memory_utilization=0.1, max_model_len=256,
                                   max_num_seqs=16, **options)
    loop = RolloutLoop(engine, max_seqs_in_flight=16, partial_rollout=True, store=store, name=f"bench-{plane}")
    return store, worker, loop


def one_update(store, worker, loop) -> dict:
    version = loop.version + 1
    worker.version = version
    start = time.perf_counter()
    blocked = worker._publish()
    loop.wait_version(version, timeout_s=600)
    done = time.perf_counter()
    records = []
    while not records:  # the loop reports its UpdateRecord just after the version changes
        records = [r for r in store.load_log() if r["version"] == version]
        time.sleep(0.01 if not records else 0)
    record = records[-1]
    figures = {"trainer_blocked_s": blocked, "update_s": done - start, "pause_s": record["pause_s"],
               "load_s": record["load_s"], "bytes": worker.publisher.last_publish["bytes"]}
    sender = worker.publisher.sender
    if getattr(sender, "records", None):  # the gloo plane's sender
        figures["broadcast_s"] = sender.records[-1]["broadcast_s"]
    return figures


def pack_seconds(worker) -> float:
    """Gather + pack into host buckets alone (what every plane starts with)."""
    start = time.perf_counter()
    buckets = list(worker.weight_buckets())
    del buckets
    return time.perf_counter() - start


def median(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return round(statistics.median(values), 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="medium,large,smollm2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="/tmp/streamrl-bench-models")
    parser.add_argument("--out", default=str(RESULTS / "weight_update.json"))
    parser.add_argument("--lora", type=int, default=None, help="train LoRA adapters of this rank: merged weights on "
                        "the gloo plane against the adapters alone")
    args = parser.parse_args()
    planes = ("gloo", "adapters") if args.lora else PLANES

    import ray

    from operators.workers.deepspeed_setup import free_port

    ray.init(num_cpus=2, object_store_memory=2048 * 2**20, include_dashboard=False, log_to_driver=False)
    records = []
    for size in args.sizes.split(","):
        path, params = model_path(size, Path(args.models))
        sides = {plane: side(path, plane, free_port(), args.lora) for plane in planes}
        rows = {plane: [] for plane in planes}
        packs = []
        for repeat in range(args.repeats + 1):
            for plane in planes:
                figures = one_update(*sides[plane])
                if repeat:
                    rows[plane].append(figures)
                print(f"{size} {plane:<12} " + " ".join(f"{k} {v:.3f}" for k, v in figures.items() if k.endswith("_s")),
                      flush=True)
            if repeat:
                packs.append(pack_seconds(sides["gloo"][1]))
        record = {"model": size, "parameters": params, "lora_r": args.lora, "planes": {}}
        for plane in planes:
            record["planes"][plane] = {key: median(rows[plane], key) for key in
                                       ("trainer_blocked_s", "update_s", "pause_s", "load_s", "broadcast_s")}
            record["planes"][plane]["bytes"] = rows[plane][0]["bytes"]
        old, new = record["planes"][planes[0]], record["planes"]["gloo"]
        if args.lora:  # merged (gloo) against the adapters alone
            old, adapters = new, record["planes"]["adapters"]
            record["adapters_vs_merged"] = {"bytes": round(adapters["bytes"] / old["bytes"], 4),
                                            "pause_s": round(adapters["pause_s"] / old["pause_s"], 4),
                                            "update_s": round(adapters["update_s"] / old["update_s"], 4)}
        nbytes = new["bytes"]
        record["pack_s"] = round(statistics.median(packs), 4)
        record["bandwidth_GBps"] = {"pack": round(nbytes / record["pack_s"] / 1e9, 3),
                                    "gloo_broadcast": round(nbytes / new["broadcast_s"] / 1e9, 3),
                                    "apply": round(nbytes / new["load_s"] / 1e9, 3)}
        if not args.lora:
            record["speedup"] = {key: round(old[key] / new[key], 2) for key in ("update_s", "trainer_blocked_s", "pause_s")}
        records.append(record)
        for store, worker, loop in sides.values():
            loop.close()
            sender = worker.publisher.sender
            if sender is not None:
                sender.close()
            store.kill()
        del sides
    print(f"\n{'model':<8}{'params':>8} {'plane':<13}{'MB':>6}{'blocked':>9}{'update':>8}{'pause':>8}{'apply':>8}")
    for r in records:
        for plane, c in r["planes"].items():
            print(f"{r['model']:<8}{r['parameters'] / 1e6:>7.1f}M {plane:<13}{c['bytes'] / 2**20:>6.0f}"
                  f"{c['trainer_blocked_s']:>9.3f}{c['update_s']:>8.3f}{c['pause_s']:>8.3f}{c['load_s']:>8.3f}")
        if "speedup" in r:
            print(f"{'':<17}new vs old: update {r['speedup']['update_s']}x, trainer blocked "
                  f"{r['speedup']['trainer_blocked_s']}x, pause {r['speedup']['pause_s']}x; bandwidths GB/s {r['bandwidth_GBps']}")
        else:
            print(f"{'':<17}adapters / merged: {r['adapters_vs_merged']}")
    out = {
        "command": "python benchmarks/weight_update.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "records": records,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    ray.shutdown()


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
