"""The prompt datasets: `data` (what is trained on) and `eval.data` (held-out prompts). Whether the files
and columns are there is pipelines/config/world.py's, once the schema holds."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from pipelines.config.base import Section

BUILTIN_DATASET_PREFIX = "builtin:"
# builtin:arithmetic is every single-digit addition problem; -train and -heldout split them (80/20, a fixed
# split): train on one, evaluate on the other (eval.data) to see what RL does to problems it never trained on.
BUILTIN_DATASET_SPLITS = {"arithmetic": "all", "arithmetic-train": "train", "arithmetic-heldout": "heldout",
                          "tools": "all", "tools-train": "train", "tools-heldout": "heldout"}
BUILTIN_DATASETS = tuple(BUILTIN_DATASET_SPLITS)
DATASET_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


class DataConfig(Section):
    path: str = Field(
        "builtin:arithmetic",
        description="Prompt dataset: a .parquet, .jsonl/.json or .csv file, a folder written by `datasets`' "
        "save_to_disk, 'hf:NAME' (a `datasets` dataset by name, from the Hugging Face cache with "
        "HF_HUB_OFFLINE=1), 'reasoning_gym:<task>', or 'builtin:arithmetic' (single-digit addition made by "
        "streamrl).",
    )
    prompt_column: str = Field(
        "prompt", description="Column holding the prompts: plain text, or chat messages (a list of "
        "{role, content}, roles system/user/assistant), the same kind in every row."
    )
    system_prompt: Optional[str] = Field(
        None, description="A system message put before every prompt (a text prompt becomes a user message). "
        "Needs a chat template (chat_template: auto with a tokenizer that has one, or a file)."
    )
    chat_template: str = Field(
        "auto", description="How prompts become the model's input (operators/common/prompts.py): 'auto' applies the "
        "tokenizer's chat template (with the generation prompt) when it has one and the prompts are messages or "
        "data.system_prompt is set, else encodes the text as it is; 'none' never applies one (text prompts "
        "only); or a path to a Jinja template file, applied to every prompt."
    )
    split: Literal["train", "heldout", "all"] = Field(
        "train", description="reasoning_gym:<task> datasets: which split of the task's problems (held-out problems "
        "never appear in the train split, whatever the sizes and seeds)."
    )
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="reasoning_gym:<task> datasets: the task's own options "
        "(keyword arguments of its config, e.g. {min_animals: 1, max_animals: 3} for leg_counting)."
    )
    hf_config: Optional[str] = Field(
        None, description="'hf:NAME' datasets: the configuration (subset) name, as load_dataset's second argument."
    )
    hf_split: str = Field(
        "train", description="'hf:NAME' datasets and save_to_disk folders of several splits: the split, as "
        "load_dataset's split= (slices like 'train[:1000]' work for hf:NAME)."
    )
    id_column: Optional[str] = Field(
        None, description="Column with a stable prompt id; if unset, ids are made from the row index."
    )
    columns: dict[str, str] = Field(
        default_factory=dict, description="Columns made from others as the file is read, {new: source}: the "
        "source a column or a dotted path into a column of records, e.g. {ground_truth: "
        "reward_model.ground_truth, index: extra_info.index} for verl's parquet layout. The new names can be "
        "prompt_column or id_column and reach the reward functions like any column."
    )
    num_prompts: int = Field(256, gt=0, description="Number of prompts the builtin dataset makes.")

    @field_validator("columns")
    @classmethod
    def _column_sources(cls, columns: dict[str, str]) -> dict[str, str]:
        for new, source in columns.items():
            if not new.strip() or not source.strip() or any(not part.strip() for part in source.split(".")):
                raise ValueError(f"{new!r}: {source!r} is not a column or a dotted path like reward_model.ground_truth "
                                 "(no empty names); fix the entry")
        return columns
    seed: int = Field(0, description="Seed of the builtin dataset and of shuffling.")
    shuffle: bool = Field(True, description="Shuffle the prompt order (with `seed`) before each epoch.")
    invalid_prompts: Literal["error", "drop"] = Field(
        "error", description="What to do with invalid prompt rows, found before anything starts: a missing, "
        "non-text or empty prompt, an empty or duplicate id (with id_column), or a prompt whose tokens plus "
        "rollout.max_new_tokens exceed the model's context. 'error' stops with the rows listed; 'drop' removes "
        "them and reports what was dropped."
    )


class EvalDataConfig(DataConfig):
    path: str = Field(
        description="Held-out prompts: a .parquet, .jsonl/.json or .csv file with the columns the reward "
        "functions need, or 'builtin:arithmetic-heldout' (the tiny task's problems that "
        "'builtin:arithmetic-train' never trains on).",
    )
    num_prompts: int = Field(256, gt=0, description="Most prompts the builtin dataset makes (the held-out "
                             "split has 20 distinct problems and never repeats one).")
    split: Literal["train", "heldout", "all"] = Field(
        "heldout", description="reasoning_gym:<task> datasets: which split of the task's problems (default the "
        "held-out one, never trained on)."
    )
    system_prompt: Optional[str] = Field(
        None, description="A system message put before every held-out prompt; default data.system_prompt (the "
        "policy is evaluated as it is trained)."
    )
    chat_template: Optional[str] = Field(None, description="As data.chat_template; default data.chat_template.")
    hf_split: str = Field("test", description="As data.hf_split; default the held-out split most datasets name "
                          "'test'.")
    shuffle: bool = Field(False, description="Shuffle the prompts (with `seed`) before eval.max_prompts "
                          "takes the first ones.")
