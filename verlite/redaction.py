"""What no log, message, config record, metric or job command line may show: credentials.
The secret-named config fields, ``user:pass@`` and credential-named query parameters in
URLs, authorization headers and bearer tokens, credentials written as settings in plain text
(``api_key=...``, ``X-Api-Key: ...``, ``"password": "..."``, ``--token ...``), the values of
credential-named environment variables and the credentials verlite reads itself (a remote
verifier's token, those of a config's URLs: registered here when they are read); the one
owner of those rules (:func:`redact_text`), used by every sink: the process's stdout and
stderr and log records once :func:`redacted_output` is on (the CLI turns it on for every
command, and every Ray worker for its process: :func:`redact_process_output`), the CLI's
error line, the metrics and config records, the job commands, :func:`verlite.errors.shown`,
the remote verifier's messages and what a worker raises (:func:`redact_exception`)."""

from __future__ import annotations

import contextlib
import functools
import html
import inspect
import io
import json
import logging
import os
import pickle
import re
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, TextIO
from urllib.parse import quote, unquote, unquote_plus

# The words that make a name (a config key, an environment variable, a URL's query parameter,
# an HTTP header) name a credential, as whole parts of it (see credential_named).
# A part that is one of these, or ends in one (PGPASSWORD, APITOKEN, clientsecret), plural or
# numbered or both (passwords, DB_PASSWORD2, TOKEN_2 is two parts):
_CREDENTIAL_WORDS = "token|secret|password|passwd|passphrase|credential|apikey|cookie|bearer|jwt"
_CREDENTIAL_PART = re.compile(rf"\w*(?:{_CREDENTIAL_WORDS})s?\d*|sig|signature")
# A tokenizer's special tokens (pad_token, eos_token, additional_special_tokens,
# added_tokens_decoder): a token of its vocabulary (``<|endoftext|>``), not a credential.
_VOCABULARY_TOKEN = re.compile(r"(?:bos|eos|unk|sep|pad|cls|mask|special|added) tokens?")
# A key, a credential when it is the whole name (?key=; not keys, a list of them: verlite
# metrics --keys) or a kind of secret key (api_key, AWS_SECRET_ACCESS_KEY, apiKey, X-Api-Key,
# secretkey), never a mapping's key (data.prompt_key, sort_key); in a URL's query, any key
# is (?subscription-key=, ?consumer_key=, ?keys=).
_KEY_KINDS = (
    "api|access|secret|private|account|client|auth|signing|subscription|session|consumer"
    "|encryption|master|ssh|hmac|shared|license|service"
)
_KEY_PART = re.compile(r"keys?\d*")
_ONE_KEY_PART = re.compile(r"key\d*")
_KIND_KEY_PART = re.compile(rf"(?:{_KEY_KINDS})keys?\d*")
_KIND_PART = re.compile(_KEY_KINDS)
# MYSQL_PWD's pwd, not as the first part: PWD and OLDPWD are the working folders; DB_PASS's
# pass as the last part, not ?pass_at_k= (pass@k).
_PWD = "pwd"
_PASS = re.compile(r"pass\d*")
# Authorization, a credential as the name's last word (?auth=, Authorization), not as a
# qualifier (auth_type, reward.remote.auth_env, RAY_AUTH_MODE).
_AUTH_PART = re.compile(r"auth|authorization")
# A last part that makes the name one of where a credential is kept, not of the credential.
_REFERENCE_PART = re.compile(r"path|file|filename|dir|env")
# A last part that makes the name an exception's (KeyError, InvalidTokenError), whose
# message follows it on a traceback's last line, not a credential's.
_EXCEPTION_PART = re.compile(r"error|exception|warning")
# A part that makes the credential word before it name a measure of it, not it: a size
# counted in tokens (actor.max_token_len_per_worker, whose error line showed a mistyped
# size masked), a password's length.
_MEASURE_PART = re.compile(r"len|length")
# A part that makes the key before it name the key's identifier, which names a key as a
# user name does an account (AWS_ACCESS_KEY_ID, AWSAccessKeyId, a KMS key_id), not the key.
# A key's only: a token's ids are its vocabulary's (rollout.stop_token_ids, read as a
# credential's name for any value but numbers), Vault's secret_id is a credential.
_IDENTIFIER_PART = re.compile(r"ids?")
# The parts of a name: split at '_', '-', '.' and the other non-word characters, and where
# camelCase starts a word (apiKey, XApiKey, AWSAccessKeyId).
_PART_BOUNDARY = re.compile(r"[\W_]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
# Counts of tokens (model.logits_chunk_tokens, ?maxTokens=) and token ids
# (rollout.stop_token_ids), by the name's parts (:data:`_PART_BOUNDARY`) joined by spaces:
# integers under such names are shown as they are (a credential-named name's other values
# are masked like any value: ?api_tokens= holds credentials).
_NUMBERS_NAME = re.compile(r".+ tokens|(?:.+ )?token ids?")
# Such numbers as an override writes them: 512, [], [3, 5]; or a list as a message's setting
# is read (:data:`_SETTING_VALUE`, up to a ``,`` or ``]``): ``[99999999`` of
# ``rollout.stop_token_ids=[99999999]: ... outside the model's vocabulary``.
_NUMBERS_TEXT = re.compile(r"\d+|\[\s*(\d+\s*(,\s*\d+\s*)*)?\]?")
# Shorter values cannot be masked without garbling messages (a 1-character token is in most
# words): a credential verlite reads is refused below this length (see register_secret), and
# shorter values of credential-named variables are switches (``HF_HUB_DISABLE_IMPLICIT_TOKEN=1``).
MIN_SECRET_LENGTH = 8
# A value cut off at the end of a text (a reply read up to a size): its first characters, when
# at least this many, are masked as the whole value is.
_MIN_FRAGMENT = 4
MASK = "***"
# user:password@ in a URL such as an MLflow tracking URI or a Ray address.
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")

_registered: set[str] = set()
# What :func:`redact_process_output` turned on, kept for the life of the process.
_process_output: contextlib.ExitStack | None = None


def _name_parts(name: str) -> list[str]:
    """``name``'s parts in lower case (:data:`_PART_BOUNDARY`): ``X-Amz-Signature`` is
    ``x amz signature``, ``maxTokens`` is ``max tokens``."""
    return [part.lower() for part in _PART_BOUNDARY.split(name) if part]


# Cached: every read of the environment asks it of each name there
# (:func:`secrets_in_environment`, again whenever the environment changes), which parsed
# them all again each time (about 1 ms in an environment of 135 variables).
@functools.lru_cache(maxsize=4096)
def credential_named(name: str, *, query: bool = False) -> bool:
    """Whether ``name`` (a config key, an environment variable, a URL's query parameter, an
    HTTP header) names a credential, by its parts (:data:`_PART_BOUNDARY`: ``X-Amz-Signature``
    is ``x amz signature``, ``apiKey`` is ``api key``), never by a substring: ``?author=``
    holds "auth" and ``?design=`` "sig", but neither names a credential. A credential name
    has a part that is (or, glued, ends in) a credential word (``token``, ``access_token``,
    ``secret``, ``password``, ``PGPASSWORD``, ``credentials``, ``apikey``), ``sig`` or
    ``signature``; a key of a credential kind (``api_key``, ``X-Api-Key``,
    ``AWS_SECRET_ACCESS_KEY``; ``key`` alone, not ``keys``, a list of them; any key of a
    URL's query: ``query``); or ``auth``/``authorization`` as its last part. A tokenizer's
    special token (``pad_token``, ``eos_token``, ``additional_special_tokens``) is a token
    of its vocabulary (``<|endoftext|>``), which messages and records show.

    A name whose last part is ``path``, ``file``, ``dir`` or ``env`` (``HF_TOKEN_PATH``,
    ``POSTGRES_PASSWORD_FILE``, ``reward.remote.auth_env``) names where a credential is kept
    (a file, an environment variable), not the credential: its value is a path or a name,
    which messages may show and a job may carry; the file or variable it names is never
    read into a message (a token verlite reads from one is registered, :func:`register_secret`).
    One whose last part is ``error``, ``exception`` or ``warning`` names an exception
    (``KeyError``, ``InvalidTokenError``), whose message follows it on a traceback's last line.
    A credential word followed by ``len`` or ``length`` names a measure of it
    (``max_token_len_per_worker``, a size counted in tokens; ``PASSWORD_LENGTH``), and a
    key followed by ``id`` or ``ids`` its identifier (``AWS_ACCESS_KEY_ID``, ``key_id``):
    not the credential, unless another part names one (``secret_key_id``)."""
    parts = _name_parts(name)
    if not parts or _REFERENCE_PART.fullmatch(parts[-1]) or _EXCEPTION_PART.fullmatch(parts[-1]):
        return False
    for index, part in enumerate(parts):
        before = parts[index - 1] if index else ""
        after = parts[index + 1] if index + 1 < len(parts) else ""
        if _MEASURE_PART.fullmatch(after):
            continue  # a measure of it
        if _CREDENTIAL_PART.fullmatch(part) and not (
            before and _VOCABULARY_TOKEN.fullmatch(f"{before} {part}")
        ):
            return True
        key = _KIND_KEY_PART.fullmatch(part) or (
            _KEY_PART.fullmatch(part)
            and (
                query or (_KIND_PART.fullmatch(before) if index else _ONE_KEY_PART.fullmatch(part))
            )
        )
        if key and not _IDENTIFIER_PART.fullmatch(after):
            return True
    return _PWD in parts[1:] or bool(_PASS.fullmatch(parts[-1]) or _AUTH_PART.fullmatch(parts[-1]))


def register_secret(value: str) -> None:
    """Mask ``value`` (and its quoted, escaped and URL-encoded forms) in every text
    :func:`redact_text` sees from now on in this process: called where verlite reads a
    credential, whatever the variable holding it is called. ``value`` must be at least
    :data:`MIN_SECRET_LENGTH` characters (the reader refuses a shorter one to the user)."""
    if len(value) < MIN_SECRET_LENGTH:
        raise ValueError(f"a secret shorter than {MIN_SECRET_LENGTH} characters cannot be masked")
    _registered.add(value)


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without credentials: secret-named fields masked (but counts of tokens), and
    every text value as :func:`redact_text` leaves it."""
    clean: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            clean[key] = redact_config(value)
        elif holds_credential(str(key), value):
            clean[key] = MASK
        else:
            clean[key] = redact_text(value, url_secrets(value)) if isinstance(value, str) else value
    return clean


def holds_credential(key: str, value: Any, *, query: bool = False) -> bool:
    """Whether a config ``value`` under ``key`` (its last name), or with ``query`` a URL's
    query parameter ``key=value``, is a credential, which no record or message shows: any
    value but null of a secret-named key (:func:`credential_named`), but counts of tokens
    and token ids (``max_tokens: 512``, ``?max_tokens=512``)."""
    return (
        credential_named(key, query=query) and value is not None and not _token_numbers(key, value)
    )


def _token_numbers(key: str, value: Any) -> bool:
    """Whether ``value`` (a config value, or an override's text) under ``key`` is a count of
    tokens or a list of token ids: numbers, not a credential."""
    if not _NUMBERS_NAME.fullmatch(" ".join(_name_parts(key))):
        return False
    if isinstance(value, str):
        return bool(_NUMBERS_TEXT.fullmatch(value.strip()))
    items = value if isinstance(value, list) else [value]
    return all(type(item) is int for item in items)


def carries_secret(key: str, value: str) -> bool:
    """Whether a config setting holds a credential: a secret-named key (but for counts of
    tokens and token ids, and switches: values shorter than :data:`MIN_SECRET_LENGTH`, such
    as ``TOKENIZERS_PARALLELISM=false``), a URL with ``user:pass@`` or a credential in its
    query (:func:`secret_query_names`), or a known secret's value."""
    return bool(value) and (
        _setting_holds_credential(key, value)
        or bool(_URL_CREDENTIALS.search(value))
        or ("://" in value and bool(secret_query_names(value)))
        or redact_text(value) != value
    )


def _setting_holds_credential(key: str, value: str) -> bool:
    """Whether the text ``value`` set under ``key`` (a command line's override, a setting
    written in a message) is a credential: :func:`holds_credential`'s rule, but for switches
    (values shorter than :data:`MIN_SECRET_LENGTH`: ``TOKENIZERS_PARALLELISM=false``,
    ``use_auth_token=True``, ``token: str``)."""
    return len(value) >= MIN_SECRET_LENGTH and holds_credential(key, value)


def secret_query_names(url: str) -> list[str]:
    """The names of ``url``'s query parameters that hold a credential (:func:`holds_credential`:
    ``?api_key=``, ``?token=``, ``?X-Amz-Signature=``, ``?sig=``; not ``?author=`` nor
    ``?max_tokens=512``)."""
    return [name for name, _ in _secret_query(url)]


def _secret_query(url: str) -> list[tuple[str, str]]:
    """``url``'s query parameters that hold a credential (:func:`secret_query_names`), as
    their names decoded and their values as written."""
    found = []
    # What follows the first "?" up to a "#", not read by urlsplit, which refuses a URL with
    # a "]" in its password (a credential there is still one).
    query = url.partition("?")[2].partition("#")[0]
    for parameter in query.split("&"):
        name, _, value = parameter.partition("=")
        if holds_credential(name := unquote_plus(name), unquote_plus(value), query=True):
            found.append((name, value))
    return found


def url_secrets(url: str) -> list[str]:
    """The credentials ``url`` holds, as values, written and decoded: the password of its
    ``user:password@`` and the values of its query parameters that hold one
    (:func:`secret_query_names`); those of at least :data:`MIN_SECRET_LENGTH` characters.
    Known, a value is masked whole wherever it appears (:func:`redact_text`'s ``secrets``,
    :func:`register_secret`), where the patterns, which cannot know where an unknown one
    ends, end it at a ``]``, ``}`` or ``, `` (:data:`_QUERY_VALUE_CHARACTER`)."""
    passwords = [info[:-1].partition(":")[2] for info in _URL_CREDENTIALS.findall(url)]
    values = [value for _, value in _secret_query(url)]
    forms = {*passwords, *map(unquote, passwords), *values, *map(unquote_plus, values)}
    return sorted(form for form in forms if len(form) >= MIN_SECRET_LENGTH)


def redact_url(text: str) -> str:
    """``text`` with the ``user:pass@`` of any URL in it masked."""
    return _URL_CREDENTIALS.sub(MASK + "@", text)


# An HTTP authorization header or bearer credential quoted in a message (a server that
# echoes the request back in its error: as a header line, or its headers as a JSON object
# or a Python dict, whose value opens with a quote, escaped within a JSON string).
# A credential ends at a space, a quote or a backslash (a message quotes the text that holds
# it; a JSON string escapes the quote); one masked already is left as it is: a message is
# masked more than once on its way out. ``X-Ray-Authorization`` is masked by its last word
# (the pattern kept to a literal start, which the engine finds fast in a long line).
_CREDENTIAL = r"(?!\*\*\*)[^\s'\"\\]+"
_AUTH_HEADER = re.compile(
    rf"(?i)(authorization\W{{0,3}}\s*[:=]\s*(?:\\?[\"'])?)"
    rf"{_CREDENTIAL}(?:\s+[^\s'\"\\]+)?"
)
_BEARER = re.compile(rf"(?i)(bearer\s+){_CREDENTIAL}")
# A URL's query parameter (``?name=value``, ``&name=value``; ``&amp;name=`` as HTML writes
# it), its value up to the next parameter, the fragment, a space, a quote, a tag, a
# closing parenthesis, bracket or brace (a message quotes or encloses the URL: a Python
# list's or dict's repr, unquoted text's ``[url]``, ``{url: ...}``), a comma that no value
# character follows (one that separates the URL from what comes next: ``[url, x]``; a comma
# within the value, ``?token=ab,cd``, is the value's) or a backslash (a JSON line's escaped
# quote, kept whole): masked when it holds a credential (:func:`secret_query_names`'s rule:
# ``?api_key=``, ``&sig=``, not ``&max_tokens=512``).
_QUERY_VALUE_CHARACTER = r"[^&;#\s'\"`<>)\]},\\]"
_QUERY_PARAMETER = re.compile(
    rf"([?&;]([^?&;=#\s'\"`<>()\\]+)=)"
    rf"((?!\*\*\*){_QUERY_VALUE_CHARACTER}+(?:,{_QUERY_VALUE_CHARACTER}+)*)"
)


def _mask_query(match: re.Match[str]) -> str:
    held = holds_credential(unquote_plus(match[2]), unquote_plus(match[3]), query=True)
    return match[1] + MASK if held else match[0]


# A setting written in plain text, outside a URL's query (a header dump, a log line, an
# exception's message, a printed dict or JSON, a command line): ``name=value``,
# ``name: value``, its name and value quoted (``"name": "value"``, as JSON writes it, escaped
# within a JSON string too; ``'name': 'value'`` and ``name='value'``, as Python's repr
# writes a dict and a call; spaces around ``=`` only before a quoted value, so that code's
# ``token = get_token()`` in a traceback stays), and a command line's ``--name=value`` and
# ``--name value`` (a value that starts with no ``-``). A name is letters, digits, ``_``,
# ``.`` and ``-``, starting with a letter or ``_``, following none of those nor a ``/``
# (``multiturn/observation_tokens/mean`` names a metric, not a setting).
# The names are found from their separators, in the text reversed (``_SETTING_NAME`` reads
# the separator, the spaces before it, the name's closing quote, the name backwards and its
# opening quote): the engine skips to a ``:`` or ``=`` in its own loop, where a pattern that
# starts with a name is tried at every character (masking a typical console line took twice
# as long with one, a metrics line three times). A flag's name (``_FLAG_NAME``) starts with
# ``--``, which the engine skips to as well.
_SETTING_NAME = re.compile(
    r"""(?P<separator>[:=])(?P<gap>[ \t]*+)(?P<quote>["']\\?|)(?P<name>[\w.\-]++)"""
    r"""(?<=[A-Za-z_])(?P=quote)(?!/)"""
)
_FLAG_NAME = re.compile(r"--(?<![\w.\-/]--)(?P<name>[A-Za-z_][\w.\-]*+)(?:=|(?=[ \t]+[^\s-]))")
# A setting's value: quoted, up to its closing quote (a JSON or repr escape within it is its
# own), or up to a backslash when its opening quote is escaped (a JSON body within a JSON
# string); unquoted, up to a space, a quote, a backslash, a ``,``, ``;`` or ``&``, a closing
# parenthesis, bracket or brace, a ``<`` or ``>`` (``api_key=abc123def, retrying`` keeps
# its comma; a ``:`` or ``=`` within the value is the value's: ``Cookie: session=...``);
# one masked already is left as it is.
_SETTING_VALUE = re.compile(
    r"""(?P<gap>[ \t]*)(?P<quote>\\?["'])?(?!\*\*\*)(?P<value>(?<=\\["'])[^"'\\\n]+"""
    r"""|(?<=")(?:[^"\\\n]|\\.)+|(?<=')(?:[^'\\\n]|\\.)+|[^\s'"`\\,;&)\]}<>]+)"""
)
# A number, which plain text shows as it is under any name: a measurement or a count
# (``tokens_per_second=1234.56``, ``"observation_tokens": 312.25``, JSON's ``Infinity``),
# not a credential.
_NUMBER = re.compile(r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|Infinity|inf|nan|NaN)")
# After a name's ":": a subscripted type, a type annotation (a traceback's source
# line, a signature: ``api_key: Optional[str] = None``, ``token: dict[str, Any]``), ending
# at its closing bracket (``abcdefgh[12]xyz`` goes on: a value), of words without a digit
# (``Xk9mQ2[vT7pL]``, a generated password, is a value; ``np.float32`` in one is masked,
# wrongly but safely); and a word of prose after
# a sentence's colon (``most tokens: truncated output``): lower-case letters, a space after
# the colon and another word after it (``tokens: hunter2hunter2 rejected`` has a digit,
# ``tokens: correcthorse`` ends its line: values), after a name that is a word of a
# language model's prose, tokens or keys, plural (:data:`_PROSE_NAME`): one credential is
# named in the singular (``api_key: abcdefghijklmnop expired`` stays masked), and a
# password's, a secret's or a cookie's colon is never a sentence's (``password:
# correcthorse battery``, a passphrase).
_ANNOTATION = re.compile(r"[A-Za-z_][A-Za-z_.]*\[[A-Za-z_.\[\], |]*\](?=[\s,)=]|$)")
_PROSE_WORD = re.compile(r"[a-z]+(?=[ \t]+[a-z])")
_PROSE_NAME = re.compile(r"tokens|keys")


def _mask_settings(text: str) -> str:
    """``text`` with the values of its settings (:data:`_SETTING_NAME`, :data:`_FLAG_NAME`,
    :data:`_SETTING_VALUE`) that hold a credential masked: by the setting's name, as a
    command line's override is read (:func:`_setting_holds_credential`: ``api_key=``,
    ``X-Api-Key:``, ``"password":``, ``--token``; not ``max_tokens=512``, ``author:``,
    ``pad_token:``, a value shorter than :data:`MIN_SECRET_LENGTH`), but for text that is
    no value (:func:`_no_value`). Each setting is read, one within another's value too
    (``WARNING:app:api_key=...``, as Python's logging writes a record)."""
    spans = []
    for found in _SETTING_NAME.finditer(text[::-1]):
        name = found["name"][::-1]
        if credential_named(name) and (
            value := _SETTING_VALUE.match(text, len(text) - found.start())
        ):
            # name = value, a space on either side, only before a quoted value.
            spaced = found["separator"] == "=" and (found["gap"] or value["gap"])
            if not spaced or value["quote"]:
                spans.append((name, found["separator"], value))
    for flag in _FLAG_NAME.finditer(text):
        if credential_named(flag["name"]) and (value := _SETTING_VALUE.match(text, flag.end())):
            spans.append((flag["name"], "--", value))
    pieces: list[str] = []
    copied = 0
    for name, separator, value in sorted(spans, key=lambda span: span[2].start("value")):
        if (
            value.start("value") >= copied
            and _setting_holds_credential(name, value["value"])
            and not _no_value(text, name, separator, value)
        ):
            pieces += [text[copied : value.start("value")], MASK]
            copied = value.end("value")
    return "".join(pieces) + text[copied:] if pieces else text


def _no_value(text: str, name: str, separator: str, value: re.Match[str]) -> bool:
    """Whether a credential-named setting's ``value`` in ``text`` (after ``name`` and its
    ``separator``: ``:``, ``=``, or ``--`` for a flag) is text that is no value of it: a
    number (:data:`_NUMBER`); after ``:``, a type annotation or, after ``tokens`` or
    ``keys``, a word of prose (:data:`_ANNOTATION`, :data:`_PROSE_WORD`,
    :data:`_PROSE_NAME`); after a flag, argparse's metavar for it, its name in capitals, as
    a usage or help line shows it (``--auth-token AUTH_TOKEN``)."""
    held, start, end = value["value"], value.start("value"), value.end("value")
    if _NUMBER.fullmatch(held):
        return True
    if separator == "--":
        return held == name.upper().replace("-", "_")
    if separator != ":":
        return False
    annotation = _ANNOTATION.match(text, start)
    prose = (
        value["gap"]
        and _PROSE_NAME.fullmatch(_name_parts(name)[-1])
        and _PROSE_WORD.match(text, start)
    )
    return bool((annotation and annotation.end() >= end) or (prose and prose.end() == end))


# The environment :func:`secrets_in_environment` last read (a copy of ``os.environ``'s
# encoded contents, which every change to ``os.environ`` updates) and its credentials: every
# line a process prints or logs asks for them, and walking the environment (decoding each
# name and value) took a hundred times as long as comparing it with the copy does.
# The contents are ``os.environ._data``, a private attribute, on purpose: ``os.environ``
# has no public count of its changes nor a cheap view of them, and every public read of it
# (``dict(os.environ)``, ``os.environ == copy``, ``os.environ.copy()``, ``os.environb``,
# which shares the same dict) walks it in Python, a variable at a time: 110 to 140 us for
# 135 variables, against 3 us for comparing ``_data`` with the copy, where masking a whole
# line takes 9 us. CPython's ``os._Environ`` has kept its contents there since 3.0.
_environment: tuple[dict[Any, Any], tuple[str, ...]] = ({}, ())


def secrets_in_environment() -> tuple[str, ...]:
    """Values of environment variables named like credentials (``RAY_AUTH_TOKEN``,
    ``MLFLOW_TRACKING_PASSWORD``, ``WANDB_API_KEY``, ...): what no message may show, whoever
    wrote it (a user's reward function may quote one in its exception). Values shorter than
    :data:`MIN_SECRET_LENGTH` are switches, not credentials. Read again whenever
    ``os.environ`` differs from the environment they were read from."""
    global _environment
    contents = os.environ._data  # type: ignore[attr-defined]
    read, secrets = _environment
    if contents != read:
        # Copied first: a change made while the variables are walked differs from the copy,
        # and the next call reads them again.
        read = dict(contents)
        secrets = tuple(
            value
            for name, value in os.environ.items()
            if credential_named(name) and len(value) >= MIN_SECRET_LENGTH
        )
        _environment = read, secrets
    return secrets


def _forms(secret: str) -> set[str]:
    """The ways a message may spell ``secret``: as is, in a ``repr`` or ``ascii``, in a JSON
    string, in a URL (percent-encoded, ``/`` too or not; a token has no space for ``+``) and
    in HTML."""
    return {
        secret,
        repr(secret)[1:-1],
        ascii(secret)[1:-1],
        json.dumps(secret)[1:-1],
        quote(secret, safe=""),
        quote(secret),
        html.escape(secret),
        html.escape(secret, quote=False),
    }


@functools.lru_cache(maxsize=8)
def _spellings(secrets: frozenset[str]) -> re.Pattern[str] | None:
    """Any spelling of any of ``secrets``, in any case (``%2f`` is ``%2F``; a service may
    upper-case what it echoes); the longest first, so one that holds another is masked whole."""
    forms = sorted({form for secret in secrets for form in _forms(secret)}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, forms)), re.IGNORECASE) if forms else None


