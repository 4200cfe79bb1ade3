"""A prompt as the policy reads it: ``data.prompt_suffix`` appended to the record's prompt and,
with ``data.chat_template``, the tokenizer's own chat template rendered around it (an
optional system turn, the user turn, the assistant's generation prompt). A prompt file's
conversation (:mod:`verlite.data.files`) is rendered as its own messages, the suffix after
its last turn's content; only a chat template renders one.

The rendered text becomes the record's prompt: what batches tokenize (once, without a BOS
of verlite's: the template writes the model's special tokens itself), what the length
policy measures, and what reward functions receive; the messages it was rendered from stay
in the record, for a reward model that reads them in its own template.

A multi-turn trajectory (``rollout.multi_turn.env``) continues that prompt with the sampled
tokens as they are, and writes each observation as the template's next turns
(:class:`TurnFormat`): the text the template renders after an assistant's content, for a
message of ``rollout.multi_turn.observation_role`` and the next generation prompt. Nothing
is rendered again around the sampled tokens, so the template's text is read off a stand-in
conversation, and a template whose turns are not appended one after another (one that
rewrites earlier turns when a later one comes) is refused before the run starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, cast

import jinja2
import jinja2.meta
from transformers import PreTrainedTokenizerBase

# apply_chat_template's own environment (no public accessor): what the template is read in.
from transformers.utils.chat_template_utils import _compile_jinja_template

from verlite.config import Config, ConfigError, DataConfig, RewardModelConfig
from verlite.data.files import (
    Conversation,
    DataError,
    Message,
    PromptRecord,
    SourceRecord,
    conversation_of,
)
from verlite.data.tokenizer import (
    encode_prompts,
    encode_written,
    holds_special_text,
    special_tokens,
    unknown_characters,
)
from verlite.errors import one_line, shown


def format_prompts(
    records: Sequence[SourceRecord],
    where: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    *,
    model_path: str | None,
) -> list[PromptRecord]:
    """``records`` with each prompt as the policy reads it; a text prompt unchanged without a
    suffix or a chat template. A tokenizer without a chat template, a template that fails on
    a prompt or renders only whitespace, a conversation without a template, a prompt that
    already ends with the suffix: a :class:`DataError` naming the setting (and the prompt)."""
    if data.chat_template and tokenizer.chat_template is None:
        raise DataError(
            f"data.chat_template=true, but the tokenizer of model.path={model_path!r} has no chat "
            "template (no chat_template in its tokenizer_config.json, no chat_template.jinja); "
            "save a tokenizer that has one, or set data.chat_template=false"
        )
    if data.chat_template:
        check_parses(tokenizer, field="model.path", path=model_path, use="data.chat_template")
    if data.chat_template and data.chat_template_kwargs:
        _check_variables(tokenizer, data, model_path)
    if data.chat_template and data.system_prompt is not None:
        _check_system_turn(tokenizer, data, model_path)
    if data.prompt_suffix is not None and (
        unknown := unknown_characters(tokenizer, f" {data.prompt_suffix}")
    ):
        # Named here: each prompt's own check would blame the first prompt.
        raise DataError(
            f"data.prompt_suffix={shown(data.prompt_suffix, 60)}, appended to every prompt "
            f"after a space, has characters the tokenizer does not know ({shown(unknown, 80)} "
            f"become {tokenizer.unk_token!r})"
        )
    formatted = []
    for location, record in zip(where, records, strict=True):
        prompt = record["prompt"]
        if data.chat_template:
            messages = _conversation(location, prompt, data)
            text = _render(location, messages, tokenizer, data, model_path)
            formatted.append(
                PromptRecord(prompt=text, answer=record["answer"], messages=tuple(messages))
            )
            continue
        if not isinstance(prompt, str):
            raise DataError(
                f"{location}: field {data.prompt_key!r} (data.prompt_key) is a list of chat "
                "messages, which only a chat template renders; set data.chat_template=true"
            )
        formatted.append(
            PromptRecord(prompt=_with_suffix(location, prompt, data), answer=record["answer"])
        )
    return formatted


def check_room(
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    *,
    model_path: str | None,
    bos: bool,
) -> None:
    """Refuse settings that alone fill ``data.max_prompt_length``: the chat template,
    ``data.system_prompt`` and ``data.prompt_suffix`` around an empty prompt, measured as
    batches measure a prompt (``bos``: :func:`encode_prompts`). Every prompt would be over
    it: refused as the first row's length (a short question), or, truncated, each losing the
    beginning of its system turn. Call it after :func:`format_prompts` rendered the rows,
    so that a template failing on them names its row."""
    parts = [
        *([f"the chat template of model.path={model_path!r}"] if data.chat_template else []),
        *(
            f"data.{field}={shown(value, 40)}"
            for field, value in (
                ("system_prompt", data.system_prompt),  # set only with the template
                ("prompt_suffix", data.prompt_suffix),
            )
            if value is not None
        ),
    ]
    if not parts:
        return
    try:
        [record] = format_prompts(
            [SourceRecord(prompt="", answer="")],
            ["an empty prompt"],
            tokenizer,
            data,
            model_path=model_path,
        )
    except DataError:  # a template that refuses empty content: the rows rendered
        return
    [ids] = encode_prompts(tokenizer, [record["prompt"]], bos=bos)
    if len(ids) >= data.max_prompt_length:
        one = len(parts) == 1
        named = parts[0] if one else f"{', '.join(parts[:-1])} and {parts[-1]}"
        raise DataError(
            f"{named} {'takes' if one else 'take'} {len(ids)} tokens around an empty prompt, "
            f"leaving none of data.max_prompt_length={data.max_prompt_length} for a prompt's "
            f"own: raise data.max_prompt_length or shorten {'it' if one else 'them'}"
        )


def check_parses(
    tokenizer: PreTrainedTokenizerBase, *, field: str, path: str | None, use: str
) -> None:
    """The chat template of ``tokenizer`` (``field``'s folder ``path``; the one
    ``apply_chat_template`` renders) parses in transformers' own environment, or a
    :class:`DataError` naming the folder, the line and the error: a template's syntax error
    is no prompt's fault, which its first rendering would blame. ``use``: the setting that
    has it read."""
    try:
        _compile_jinja_template(tokenizer.get_chat_template())
    except jinja2.TemplateSyntaxError as exc:
        raise DataError(
            f"the chat template of {field}={path!r} cannot be parsed (line {exc.lineno}: "
            f"{exc.message}); fix it in the folder's tokenizer, or set {use}=false"
        ) from None


def _check_variables(
    tokenizer: PreTrainedTokenizerBase, data: DataConfig, model_path: str | None
) -> None:
    """Each name of ``data.chat_template_kwargs`` is a variable the template reads (a
    misspelt one, ``enable_thinkng``, would change nothing without a word), and none is a
    parameter of ``apply_chat_template``, a special token's variable (``bos_token``: a
    keyword replaces the tokenizer's, which the template writes) or a function of the
    template's environment (``raise_exception``: a keyword replaces it). The template is
    read in transformers' own environment, the one ``apply_chat_template`` renders it in
    (its ``{% generation %}`` block, its functions)."""
    field = "data.chat_template_kwargs"
    source = tokenizer.get_chat_template()
    environment = _compile_jinja_template(source).environment  # it parses: check_parses
    read = jinja2.meta.find_undeclared_variables(environment.parse(source))
    kinds = {
        "a parameter of apply_chat_template": {
            "messages",
            *inspect.signature(tokenizer.apply_chat_template).parameters,
        }
        - {"kwargs"},
        "a special token's variable": set(tokenizer.special_tokens_map),
        "a function transformers gives templates": set(environment.globals),
    }
    reserved = set().union(*kinds.values())
    for name in sorted(data.chat_template_kwargs):
        if kind := next((kind for kind, names in kinds.items() if name in names), None):
            raise DataError(
                f"{field}: {name!r} is {kind}, which verlite and transformers set; a template "
                "variable needs another name"
            )
    if unread := sorted(set(data.chat_template_kwargs) - read):
        raise DataError(
            f"{field}: the chat template of model.path={model_path!r} reads no variable "
            f"{shown(unread, 80)}; it reads {shown(sorted(read - reserved), 200)}"
        )


def _check_system_turn(
    tokenizer: PreTrainedTokenizerBase, data: DataConfig, model_path: str | None
) -> None:
    """A template that refuses a system turn (Gemma's and Mistral's raise "System role not
    supported"), fails on this one, or leaves it out (one that writes only the roles it
    knows), names data.system_prompt: failing on the first row instead would blame a prompt
    that is not the cause, and a left-out system prompt would be lost without a word."""
    where = f"the chat template of model.path={model_path!r}"
    setting = f"data.system_prompt={shown(data.system_prompt, 60)}"
    remedy = (
        "unset data.system_prompt (or put its text in data.prompt_suffix) for a template "
        "without a system role"
    )
    messages = [*_system(data), Message(role="user", content=_QUESTION)]
    failure = f"{where} fails on the system turn {setting}; {remedy}"
    text = _apply(
        tokenizer,
        messages,
        generation_prompt=True,
        failure=failure,
        variables=data.chat_template_kwargs,
    )
    if _left_out(tokenizer, messages, text, failure=failure, variables=data.chat_template_kwargs):
        raise DataError(
            f"{where} leaves the system turn {setting} out: it renders {shown(text, 80)}; {remedy}"
        )


def _system(data: DataConfig) -> list[Message]:
    return (
        [] if data.system_prompt is None else [Message(role="system", content=data.system_prompt)]
    )


def _conversation(location: str, prompt: str | Conversation, data: DataConfig) -> list[Message]:
    """The messages the template renders for a prompt: ``data.system_prompt``'s turn, then a
    text prompt as the user's turn, or the file's conversation; ``data.prompt_suffix`` after
    the last turn's content and a space. A conversation with its own system turn and
    ``data.system_prompt`` set too: a :class:`DataError` (which one would be meant?)."""
    messages = list(conversation_of(prompt))
    if data.system_prompt is not None and any(m["role"] == "system" for m in messages):
        raise DataError(
            f"{location}: the prompt's conversation has a system turn of its own, and "
            f"data.system_prompt={shown(data.system_prompt, 60)} is set too; unset "
            "data.system_prompt to keep the file's, or remove the file's system turns"
        )
    last = messages[-1]
    messages[-1] = Message(role=last["role"], content=_with_suffix(location, last["content"], data))
    return [*_system(data), *messages]


def _with_suffix(location: str, text: str, data: DataConfig) -> str:
    """``text`` and ``data.prompt_suffix`` after a space (unchanged without one). A text that
    already ends with the suffix (a file written with its instruction, as verl's are, run
    with a recipe's suffix) is refused: the instruction would be written twice."""
    if data.prompt_suffix is None:
        return text
    if (written := data.prompt_suffix.strip()) and text.rstrip().endswith(written):
        raise DataError(
            f"{location}: the prompt already ends with data.prompt_suffix="
            f"{shown(data.prompt_suffix, 60)}, which would be written twice; set "
            "data.prompt_suffix=null for a file whose prompts hold it"
        )
    return f"{text} {data.prompt_suffix}"


def _apply(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    generation_prompt: bool,
    failure: str,
    variables: Mapping[str, Any],
) -> str:
    """The template's text of ``messages``, the template reading ``variables`` besides
    (``data.chat_template_kwargs``); when it raises, a :class:`DataError` of ``failure`` and
    the template's message."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in messages],
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **variables,
        )
    # The template is the model author's Jinja code: a syntax error, its own
    # raise_exception (e.g. "system role not supported") or a filter's TypeError.
    except Exception as exc:
        reason = one_line(f"{type(exc).__name__}: {exc}")
        raise DataError(f"{failure}: {shown(reason, 160)}") from None
    # transformers annotates apply_chat_template with everything it can return; with
    # tokenize=False, one conversation renders to a str (_render checks it).
    return cast(str, text)


def _render(
    location: str,
    messages: list[Message],
    tokenizer: PreTrainedTokenizerBase,
    data: DataConfig,
    model_path: str | None,
) -> str:
    """The template's text of a prompt's ``messages``, with the generation prompt; one that
    is empty, or leaves out a system turn of a file's conversation (a template that writes
    only the roles it knows), is refused naming the row."""
    failure = (
        f"{location}: the chat template of model.path={model_path!r} fails on this prompt "
        "(data.chat_template=true)"
    )
    text = _apply(
        tokenizer,
        messages,
        generation_prompt=True,
        failure=failure,
        variables=data.chat_template_kwargs,
    )
    if not isinstance(text, str) or not text.strip():
        raise DataError(
            f"{location}: the chat template of model.path={model_path!r} renders this prompt as "
            f"{shown(text, 60)}, empty or only whitespace (data.chat_template=true); fix the "
            "template or set data.chat_template=false"
        )
    if left_out := _left_out(
        tokenizer, messages, text, failure=failure, variables=data.chat_template_kwargs
    ):
        raise DataError(
            f"{location}: the chat template of model.path={model_path!r} leaves the "
            f"prompt's system turn {shown(left_out['content'], 60)} out: it renders "
            f"{shown(text, 80)}; use a template with a system role, or move the turn's "
            "text into the user's"
        )
    return text


def _left_out(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    text: str,
    *,
    failure: str,
    variables: Mapping[str, Any],
) -> Message | None:
    """The first system turn of ``messages`` that the template's ``text`` of them leaves out
    (one that writes only the roles it knows), or None. A turn is written when its text occurs
    more often in ``text`` than in the rendering with that turn's content blank: what the
    template writes around it and what the other turns hold count in both, so a user turn
    that repeats the system prompt, or a system prompt the template's own text contains,
    cannot pass for it. A conversation without a system turn renders once."""
    for index, message in enumerate(messages):
        written = message["content"].strip()
        if message["role"] != "system" or not written:  # a blank turn loses nothing
            continue
        blank = [*messages[:index], Message(role="system", content=""), *messages[index + 1 :]]
        without = _apply(
            tokenizer, blank, generation_prompt=True, failure=failure, variables=variables
        )
        if text.count(written) <= without.count(written):
            return message
    return None


def reads_chat_template(cfg: RewardModelConfig, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the reward model reads each conversation in its chat template
    (``reward.model.chat_template``; ``tokenizer``: its own): ``auto`` when the tokenizer has
    one. ``true`` with a tokenizer that has none, and a template that does not parse, are
    refused in one line."""
    has_template = tokenizer.chat_template is not None
    if cfg.chat_template is True and not has_template:
        raise ConfigError(
            f"reward.model.chat_template=true, but the tokenizer of reward.model.path="
            f"{cfg.path!r} has no chat template (no chat_template in its "
            "tokenizer_config.json, no chat_template.jinja); save a tokenizer that has one, "
            "or set reward.model.chat_template=false (or auto)"
        )
    reads = has_template if cfg.chat_template == "auto" else cfg.chat_template is True
    if reads:
        check_parses(
            tokenizer, field="reward.model.path", path=cfg.path, use="reward.model.chat_template"
        )
    return reads


