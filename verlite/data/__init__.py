"""Prompts for training: the task tokenizer, synthetic tasks, prompt files, datasets and batches."""

from verlite.data.dataset import (
    PromptDataset,
    build_datasets,
    check_prompts,
    holdout_split,
    task_records,
)
from verlite.data.files import DataError, PromptRecord, read_prompt_file, record_conversation
from verlite.data.loader import (
    PromptBatch,
    PromptLoader,
    check_fills_a_batch,
    collate_prompts,
    position_ids,
    prompt_tensordict,
    response_texts,
    row_records,
)
from verlite.data.tasks import TASKS, Task
from verlite.data.tokenizer import (
    build_task_tokenizer,
    continuation_text,
    encode_prompts,
    load_reward_tokenizer,
    load_tokenizer,
    response_text,
)

__all__ = [
    "TASKS",
    "DataError",
    "PromptBatch",
    "PromptDataset",
    "PromptLoader",
    "PromptRecord",
    "Task",
    "build_datasets",
    "build_task_tokenizer",
    "check_fills_a_batch",
    "check_prompts",
    "collate_prompts",
    "continuation_text",
    "encode_prompts",
    "holdout_split",
    "load_reward_tokenizer",
    "load_tokenizer",
    "position_ids",
    "prompt_tensordict",
    "read_prompt_file",
    "record_conversation",
    "response_text",
    "response_texts",
    "row_records",
    "task_records",
]