def redact_text(text: str, secrets: Sequence[str] = (), *, cut: bool = False) -> str:
    """``text`` (a server's answer, an error message, a console line) without credentials:
    the registered secrets, those of the environment and the given ``secrets``, each in any
    of its spellings (:func:`_spellings`); authorization headers, bearer tokens, and in
    URLs ``user:pass@`` and the values of query parameters named like credentials
    (``?api_key=``, ``&X-Amz-Signature=``: :func:`secret_query_names`'s rule), a relative
    URL's too (``/score?token=``, as an HTTP library's error quotes the request); and the
    values of settings written in the text under a credential's name (:func:`_mask_settings`:
    ``api_key=``, ``X-Api-Key:``, ``"password": "..."``, ``--token``). ``cut``:
    the text was cut off at its end, where the start of a secret is masked too."""
    known = frozenset(s for s in (*_registered, *secrets_in_environment(), *secrets) if s)
    if (spellings := _spellings(known)) is not None:
        text = spellings.sub(MASK, text)
    if cut:
        for secret in known:
            for length in range(min(len(secret) - 1, len(text)), _MIN_FRAGMENT - 1, -1):
                if text.lower().endswith(secret[:length].lower()):
                    text = text[:-length] + MASK
                    break
    text = _AUTH_HEADER.sub(r"\1" + MASK, text)
    text = _mask_settings(_QUERY_PARAMETER.sub(_mask_query, text))
    return redact_url(_BEARER.sub(r"\1" + MASK, text))


