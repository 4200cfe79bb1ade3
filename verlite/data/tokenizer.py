"""Tokenizers: verlite's character-level task tokenizer, loading a model's own, and prompt encoding.

The task tokenizer is built in code (nothing is downloaded): one token per character of a
small alphabet, so the built-in model's ``vocab_size`` is ``len(tokenizer)``.
"""

from __future__ import annotations

import re
import string
import weakref
from collections.abc import Collection, Sequence
from typing import cast

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import WordLevel
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from verlite.config import ConfigError
from verlite.data.tasks import TASK_ALPHABET
from verlite.errors import one_line, shown

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3, in this order
# Digits, lowercase letters, space, newline and the symbols of the tasks and of simple math prompts.
CHARACTERS = string.digits + string.ascii_lowercase + " \n" + "+-*/=<>:#.,?!()'\"$%_"


def build_task_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over ``characters`` (``<pad>`` is id 0).

    Calling it on text prepends ``<bos>`` (like most causal-LM tokenizers); other characters
    become ``<unk>``. Decoding concatenates characters.
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *characters))}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    # Oniguruma has no DOTALL flag; [\s\S] matches every character, newline included.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves its __init__ unannotated
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        # The default clean-up rewrites " ." and " ," and would break the character round trip.
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(model_path: str | None, *, task: str | None = None) -> PreTrainedTokenizerBase:
    """The model directory's own tokenizer (local files only), with a pad token guaranteed
    (the eos token when it defines none); without a model path, the built-in character
    tokenizer: over the tasks' small alphabet for a synthetic task, else over
    :data:`CHARACTERS` for prompt files."""
    if model_path is None:
        return build_task_tokenizer(TASK_ALPHABET if task is not None else CHARACTERS)
    tokenizer = _read_tokenizer(model_path, field="model.path", whose="the model's")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"the tokenizer in {model_path!r} has neither a pad nor an eos token; "
                "prompts cannot be padded (add a pad_token to its tokenizer_config.json)"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_reward_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The reward model's own tokenizer (``reward.model.path``), read as the policy's is."""
    return _read_tokenizer(path, field="reward.model.path", whose="the reward model's")


def _read_tokenizer(path: str, *, field: str, whose: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in the folder ``path`` (the setting ``field``; local files only),
    or one line saying that none loads from it: no tokenizer files, ones it cannot build
    from, a tokenizer.json the installed tokenizers cannot read (one a newer version saved:
    a bare Exception, "data did not match any variant of untagged enum ModelWrapper"), or
    the tokenizer of special tokens alone that transformers builds for a Qwen2 or GPT-2
    folder without tokenizer files (rather than refusing it), which would encode every text
    to nothing."""
    save = f"save {whose} tokenizer into the folder (tokenizer.save_pretrained)"
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ConfigError(
            f"{field}={path!r}: no tokenizer loads from it: {shown(one_line(exc), 160)}; {save}"
        ) from None
    if len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise ConfigError(
            f"{field}={path!r}: no tokenizer loads from it: the tokenizer built from the folder "
            f"has only its {len(tokenizer)} special token(s), no vocabulary (no tokenizer "
            f"files); {save}"
        )
    template = tokenizer.chat_template  # text, or named texts ({"default": ..., "tool_use": ...})
    named = template.values() if isinstance(template, dict) else [template]
    if template is not None and not all(isinstance(text, str) for text in named):
        raise ConfigError(
            f"{field}={path!r}: its tokenizer's chat_template is {shown(template, 60)}, not a "
            f"template's text (nor named texts); {save}"
        )
    return tokenizer


def response_text(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], stops: Collection[int] = ()
) -> str:
    """What a reward function or an environment reads of sampled tokens: the text up to the
    token that ended them, the end-of-sequence token or one of ``stops`` (the other tokens
    that end a response: ``models.generation_ends.response_stop_ids``, an instruct model's end
    of turn), other special tokens shown (as ``<pad>`` and the like), so that a policy can
    neither end a response by emitting them instead nor hide tokens."""
    ids = list(ids)
    if ids and (ids[-1] == tokenizer.eos_token_id or ids[-1] in stops):
        ids = ids[:-1]
    size = len(tokenizer)
    if all(i < size for i in ids):
        return _decoded(tokenizer, ids)
    # A model with more rows than its tokenizer has tokens (model.vocab_size, or a real
    # model's padded vocabulary) may sample ids the tokenizer does not know: decoding skips
    # them silently, which would hide them. Each is shown as the unknown token instead.
    pieces, known = [], []
    for i in ids:
        if i < size:
            known.append(i)
        else:
            pieces += [
                _decoded(tokenizer, known),
                tokenizer.unk_token or UNK,
            ]
            known = []
    pieces.append(_decoded(tokenizer, known))
    return "".join(pieces)


