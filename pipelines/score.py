"""Reuse outside RL: generate and score prompts in a plain Ray Data batch job.

    read prompts (Parquet) -> Generate -> Reward -> write Parquet

The same operator classes the GRPO job uses, with no policy store, trainer or staleness
gate; this file is the whole example. Run it as:

    python -m pipelines.score PROMPTS.parquet OUT_DIR --model builtin:tiny-arith --n 4
"""

from __future__ import annotations

import argparse

import ray
from ray.data import ActorPoolStrategy

from operators.stages.generate import Generate
from operators.stages.reward import Reward


def score_prompts(
    input_path: str,
    output_path: str,
    model_path: str,
    n: int = 4,
    max_new_tokens: int = 4,
    reward_functions: list[tuple[str, float]] = (("arithmetic_exact", 1.0),),
    num_generate_actors: int = 1,
    batch_size: int = 16,
) -> None:
    ds = ray.data.read_parquet(input_path)
    ds = ds.map_batches(
        Generate,
        fn_constructor_kwargs={"model_path": model_path, "n": n, "max_new_tokens": max_new_tokens},
        compute=ActorPoolStrategy(size=num_generate_actors),
        batch_size=batch_size, batch_format="pandas", num_cpus=0.5,
    )
    ds = ds.map_batches(
        Reward,
        fn_constructor_kwargs={"functions": list(reward_functions)},
        compute=ActorPoolStrategy(size=1),
        batch_format="pandas", num_cpus=0.1,
    )
    ds.write_parquet(output_path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="Parquet file or folder with a 'prompt' column (and the reward's columns)")
    parser.add_argument("output", help="folder to write scored Parquet files into")
    parser.add_argument("--model", default="builtin:tiny-arith",
                        help="local model folder, Hub id (org/name) or builtin:NAME (pipelines/data/models.py)")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--reward", default="arithmetic_exact", help="builtin name or module:function")
    args = parser.parse_args(argv)
    from pipelines.config.model import ModelConfig
    from pipelines.config.world import SCHEMA_CONTEXT
    from pipelines.data.models import resolve_model_path

    # with the model path check, as load_config runs it: a bad --model is named here, not in an actor
    model_path = resolve_model_path(ModelConfig.model_validate({"path": args.model}, context=SCHEMA_CONTEXT))
    ray.init(include_dashboard=False, logging_level="warning")
    score_prompts(args.input, args.output, model_path, n=args.n, reward_functions=[(args.reward, 1.0)])
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