def redact_values(value: Any) -> Any:
    """``value`` as it may leave this process: what pickling it carries (Ray pickles a failed
    call's exception to the driver), with every text in it as :func:`redact_text` leaves it:
    a string, bytes (a process's output, decoded as UTF-8 or byte for byte), and those in
    lists, tuples, dicts and in the state of any object it holds (an HTTP error's response
    and request, their URLs, headers and body); the text under a credential's name in a
    mapping masked whole (:func:`holds_credential`: a request's ``Authorization`` or
    ``X-Api-Key`` header, whatever its value); the exceptions in it masked in place
    (:func:`redact_exception`'s rules). One with nothing masked in it is returned itself;
    else a copy, rebuilt as pickle rebuilds it (of its own types), the objects it shares
    with others copied, never changed. One pickle cannot carry (a lock, a socket) is
    returned itself: Ray cannot carry it either. One whose copy fails to be rebuilt raises."""
    return _redact_value(value, {})


# What each exception masked so far became, by its id (kept with it, so that the id is its own).
_Done = dict[int, tuple[BaseException, BaseException]]


def _redact_value(value: Any, done: _Done) -> Any:
    """:func:`redact_values`."""
    if isinstance(value, str | bytes | bytearray):
        return _redact_data(value)
    buffer = io.BytesIO()
    pickler = _MaskingPickler(buffer, done)
    try:
        pickler.dump(value)
    except _MaskingFailed:
        raise
    except Exception:
        # What pickle cannot carry (a lock, a socket: TypeError; a ctypes pointer:
        # ValueError; whatever an object's own __reduce__ raises), Ray cannot either: it
        # carries the exception's text alone then, which the check of its text covers; or
        # the exception holding it leaves it out of its own pickle (urllib3's MaxRetryError
        # its pool).
        return value
    if not pickler.masked:
        return value
    buffer.seek(0)
    return _HeldUnpickler(buffer, pickler.held).load()