def _decoded(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of ``ids``, special tokens shown. transformers annotates ``decode`` as
    ``str | list[str]``: a list of sequences decodes to a list, one sequence to a str."""
    return cast(str, tokenizer.decode(ids, skip_special_tokens=False))


def special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, AddedToken]:
    """The tokenizer's special tokens (``<|im_end|>``, ``<eos>``) by their text: the texts it
    reads as the token wherever they occur, unless asked to split them."""
    return {
        t.content: t for t in tokenizer.added_tokens_decoder.values() if t.special and t.content
    }


def encode_written(
    tokenizer: PreTrainedTokenizerBase, text: str, start: int = 0, stop: int | None = None
) -> list[int]:
    """The token ids of ``text`` (no BOS or EOS added) in which ``text[start:stop]`` is
    someone else's writing, such as an environment's observation: a special token's text
    there (``<|im_end|>``, ``<|im_start|>assistant``, the EOS) is encoded as its characters,
    never as the special token, so that it cannot end a turn, open one or end the sequence.
    Outside the span, special tokens are the tokenizer's (a chat template's own turns).

    A tokenizer splits a text at its special tokens before anything else, so the text up to
    the last special token before the span and from the first one after it encode as they
    do in the whole text (with the whitespace a token that strips it takes: Phi-3's
    ``<|user|>`` takes the newline after it); the stretch between them is encoded with
    ``split_special_tokens``, as it follows that special token (:func:`_as_text`). A text
    whose span holds no special token's text encodes as it always did."""
    stop = len(text) if stop is None else stop
    if not holds_special_text(tokenizer, [text[start:stop]])[0]:
        return list(tokenizer.encode(text, add_special_tokens=False))
    specials = special_tokens(tokenizer)
    lo, hi = 0, len(text)
    for content, token in specials.items():
        if (at := text.rfind(content, 0, start)) >= 0:
            end = at + len(content)
            if token.rstrip:
                end = len(text) - len(text[end:].lstrip())
            lo = max(lo, end)
        if (at := text.find(content, stop)) >= 0:
            hi = min(hi, len(text[:at].rstrip()) if token.lstrip else at)
    hi = max(hi, lo)
    pieces = [
        tokenizer.encode(text[:lo], add_special_tokens=False) if lo else [],
        _as_text(tokenizer, text[lo:hi], first=not lo),
        tokenizer.encode(text[hi:], add_special_tokens=False) if hi < len(text) else [],
    ]
    return [int(i) for piece in pieces for i in piece]


def holds_special_text(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> list[bool]:
    """Whether each of ``texts`` holds the text of one of ``tokenizer``'s special tokens
    (found in one pass a text: Llama-3's tokenizer has 256 of them)."""
    specials = special_tokens(tokenizer)
    if not specials:  # (an empty pattern would match every text)
        return [False] * len(texts)
    found = re.compile("|".join(map(re.escape, specials)))
    return [found.search(text) is not None for text in texts]


def with_special_tokens(
    tokenizer: PreTrainedTokenizerBase, text: str, ids: Sequence[int]
) -> list[int]:
    """``ids`` (tokens of ``text``) framed by the special tokens ``tokenizer`` adds around
    ``text`` when it encodes it (its post-processor's: a BOS, an EOS)."""
    bare = tokenizer.encode(text, add_special_tokens=False)
    framed = tokenizer.encode(text, add_special_tokens=True)
    at = next(i for i in range(len(framed) - len(bare) + 1) if framed[i : i + len(bare)] == bare)
    return [*framed[:at], *ids, *framed[at + len(bare) :]]


# Marks the start of a text that follows a special token in :func:`_as_text`; a non-special
# added token of a copy of the tokenizer, so that it stays a token of its own.
_AFTER_SPECIAL = "\U0010fffd<verlite: after a special token>\U0010fffd"
_TEXT_READERS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, Tokenizer] = (
    weakref.WeakKeyDictionary()
)


