"""Samples the trainer tests share: two prompt groups of four answers on the tiny model's tokenizer,
with advantages and behaviour log-probs a little off the policy, as single-turn responses and as
multi-turn episodes."""

from __future__ import annotations

from operators.algorithms.step_batch import explode

def step_samples(tokenizer_path: str) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    eos = tok.eos_token_id
    rows = []
    for index, (prompt, answers) in enumerate([("1+2=", ["3", "4", "13", "3"]), ("7+8=", ["15", "1", "15", "9"])]):
        responses = [tok(a, add_special_tokens=False)["input_ids"] + [eos] for a in answers]
        rows.append({
            "prompt_token_ids": tok(prompt)["input_ids"],
            "response_token_ids": responses,
            # Behaviour log-probs a little off the current policy, so the PPO ratio is not 1.
            "behavior_logprobs": [[-1.0 - 0.1 * j for j in range(len(r))] for r in responses],
            "advantages": [0.9, -0.5, -1.2, 0.8] if index == 0 else [1.1, -0.7, 0.4, -0.8],
        })
    return rows


def episode_rows(model_path: str) -> list[dict]:
    """The trainer test's groups as multi-turn episodes: each response is policy tokens, two observation
    tokens (loss mask 0), then the rest; the first response of the second group is all observation (its
    episode's reset failed: nothing of it is trained)."""
    rows = step_samples(model_path)
    for group, row in enumerate(rows):
        masks, responses, behaviour = [], [], []
        for index, (response, logprobs) in enumerate(zip(row["response_token_ids"], row["behavior_logprobs"])):
            extended = response[:1] + [response[0], response[0]] + response[1:]  # two observation tokens after the first
            mask = [1, 0, 0] + [1] * (len(response) - 1)
            if (group, index) == (1, 0):
                mask = [0] * len(extended)
            responses.append(extended)
            masks.append(mask)
            behaviour.append(logprobs[:1] + [0.0, 0.0] + logprobs[1:])  # an observation has no behaviour log-prob
        row.update(response_token_ids=responses, loss_masks=masks, behavior_logprobs=behaviour)
    return rows


def episode_samples(model_path: str) -> dict:
    """episode_rows as the step's samples (explode's numpy columns)."""
    return explode(episode_rows(model_path))


def model_weights(model_path: str) -> dict:
    """name -> numpy array of every safetensors file in a model folder (the weights an engine starts from)."""
    import glob
    import os

    from safetensors.numpy import load_file

    state = {}
    for file in glob.glob(os.path.join(model_path, "*.safetensors")):
        state.update(load_file(file))
    return state