def _redact_data(data: str | bytes | bytearray) -> Any:
    """``data`` as :func:`redact_text` leaves it; bytes read as UTF-8, what is not UTF-8
    byte for byte (``surrogateescape``), and given back as bytes; itself if nothing changed."""
    if isinstance(data, str):
        masked = redact_text(data)
        return data if masked == data else masked
    text = bytes(data).decode("utf-8", "surrogateescape")
    masked = redact_text(text)
    return data if masked == text else type(data)(masked.encode("utf-8", "surrogateescape"))


def _credential_keys(mapping: MutableMapping[Any, Any]) -> list[str]:
    """The names in ``mapping`` whose texts are credentials (:func:`holds_credential`), but
    for those masked already."""
    return [
        key
        for key, value in mapping.items()
        if isinstance(key, str)
        and isinstance(value, str | bytes)
        and value not in (MASK, MASK.encode())
        and holds_credential(key, value)
    ]


# What pickle saves by its name, passed as itself: one defined in a function (a reward's own
# exception class, a lambda in a hook) is no failure, and nothing of it is data to mask.
_BY_NAME = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType)


class _MaskingPickler(pickle.Pickler):
    """Pickles a value as it is, but for its texts that hold a credential, which it passes
    masked (:func:`_redact_data`), and the exceptions in it, masked in place or replaced
    (:func:`_redact_chained`): those and what pickle saves by name (:data:`_BY_NAME`) are
    passed to :class:`_HeldUnpickler` as themselves (``held``), not pickled. A mapping
    that holds a text under a credential's name is pickled within its persistent id, with
    those names, and its copy masked as it is rebuilt, before anything reads it (an
    object's state): in this one pickle, which a mapping met again (within itself, or
    within another that it holds) refers to as to any other object."""

    def __init__(self, file: io.BytesIO, done: _Done) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.done = done
        self.held: list[Any] = []
        self.masked = False
        # Those with credentials met so far, by id (each kept alive by the memo: its own).
        self.mappings: set[int] = set()

    def persistent_id(self, obj: Any) -> int | tuple[Any, tuple[str, ...]] | None:
        # Every object pickled is asked, the objects of a persistent id too.
        if isinstance(obj, str | bytes | bytearray):
            kept = _redact_data(obj)
            if kept is obj:
                return None
        elif isinstance(obj, BaseException):
            try:
                kept = _redact_chained(obj, self.done)
            except Exception as error:  # masking failed, not pickling: no value is left
                raise _MaskingFailed from error
        elif isinstance(obj, _BY_NAME):
            kept = obj
        elif (
            id(obj) not in self.mappings
            and isinstance(obj, MutableMapping)
            and (names := _credential_keys(obj))
        ):
            self.mappings.add(id(obj))
            self.masked = True
            return obj, tuple(names)
        else:
            return None
        self.masked |= kept is not obj
        self.held.append(kept)
        return len(self.held) - 1