def _as_text(tokenizer: PreTrainedTokenizerBase, text: str, *, first: bool) -> list[int]:
    """The ids of ``text`` with its special tokens' texts as characters, as the tokenizer
    encodes it at the start of a whole text (``first``) or after a special token. The two
    differ for a tokenizer that marks a text's first word (a SentencePiece conversion's
    Metaspace ``prepend_scheme="first"``: Mistral's): after the special token ``</s>``,
    ``[INST]`` is ``[`` ``INST]``; alone, it is ``▁[INST]``, which reads back with a space.
    Encoded after a marker token, ``text`` is not the whole text's start."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if first or not isinstance(backend, Tokenizer):
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    reader = _TEXT_READERS.get(tokenizer)
    if reader is None:  # a copy, once per tokenizer: the run's own is left as it is
        reader = Tokenizer.from_str(backend.to_str())
        reader.no_truncation()  # as the tokenizer encodes when asked for no truncation
        reader.no_padding()
        reader.add_tokens([AddedToken(_AFTER_SPECIAL, special=False, normalized=False)])
        reader.encode_special_tokens = True
        _TEXT_READERS[tokenizer] = reader
    marker = reader.token_to_id(_AFTER_SPECIAL)
    ids = reader.encode(_AFTER_SPECIAL + text, add_special_tokens=False).ids
    if ids[:1] != [marker] or marker in ids[1:]:  # the marker's text in ``text`` itself
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    return list(ids[1:])


# The text :func:`tokens_after_text` tokenizes a text after: a digit, which tokenizers keep
# apart from punctuation (their pre-tokenizers split digits off) and special tokens.
_TEXT_BEFORE = "0"


def tokens_after_text(
    tokenizer: PreTrainedTokenizerBase, text: str, *, written: bool = False
) -> list[int]:
    """The token ids of ``text`` as it follows other text, as a policy's turn ends with it
    (``rollout.multi_turn.turn_stop``) or an observation follows the turn: a tokenizer that
    marks a text's first word (SentencePiece's: Llama-2's, Mistral's) makes ``▁?`` of ``?``
    alone, the question mark after a space, where a turn written ``cat?`` ends with ``?``.
    Alone where the text before it would not keep its tokens. ``written``: ``text`` is
    someone else's writing, its special tokens' texts encoded as characters
    (:func:`encode_written`)."""
    before = tokenizer.encode(_TEXT_BEFORE, add_special_tokens=False)
    at = len(_TEXT_BEFORE)  # where ``text`` starts; its span is empty unless it is written
    ids = encode_written(tokenizer, _TEXT_BEFORE + text, at, None if written else at)
    if ids[: len(before)] != before:
        ids = encode_written(tokenizer, text, 0, None if written else 0)
        before = []
    return [int(i) for i in ids[len(before) :]]


def continuation_text(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Sequence[int],
    response: Sequence[int],
    stops: Collection[int] = (),
) -> str:
    """:func:`response_text` of ``response`` (ended by EOS or one of ``stops``) as it
    continues ``prompt``'s text. A tokenizer
    whose decoder drops a sequence's leading space (SentencePiece's ``Metaspace``: Llama-2's,
    Mistral's) drops, from a response decoded alone, the space between the prompt and its
    first word: decoded after the prompt, the response keeps it. Decoded alone where the
    prompt's text is not a prefix of the two decoded together (a character cut between them)."""
    prefix = _decoded(tokenizer, list(prompt))
    whole = response_text(tokenizer, [*prompt, *response], stops)
    if prompt and whole.startswith(prefix):
        return whole[len(prefix) :]
    return response_text(tokenizer, response, stops)


def unknown_characters(tokenizer: PreTrainedTokenizerBase, text: str) -> str:
    """The characters of ``text`` that ``tokenizer`` maps to its unknown token, each once,
    sorted (each looked up on its own: a long text has few distinct characters)."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return ""
    return "".join(
        sorted(c for c in set(text) if unk in tokenizer.encode(c, add_special_tokens=False))
    )


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], *, bos: bool = True
) -> list[list[int]]:
    """Token ids of each prompt: BOS (when ``bos`` and the tokenizer has one) then the prompt,
    no EOS.

    BOS is added here rather than by the tokenizer's template so that every tokenizer, with
    or without a post-processor, gives the same layout. ``bos=False`` is for text a chat
    template rendered (``data.chat_template``): the template writes the model's special
    tokens itself, as ``apply_chat_template`` tokenizes it.
    """
    if not prompts:
        return []
    encoded = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    bos_ids = [] if not bos or tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return [bos_ids + ids for ids in encoded]
