"""A local instruct model as a practitioner brings one, built here (nothing downloaded): a tiny
random Qwen2 saved with ``save_pretrained`` beside a byte-level BPE tokenizer that carries a
Qwen2.5-style chat template; and prompt files in GSM8K's and MATH's formats."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow
import pyarrow.parquet
import torch
from model_support import tiny_qwen2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

# Qwen2.5-Instruct's turn format (its default system turn left out).
QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's way of turning thinking off: the variable enable_thinking (a template keyword,
# data.chat_template_kwargs) writes an empty thinking block after the generation prompt.
THINKING_TEMPLATE = QWEN_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}",
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
)
# Modelled on Qwen3's tokenizer_config chat_template: tools as JSON, a namespace, the
# functions transformers gives templates (raise_exception, strftime_now), an assistant turn
# in a {% generation %} block (the assistant-token mask's marker) and enable_thinking.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unexpected role ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if show_date is defined and show_date %}{{- strftime_now('%Y') + '\\n' }}{%- endif %}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
# Gemma-2-it's: no system role, an assistant turn is the model's, ended by <end_of_turn>.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
# Llama-3-style: the template writes the BOS token itself.
BOS_TEMPLATE = "{{- bos_token }}" + QWEN_TEMPLATE
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Synthetic problems: (question, GSM8K answer, MATH solution).
PROBLEMS = [
    (
        f"Tom has {a} apples and buys {b} more. How many apples does he have?",
        f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b:,}",
        f"Adding, ${a} + {b} = \\boxed{{{a + b}}}$.",
    )
    for a, b in [(12, 60), (7, 8), (1200, 34), (5, 5), (40, 2), (3, 9), (21, 21), (9, 90)]
]


def chat_tokenizer(
    template: str | None = QWEN_TEMPLATE, *, bos: bool = False
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (every text encodes: no unknown token) with Qwen2's special
    tokens, ``template`` as its chat template, and a BOS token when ``bos``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[*SPECIAL, "<s>"] if bos else SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([" ".join(p) for p in PROBLEMS] * 10, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        bos_token="<s>" if bos else None,
    )
    fast.chat_template = template
    return fast


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama's and Mistral's: Metaspace, a text's first word
    marked with ``▁``) whose vocabulary holds both ``?`` and ``▁?`` (a question mark after a
    space)."""
    words = ["cat", "dog", "key", "val", "bar", "foo", "baz", "qux", "one", "two", "six", "ten"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<pad>", "<eos>", "<unk>"])
    tokenizer.train_from_iterator([" ".join(w + "?" for w in words) + " ? ? ? ?"] * 50, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def save_chat_model(
    folder: Path, template: str | None = QWEN_TEMPLATE, *, bos: bool = False
) -> PreTrainedTokenizerFast:
    """A tiny random Qwen2 and :func:`chat_tokenizer` saved into ``folder`` (``model.path``)."""
    tokenizer = chat_tokenizer(template, bos=bos)
    tiny_qwen2(tied=True, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return tokenizer


def save_end_of_turn_model(folder: Path) -> str:
    """A Gemma-2-it-like folder: :data:`GEMMA_TEMPLATE`, whose turns end with <end_of_turn>, a
    tokenizer whose EOS is another token (<|endoftext|>), and a generation_config.json that
    ends generation at both, as Gemma-2-it's does; a tiny Qwen2 whose weights make
    <end_of_turn> every step's token by a logit margin of hundreds. The end-of-turn text."""
    end = "<end_of_turn>"
    tokenizer = chat_tokenizer(GEMMA_TEMPLATE, bos=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", end]})
    tokenizer.eos_token = "<|endoftext|>"
    ends = tokenizer.convert_tokens_to_ids(["<|endoftext|>", end])
    model = tiny_qwen2(tied=False, vocab_size=len(tokenizer))
    with torch.no_grad():
        # The residual stream's first coordinate is 10 at every position (no layer writes
        # it), the final norm keeps only it, and the head reads it into <end_of_turn> alone.
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[ends[1], 0] = 100.0
    model.generation_config = GenerationConfig(eos_token_id=ends)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return end


def write_gsm8k_parquet(path: Path) -> Path:
    """GSM8K's format: ``question``, and ``answer`` with the reasoning then ``#### 72``."""
    rows = {"question": [q for q, _, _ in PROBLEMS], "answer": [a for _, a, _ in PROBLEMS]}
    pyarrow.parquet.write_table(pyarrow.table(rows), path)
    return path


def chat_gsm8k_overrides(policy: Path, parquet: Path, *, system: str, suffix: str) -> list[str]:
    """The settings of a chat policy (``policy``, :func:`save_chat_model`'s folder) trained
    through its template, with a system prompt and a suffix, on the GSM8K file ``parquet``
    (:func:`write_gsm8k_parquet`), its training and validation set."""
    return [
        f"model.path={policy}",
        "data.task=null",
        f"data.train_file={parquet}",
        f"data.val_file={parquet}",
        "data.prompt_key=question",
        "data.answer_rule=gsm8k",
        "data.chat_template=true",
        f"data.system_prompt={system}",
        f"data.prompt_suffix={suffix}",
        "data.max_prompt_length=128",
    ]


def write_math_jsonl(path: Path) -> Path:
    """MATH's format: ``problem``, and ``solution`` with the answer in ``\\boxed{}``."""
    path.write_text(
        "".join(json.dumps({"problem": q, "solution": s}) + "\n" for q, _, s in PROBLEMS)
    )
    return path


VERL_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def write_verl_gsm8k_parquet(path: Path, *, system: str | None = None) -> Path:
    """GSM8K as verl's preprocessing writes it: the prompt a conversation (the question and
    an instruction as the user's turn, after ``system``'s turn when given), the answer in
    ``reward_model.ground_truth``, and columns verlite does not read."""
    system_turn = [] if system is None else [{"role": "system", "content": system}]
    rows = {
        "data_source": ["openai/gsm8k"] * len(PROBLEMS),
        "prompt": [
            [*system_turn, {"role": "user", "content": f"{q} {VERL_INSTRUCTION}"}]
            for q, _, _ in PROBLEMS
        ],
        "ability": ["math"] * len(PROBLEMS),
        "reward_model": [
            {"style": "rule", "ground_truth": a.rsplit("#### ", 1)[1].replace(",", "")}
            for _, a, _ in PROBLEMS
        ],
        "extra_info": [{"split": "train", "index": i} for i in range(len(PROBLEMS))],
    }
    pyarrow.parquet.write_table(pyarrow.table(rows), path)
    return path