def reward_chat_text(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Conversation,
    response: str,
    *,
    rm: RewardModelConfig,
) -> str:
    """The reward model's chat template's text (``tokenizer``'s, of ``rm``'s model) of a
    prompt's ``conversation`` (:func:`~verlite.data.files.record_conversation`) and then
    ``response`` as the assistant's turn; no generation prompt: the conversation ends with
    the response. A template that raises (one without a system role given a system turn)
    is one line naming ``reward.model.chat_template`` and its value."""
    messages = [*conversation, Message(role="assistant", content=response)]
    return _apply(
        tokenizer,
        messages,
        generation_prompt=False,
        failure=f"the chat template of reward.model.path={rm.path!r} fails on a conversation "
        f"of turns {shown([m['role'] for m in messages])} (reward.model.chat_template="
        f"{str(rm.chat_template).lower()}; false scores the prompt and response as plain "
        "text)",
        variables={},
    )


# The stand-in conversation the turn format is read from (none of it reaches a trajectory).
_QUESTION, _CONTENT, _SAMPLE = "Question?", "Answer.", "Observation 42."


@dataclass(frozen=True)
class TurnFormat:
    """How a multi-turn trajectory writes its observations in the chat template: after a
    policy turn, the rest of :attr:`end_ids` (the template's end of an assistant turn, less
    what the turn wrote of it itself: :meth:`unwritten_end`), then
    :meth:`observation_text` tokenized once."""

    tokenizer: PreTrainedTokenizerBase
    role: str  # rollout.multi_turn.observation_role
    head: tuple[Message, ...]  # the stand-in conversation up to the assistant's turn
    before: str  # its text up to the end of the assistant's content
    end_ids: tuple[int, ...]  # the template's end of an assistant turn, tokenized once
    end: str  # ... as text
    model_path: str | None
    variables: Mapping[str, Any]  # data.chat_template_kwargs

    def observation_text(self, observation: str) -> str:
        """The template's text after an assistant turn's end: ``observation`` as a turn of
        :attr:`role`, then the generation prompt of the next assistant turn. An observation
        that holds a special token's text must be written between the text the template
        writes around any observation, where :meth:`observation_ids` finds it."""
        text = self._rendered(observation)
        if self._span(text) is None and holds_special_text(self.tokenizer, [observation])[0]:
            raise DataError(
                f"the chat template of model.path={self.model_path!r} writes other text around "
                f"the observation {shown(observation, 40)} than around others "
                f"(rollout.multi_turn.observation_role={self.role}): it renders "
                f"{shown(text, 80)}; the observation holds a special token's text, which must "
                "be tokenized as text, and its place in the turn cannot be told"
            )
        return text

    def _rendered(self, observation: str) -> str:
        field = f"rollout.multi_turn.observation_role={self.role}"
        text = _observation_turn(
            self.tokenizer,
            self.head,
            self.role,
            observation,
            model_path=self.model_path,
            variables=self.variables,
        )
        if not text.startswith(self.before + self.end):
            raise DataError(
                f"the chat template of model.path={self.model_path!r} rewrites the turns before "
                f"an observation turn ({field}) instead of appending it: a multi-turn "
                "trajectory keeps the tokens it sampled as they are; use a template whose "
                "turns are appended one after another, or data.chat_template=false"
            )
        return text[len(self.before + self.end) :]

    @cached_property
    def _around(self) -> tuple[str, str]:
        """The template's text before and after an observation in :meth:`observation_text`
        (``turn_format`` checked that it writes the observation)."""
        sample = self._rendered(_SAMPLE)
        at = sample.find(_SAMPLE)
        return (sample[:at], sample[at + len(_SAMPLE) :]) if at >= 0 else ("", "")

    def _span(self, text: str) -> tuple[int, int] | None:
        """Where the observation is in :meth:`observation_text`'s ``text``: between the text
        the template writes around any observation; None if the template wrote other text
        around this one. A chat reward model finds a response's place the same way
        (``workers.reward_model._between``) where the template writes the same text around
        it, and otherwise widens it to all that differs: a response is the policy's own
        sample, which a run cannot refuse, and a wider place there only reads the template's
        moved text as characters in the reward model's input. Here an observation holding a
        special token's text is refused instead (:meth:`observation_text`): its tokens join
        the trajectory the policy samples and trains on, where the template's turn markers
        must stay its special tokens, and an environment is user code whose contract a run
        checks."""
        before, after = self._around
        if text.startswith(before) and text.endswith(after) and len(text) >= len(before + after):
            return len(before), len(text) - len(after)
        return None

    def observation_ids(self, text: str) -> list[int]:
        """The tokens of :meth:`observation_text`'s ``text`` as they follow the template's end
        of an assistant turn: tokenized after that end, as the template's whole conversation
        is (a SentencePiece tokenizer that marks a text's first word, Metaspace's
        ``prepend_scheme="first"``, marked the observation's alone: ``▁[INST]`` where the
        conversation has ``[INST]``); alone where the end's tokens would not stay apart. The
        observation's own text is the environment's writing (``encode_written``): a special
        token's text in it is its characters, so it cannot close the observation's turn or
        open an assistant's; the template's special tokens around it are the tokenizer's."""
        start, stop = self._span(text) or (0, 0)  # none: it holds no special token's text
        ids = encode_written(
            self.tokenizer, self.end + text, len(self.end) + start, len(self.end) + stop
        )
        if self.end and ids[: len(self.end_ids)] == list(self.end_ids):
            return ids[len(self.end_ids) :]
        return encode_written(self.tokenizer, text, start, stop)

    def unwritten_end(self, turn: list[int]) -> list[int]:
        """The tokens of the template's end of an assistant turn that the policy's ``turn``
        did not end with: all of them, or those after the ones it sampled itself (a turn that
        stops on the template's end token keeps it as sampled, written once)."""
        for k in range(min(len(self.end_ids), len(turn)), 0, -1):
            if turn[-k:] == list(self.end_ids[:k]):
                return list(self.end_ids[k:])
        return list(self.end_ids)