class _MaskingFailed(Exception):
    """Masking an exception within a value failed (:func:`redact_exception` replaces it)."""


class _HeldUnpickler(pickle.Unpickler):
    """Rebuilds what :class:`_MaskingPickler` pickled, with what it ``held``."""

    def __init__(self, file: io.BytesIO, held: list[Any]) -> None:
        super().__init__(file)
        self.held = held

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, int):
            return self.held[pid]
        mapping, names = pid  # rebuilt; masked before anything reads it
        for name in names:
            mapping[name] = MASK if isinstance(mapping[name], str) else MASK.encode()
        return mapping


def redact_exception(error: BaseException) -> BaseException:
    """``error`` as it may leave this process (Ray pickles a failed call's exception, with
    the traceback text it formats from it, to the driver, which shows them, and keeps them in
    the worker for the dashboard): its arguments and attributes (:func:`redact_values`: all
    that pickling them carries, the objects they hold too; PEP 678 notes among them; the
    text fields of built-in exceptions: an ``OSError``'s file names, a ``UnicodeError``'s
    bytes) and those of the exceptions it chains (its cause and context) and groups (an
    ``ExceptionGroup``'s members, and theirs) masked in place, so its type and all it
    carries stay. One whose text still holds a credential (a ``__str__`` of its own that
    reads what masking cannot reach) becomes a ``RuntimeError`` of that text masked, its
    type named first, with its traceback, cause and context (a group holding one, a group
    of the others and it, as ``derive`` makes one). One that masking fails on (a value
    whose masked copy cannot be rebuilt, a group that cannot be made anew) becomes such a
    ``RuntimeError`` alone, without the chain it could not mask: the failure of masking
    would otherwise leave in its stead, with the error unmasked as its context."""
    try:
        return _redact_chained(error, {})
    except Exception:
        return _masked_text(error, redact_text(_exception_text(error)))


