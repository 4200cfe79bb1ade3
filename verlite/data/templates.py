"""A prompt as the policy reads it: ``data.prompt_suffix`` appended to the record's prompt and,
with ``data.chat_template``, the tokenizer's own chat template rendered around it (an
optional system turn, the user turn, the assistant's generation prompt).

The rendered text becomes the record's prompt: what batches tokenize (once, without a BOS
of verlite's: the template writes the model's special tokens itself), what the length
policy measures, and what reward functions receive.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from verlite.config import DataConfig
from verlite.data.files import DataError, PromptRecord
from verlite.errors import shown


def format_prompts(
    records: Sequence[PromptRecord],
    where: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    *,
    model_path: str | None,
) -> list[PromptRecord]:
    """``records`` with each prompt as the policy reads it; unchanged without a suffix or a
    chat template. A tokenizer without a chat template, a template that fails on a prompt or
    renders only whitespace: a :class:`DataError` naming the setting (and the prompt)."""
    if data.prompt_suffix is None and not data.chat_template:
        return list(records)
    if data.chat_template and tokenizer.chat_template is None:
        raise DataError(
            f"data.chat_template=true, but the tokenizer of model.path={model_path!r} has no chat "
            "template (no chat_template in its tokenizer_config.json, no chat_template.jinja); "
            "save a tokenizer that has one, or set data.chat_template=false"
        )
    formatted = []
    for location, record in zip(where, records, strict=True):
        prompt = record["prompt"]
        if data.prompt_suffix is not None:
            prompt = f"{prompt} {data.prompt_suffix}"
        if data.chat_template:
            prompt = _render(location, prompt, tokenizer, data, model_path)
        formatted.append(PromptRecord(prompt=prompt, answer=record["answer"]))
    return formatted


def _render(
    location: str,
    prompt: str,
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    model_path: str | None,
) -> str:
    system = (
        [] if data.system_prompt is None else [{"role": "system", "content": data.system_prompt}]
    )
    messages = [*system, {"role": "user", "content": prompt}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template is the model author's Jinja code: a syntax error, its own
    # raise_exception (e.g. "system role not supported") or a filter's TypeError.
    except Exception as exc:
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise DataError(
            f"{location}: the chat template of model.path={model_path!r} fails on this prompt "
            f"(data.chat_template=true): {shown(reason, 160)}"
        ) from None
    if not isinstance(text, str) or not text.strip():
        raise DataError(
            f"{location}: the chat template of model.path={model_path!r} renders this prompt as "
            f"{shown(text, 60)}, empty or only whitespace (data.chat_template=true); fix the "
            "template or set data.chat_template=false"
        )
    return text