def _observation_turn(
    tokenizer: PreTrainedTokenizerBase,
    head: Sequence[Message],
    role: str,
    observation: str,
    *,
    model_path: str | None,
    variables: Mapping[str, Any],
) -> str:
    """The template's text of the stand-in conversation ``head``, an assistant's turn and
    ``observation`` as a turn of ``role``, with the next generation prompt."""
    messages = [
        *head,
        Message(role="assistant", content=_CONTENT),
        Message(role=role, content=observation),
    ]
    return _apply(
        tokenizer,
        messages,
        generation_prompt=True,
        failure=f"the chat template of model.path={model_path!r} fails on an observation turn "
        f"(rollout.multi_turn.observation_role={role}; a template without a tool role: set it "
        "to user)",
        variables=variables,
    )


def common_start(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` begin with alike."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _shared_start(tokenizer: PreTrainedTokenizerBase, a: str, b: str) -> str:
    """The longest text ``a`` and ``b`` both begin with, not cut inside a special token's
    text: ``'<|end|>\\n<|endoftext|>'`` and ``'<|end|>\\n<|user|>'`` share ``'<|end|>\\n'``."""
    n = common_start(a, b)
    while cut := [
        at
        for text in special_tokens(tokenizer)
        for s in (a, b)
        if 0 <= (at := s.find(text, max(0, n - len(text) + 1))) < n
    ]:
        n = min(cut)
    return a[:n]


def turn_format(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> TurnFormat | None:
    """The turn format of a multi-turn run through a chat template (``rollout.multi_turn.env``
    with ``data.chat_template``), None otherwise. A template that does not write an
    assistant's content right after its generation prompt, leaves an observation out, or
    does not end it with the next generation prompt: a :class:`DataError` naming the
    setting."""
    if not cfg.data.chat_template or cfg.rollout.multi_turn.env is None:
        return None
    where = f"the chat template of model.path={cfg.model.path!r}"
    head = [*_system(cfg.data), Message(role="user", content=_QUESTION)]
    variables = cfg.data.chat_template_kwargs
    apply = partial(_apply, tokenizer, variables=variables)
    prompt = apply(head, generation_prompt=True, failure=f"{where} fails")
    # What the generation prompt adds: a template may end a conversation without one
    # otherwise (Phi-3's writes its EOS after the last turn).
    unprompted = apply(head, generation_prompt=False, failure=f"{where} fails")
    opening = prompt[len(_shared_start(tokenizer, prompt, unprompted)) :]
    closed = apply(
        [*head, Message(role="assistant", content=_CONTENT)],
        generation_prompt=False,
        failure=f"{where} fails on an assistant turn",
    )
    before = prompt + _CONTENT
    if not closed.startswith(before):
        raise DataError(
            f"{where} does not write an assistant's turn as its generation prompt followed by "
            f"the content (it renders {shown(closed[len(prompt) - len(opening) :], 80)}); a "
            "multi-turn trajectory continues the generation prompt with the sampled tokens "
            "(data.chat_template=true with rollout.multi_turn.env); use a template that does"
        )
    # The end of an assistant's turn: what the template writes after the content both where
    # the conversation ends and where an observation's turn follows (Phi-3's ends the
    # conversation with its EOS after <|end|>). One that rewrites the assistant's turn when
    # an observation follows is refused below (TurnFormat._rendered).
    followed = _observation_turn(
        tokenizer,
        head,
        cfg.rollout.multi_turn.observation_role,
        _SAMPLE,
        model_path=cfg.model.path,
        variables=variables,
    )
    end = closed[len(before) :]
    if followed.startswith(before):
        end = _shared_start(tokenizer, end, followed[len(before) :])
    turns = TurnFormat(
        tokenizer,
        cfg.rollout.multi_turn.observation_role,
        tuple(head),
        before,
        tuple(tokenizer.encode(end, add_special_tokens=False)),
        end,
        cfg.model.path,
        variables,
    )
    sample = turns.observation_text(_SAMPLE)
    field = f"rollout.multi_turn.observation_role={turns.role}"
    if _SAMPLE not in sample:
        raise DataError(
            f"{where} leaves an observation turn out ({field}): it renders "
            f"{shown(sample, 80)} for the observation {_SAMPLE!r}; use a role the template "
            "writes (user, for a template without a tool role)"
        )
    if not sample.endswith(opening):
        raise DataError(
            f"{where} does not end an observation turn ({field}) with the assistant's "
            f"generation prompt {shown(opening, 40)}: it renders {shown(sample, 80)}"
        )
    return turns