def _redact_chained(error: BaseException, done: _Done) -> BaseException:
    """``error`` masked (:func:`redact_exception`); one met again is what it became, one met
    within its own walk (an attribute holding it) itself."""
    if (met := done.get(id(error))) is not None:
        return met[1]
    done[id(error)] = error, error
    # Setting a cause suppresses the context: the flag is kept as it was.
    suppress = error.__suppress_context__
    if error.__cause__ is not None:
        error.__cause__ = _redact_chained(error.__cause__, done)
    if error.__context__ is not None:
        error.__context__ = _redact_chained(error.__context__, done)
    error.__suppress_context__ = suppress
    kept = error  # what stands for it: itself, a group made anew, or a RuntimeError
    if isinstance(error, BaseExceptionGroup):
        # The members a traceback shows are the group's own (not its arguments): one
        # replaced is in a group made anew, which carries all the group carried.
        members = [_redact_chained(member, done) for member in error.exceptions]
        if any(new is not old for new, old in zip(members, error.exceptions, strict=True)):
            kept = error.derive(members).with_traceback(error.__traceback__)
            _carry_chain(error, kept)
            vars(kept).update(vars(error))
    kept.args = _redact_value(kept.args, done)
    attributes = vars(kept)
    for name, value in attributes.items():
        attributes[name] = _redact_value(value, done)
    # The text fields of built-in exceptions (an OSError's file names, an ImportError's
    # path, a UnicodeDecodeError's bytes), those a read-only field holds left to the check
    # below; not the object an AttributeError names (a worker itself), which no pickle
    # carries and no text shows.
    for name, _ in inspect.getmembers(type(kept), inspect.ismemberdescriptor):
        value = getattr(kept, name, None)
        if isinstance(value, str | bytes | bytearray | list | tuple | dict) and (
            (masked := _redact_value(value, done)) is not value
        ):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(kept, name, masked)
    text = _exception_text(kept)
    masked_text = redact_text(text)
    if masked_text != text:
        kept = _masked_text(kept, masked_text)
        _carry_chain(error, kept)
    done[id(error)] = error, kept
    return kept


