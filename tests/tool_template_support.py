"""Chat templates for multi-turn runs through a template (``data.chat_template`` with
``rollout.multi_turn.env``): Qwen2.5-Instruct's tool turns, and templates whose turns cannot
be written one after another."""

from __future__ import annotations

# Qwen2.5-Instruct's turn format with its tool role (its default system turn and tool
# schemas left out): consecutive tool messages share one user turn, each in <tool_response>.
QWEN_TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TURNS = (
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Without a tool role: the template raises on it (as Llama 2's or Mistral's do on roles
# they do not know).
NO_TOOL_ROLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unknown role: ' + message.role) }}{%- endif %}" + _TURNS
)
# Drops the messages of roles it does not know, silently.
DROPS_TOOL_TEMPLATE = (
    "{%- for message in messages if message.role in ['system', 'user', 'assistant'] %}" + _TURNS
)
# Writes an empty thinking block into the last assistant turn only (as Qwen3's does): the
# generation prompt is not followed by the assistant's content.
THINKS_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set think = '<think></think>' if message.role == 'assistant' and loop.last else '' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + think + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Keeps only the last assistant turn's content: an observation rewrites the turn before it.
FORGETS_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message.content if message.role != 'assistant' or loop.last else '' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Writes no generation prompt after a tool turn: the policy would continue the tool's turn.
NO_PROMPT_AFTER_TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt and messages[-1].role != 'tool' %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