def _carry_chain(error: BaseException, replacement: BaseException) -> None:
    """``replacement`` chained as ``error`` is: its cause and context, and which it shows."""
    replacement.__cause__, replacement.__context__ = error.__cause__, error.__context__
    replacement.__suppress_context__ = error.__suppress_context__


def _exception_text(error: BaseException) -> str:
    """``error`` as a traceback's last line shows it: its type and its text."""
    return "".join(traceback.format_exception_only(error)).strip()


def _masked_text(error: BaseException, masked: str) -> RuntimeError:
    """A ``RuntimeError`` of ``error``'s ``masked`` text, with its traceback, chained to nothing."""
    return RuntimeError(masked).with_traceback(error.__traceback__)


class _RedactedStream:
    """A text stream that writes whole lines (or what a flush pushes out) to ``stream``
    through :func:`redact_text`: a secret written in pieces is masked once its line is
    complete."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            # "\r" ends a line a progress counter rewrites in place.
            end = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
            if end:
                done, self._pending = self._pending[:end], self._pending[end:]
                self.stream.write(redact_text(done))
        return len(text)

    def writelines(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self.stream.write(redact_text(self._pending))
                self._pending = ""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


def _redacted_record_factory(
    factory: Callable[..., logging.LogRecord],
) -> Callable[..., logging.LogRecord]:
    def make(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # arguments that do not fit: the handler reports it when it emits
            return record
        record.msg, record.args = redact_text(message), ()
        if record.exc_info:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return record

    return make


@contextlib.contextmanager
def redacted_output() -> Iterator[None]:
    """While on, every line this process writes to stdout and stderr (prints, warnings,
    the lines Ray forwards from workers) and every log record's message and traceback,
    whichever handler writes it where (Ray's hold the stderr of its import), pass through
    :func:`redact_text`."""
    streams = sys.stdout, sys.stderr
    wrapped = {id(s): _RedactedStream(s) for s in streams}
    factory = logging.getLogRecordFactory()
    sys.stdout, sys.stderr = wrapped[id(streams[0])], wrapped[id(streams[1])]
    logging.setLogRecordFactory(_redacted_record_factory(factory))
    try:
        yield
    finally:
        logging.setLogRecordFactory(factory)
        for stream in wrapped.values():
            stream.flush()
        sys.stdout, sys.stderr = streams


def redact_process_output() -> None:
    """:func:`redacted_output` on for the rest of this process, once however often it is
    called: for a Ray worker's process, whose stdout and stderr Ray writes to log files on
    its node (which a cluster's dashboard shows to whoever reaches it) besides forwarding
    them to the driver, which masks only its own copy. The worker masks with what it
    knows: the credential-named variables of its environment, and the patterns."""
    global _process_output
    if _process_output is None:
        _process_output = contextlib.ExitStack()
        _process_output.enter_context(redacted_output())
