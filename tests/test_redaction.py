"""The masking rules of verlite/redaction.py, one test each, and the sinks that apply them:
the process's streams and log records under ``redacted_output``, error messages, ``shown``,
config records and the job command line's check."""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from checkpoint_support import fake_checkpoint

from verlite import redaction, report
from verlite.cli import main
from verlite.config.loading import load_config
from verlite.driver.checkpoint import check_resumable
from verlite.errors import RunFailure, UserError, shown
from verlite.redaction import (
    carries_secret,
    credential_named,
    redact_config,
    redact_text,
    redacted_output,
    register_secret,
    secret_query_names,
)

SECRET = "sk-live/51Hx+q'\"<&>z=="  # every spelling of it differs: quotes, slash, plus, HTML


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    # A fresh registry per test: secrets registered here mask nothing in other tests.
    fresh: set[str] = set()
    monkeypatch.setattr(redaction, "_registered", fresh)
    return fresh


def test_a_registered_secret_is_masked_whatever_holds_it() -> None:
    assert redact_text(f"scored {SECRET}!") == f"scored {SECRET}!"
    register_secret(SECRET)
    assert redact_text(f"scored {SECRET}!") == "scored ***!"


def test_a_secret_shorter_than_the_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter than 8 characters"):
        register_secret("abc1234")
    register_secret("abcd1234")


@pytest.mark.parametrize(
    "spelling",
    [
        repr(SECRET)[1:-1],
        json.dumps(SECRET)[1:-1],
        quote(SECRET, safe=""),
        quote(SECRET),
        "sk-live/51Hx+q&#x27;&quot;&lt;&amp;&gt;z==",
        "sk-live/51Hx+q'\"&lt;&amp;&gt;z==",
        "SK-LIVE/51HX+Q'\"<&>Z==",
        "sk-live%2f51hx%2bq%27%22%3c%26%3ez%3d%3d",
    ],
    ids=["repr", "json", "url", "url-path", "html", "html-text", "upper", "url-lower"],
)
def test_every_spelling_of_a_secret_is_masked(spelling: str) -> None:
    register_secret(SECRET)
    assert redact_text(f"[{spelling}]") == "[***]"


def test_a_secret_beyond_ascii_is_masked_as_repr_and_ascii_spell_it() -> None:
    secret = "tökén\\51Hx"  # repr() doubles the backslash; ascii() escapes the rest too
    register_secret(secret)
    assert redact_text("[tökén\\\\51Hx] [t\\xf6k\\xe9n\\\\51Hx]") == "[***] [***]"


def test_a_secret_that_holds_another_is_masked_whole() -> None:
    register_secret("abcdefgh")
    register_secret("abcdefgh-ijklmnop")
    assert redact_text("[abcdefgh-ijklmnop] [abcdefgh]") == "[***] [***]"


def test_the_start_of_a_secret_at_the_end_of_a_cut_text_is_masked() -> None:
    register_secret(SECRET)
    assert redact_text(f"body: {SECRET[:6]}", cut=True) == "body: ***"
    # Not cut: a word that starts like the secret is a word.
    assert redact_text(f"body: {SECRET[:6]}") == f"body: {SECRET[:6]}"
    assert redact_text(f"body: {SECRET[:3]}", cut=True) == f"body: {SECRET[:3]}"


def test_credential_named_environment_variables_are_masked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MY_SERVICE_API_KEY", "envsecret-42-value")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")  # a switch, too short to mask
    assert redact_text("key envsecret-42-value, 1 step") == "key ***, 1 step"


def test_secrets_given_by_the_caller_are_masked() -> None:
    assert redact_text("ray token rt-0123456789", ["rt-0123456789"]) == "ray token ***"


def test_an_authorization_header_is_masked() -> None:
    assert redact_text("echo: Authorization: Basic dXNlcjpwYXNz") == "echo: Authorization: ***"
    assert redact_text("x-ray-authorization=abcdef123") == "x-ray-authorization=***"


def test_an_authorization_header_a_server_echoes_as_json_or_a_dict_is_masked() -> None:
    # A Basic credential is no value verlite knows (MLflow's client builds it from its own
    # credentials file): only the header's name marks it.
    basic = "Basic dXNlcjpwYXNz"
    assert redact_text(f"headers: {{'authorization': '{basic}'}}") == (
        "headers: {'authorization': '***'}"
    )
    assert redact_text(f'Authorization="{basic}"') == 'Authorization="***"'
    assert redact_text(json.dumps({"Authorization": basic, "x": 1})) == json.dumps(
        {"Authorization": "***", "x": 1}
    )
    # An echoed body inside a JSON record: masked, and the record stays JSON.
    record = json.dumps({"error": json.dumps({"Authorization": basic})})
    assert json.loads(redact_text(record)) == {"error": json.dumps({"Authorization": "***"})}
    line = json.dumps({"error": 'sent "Bearer abcdef123" twice'})
    assert json.loads(redact_text(line)) == {"error": 'sent "Bearer ***" twice'}


def test_a_bare_bearer_token_is_masked() -> None:
    assert redact_text("sent bearer opaque-token-1234 twice") == "sent bearer *** twice"


def test_url_credentials_are_masked() -> None:
    assert redact_text("at https://me:pw@mlflow.internal/x") == "at https://***@mlflow.internal/x"


def test_credentials_in_a_url_s_query_are_masked_by_the_parameter_s_name() -> None:
    # An MLflow URI with its token in the query, as the config record holds it.
    uri = "https://mlflow.example/api?author=me&api_key=0123456789abc&x=1#top"
    assert redact_text(uri) == "https://mlflow.example/api?author=me&api_key=***&x=1#top"
    assert redact_config({"trainer": {"mlflow_tracking_uri": uri}}) == {
        "trainer": {"mlflow_tracking_uri": redact_text(uri)}
    }
    # A relative URL as an HTTP library's error quotes it; a name percent-encoded; a
    # signed URL's signature; a query HTML writes; a masked value masked again.
    for text, masked in [
        (
            "Max retries exceeded with url: /score?token=abc123def (Caused by ...)",
            "Max retries exceeded with url: /score?token=*** (Caused by ...)",
        ),
        ("'/b?api%5Fkey=zz9'", "'/b?api%5Fkey=***'"),
        (
            "s3://b/o?X-Amz-Signature=ab%2Fcd&X-Amz-Date=1",
            "s3://b/o?X-Amz-Signature=***&X-Amz-Date=1",
        ),
        ('<a href="/x?a=1&amp;sig=abcdef">', '<a href="/x?a=1&amp;sig=***">'),
        ("(see https://h/?sig=abcdef)", "(see https://h/?sig=***)"),
        # In a JSON line (a metrics or config record) the line stays JSON.
        (
            json.dumps({"prompt": 'see "https://h/?token=abcdef"'}),
            json.dumps({"prompt": 'see "https://h/?token=***"'}),
        ),
        ("/x?token=***", "/x?token=***"),
    ]:
        assert redact_text(text) == masked, text
    # Names that only hold a credential word, and text that is no query, stay.
    for text in ("/x?author=me&design=2&monkey=3", "pass@k=0.5 where k=4", "a=b&c=d"):
        assert redact_text(text) == text


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        # A list's repr, quoted and not; a dict's; a URL in brackets, in braces, in prose.
        ("['http://h/x?token=abc123def', 'y']", "['http://h/x?token=***', 'y']"),
        ("[http://h/x?token=abc123def, y]", "[http://h/x?token=***, y]"),
        ("[http://h/x?token=abc123def]", "[http://h/x?token=***]"),
        ("{url: http://h/?key=v}", "{url: http://h/?key=***}"),
        ("{'url': http://h/?key=abc123def, 'n': 2}", "{'url': http://h/?key=***, 'n': 2}"),
        ("see http://h/?sig=abc123def, then retry", "see http://h/?sig=***, then retry"),
        ("ends with http://h/?sig=abc123def,", "ends with http://h/?sig=***,"),
        # A comma within the value is the value's, masked with it.
        ("http://h/?token=abc,def&x=1", "http://h/?token=***&x=1"),
    ],
)
def test_a_masked_query_value_ends_where_enclosing_text_resumes(text: str, masked: str) -> None:
    # A query value stops at a closing bracket or brace and at a comma that ends it: the
    # text around a URL keeps its delimiters.
    assert redact_text(text) == masked


# A credential no rule knows the value of, written as a setting in plain text: found by
# its name (credential_named's rule), wherever the text comes from.
PLAIN = "abcdefgh123"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("X-Api-Key: abcdefgh123", "X-Api-Key: ***"),
        ("retrying with api_key=abcdefgh123 (2/3)", "retrying with api_key=*** (2/3)"),
        ("login refused: password: hunter2hunter2", "login refused: password: ***"),
        ("password:hunter2hunter2", "password:***"),
        (str({"X-Api-Key": PLAIN, "n": 2}), "{'X-Api-Key': '***', 'n': 2}"),
        ("Client(api_key='abcdefgh123', timeout=3)", "Client(api_key='***', timeout=3)"),
        # A quoted value is masked up to its closing quote, spaces and escapes included.
        (json.dumps({"token": 'abc def "ghi"', "n": 3}), '{"token": "***", "n": 3}'),
        ("'password' : 'hunter2hunter2'", "'password' : '***'"),
        ('password = "hunter2hunter2"', 'password = "***"'),
        ("--api-key abcdefgh123 --verbose", "--api-key *** --verbose"),
        ("--token=abcdefgh123", "--token=***"),
        ("HF_TOKEN=hf_abcdefghijklmnop", "HF_TOKEN=***"),
        ("Cookie: session=abcdefgh1234; theme=dark", "Cookie: ***; theme=dark"),
        # A setting within another's value (Python logging's record: level:logger:message).
        ("WARNING:app:api_key=abcdefgh123", "WARNING:app:api_key=***"),
        # An unquoted value ends at a space, a comma, a semicolon, an ampersand, a closing
        # parenthesis, bracket or brace; a "=" or ":" within it is its own.
        ("api_key=abcdefgh123, retrying", "api_key=***, retrying"),
        ("secret_key=changeme123;other=1", "secret_key=***;other=1"),
        ("{token: abcdefgh123}", "{token: ***}"),
        ("(token=abcdefgh123) [token=abcdefgh123]", "(token=***) [token=***]"),
        ("api_key=abc/def+gh==", "api_key=***"),
    ],
    ids=[
        "header",
        "log",
        "message",
        "no-space",
        "dict",
        "call",
        "json",
        "repr-spaced",
        "toml",
        "flag",
        "flag-equals",
        "env",
        "cookie",
        "logging-record",
        "comma",
        "semicolon",
        "brace",
        "brackets",
        "base64",
    ],
)
def test_a_credential_written_as_a_setting_is_masked_by_its_name(text: str, masked: str) -> None:
    assert redact_text(text) == masked
    assert redact_text(masked) == masked  # masking twice is masking once


def test_a_setting_in_a_json_body_within_a_json_line_is_masked_and_the_line_stays_json() -> None:
    line = json.dumps({"error": json.dumps({"token": PLAIN, "x": 1})})
    assert json.loads(redact_text(line)) == {"error": json.dumps({"token": "***", "x": 1})}


@pytest.mark.parametrize(
    "text",
    [
        # Config echoes: counts of tokens, names that only hold a credential word.
        "rollout.max_tokens=512 data.prompt_key=question author=someone_else",
        "usage=CompletionUsage(completion_tokens=12, prompt_tokens=30, total_tokens=42)",
        # A tokenizer's special tokens, in a config echo and in a tokenizer's repr.
        "tokenizer.pad_token: <|endoftext|>",
        str({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
        + str({"additional_special_tokens": ["<|im_start|>"]}),
        # Metrics: a name after a "/" is a metric's, and numbers are shown under any name.
        json.dumps({"step": 3, "multiturn/observation_tokens/mean": 312.4567891234}),
        "reward/format_token=unmatched",
        "tokens_per_second=1234.5678 token_entropy=0.123456789 token_score=-Infinity",
        # An exception's name and message (a traceback's last line), verlite's --keys.
        'KeyError: "no field token_budget_x in the record"',
        "InvalidTokenError: Signature verification failed",
        "--keys 'val/score/mean,critic/score/mean' names no metric",
        # Switches and placeholders shorter than a secret, a masked value, a flag's next flag.
        "use_auth_token=True token=None token: str",
        "password: ********",
        "run --token --verbose",
        # Code in a traceback: spaces around "=" before an unquoted value are an assignment.
        "    api_key = os.environ['API_KEY']",
        # Prose and times: no setting.
        "12:30:05 step 3: the token budget is spent",
    ],
    ids=[
        "config",
        "usage",
        "pad-token",
        "tokenizer",
        "metrics-json",
        "metric-name",
        "numbers",
        "key-error",
        "token-error",
        "keys-flag",
        "switches",
        "placeholder",
        "flag-then-flag",
        "code",
        "prose",
    ],
)
def test_settings_that_hold_no_credential_are_shown(text: str) -> None:
    assert redact_text(text) == text


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        # A word of prose after a credential-named word's colon (a sentence's colon): shown.
        ("responses hit the most tokens: truncated output", None),
        ("tokens: truncated output", None),
        ("the api keys: truncated output", None),
        # Next to it, masked: a value with a digit, one that ends the line, one glued to the
        # colon, one quoted, one after "=", one after a password's name (a passphrase).
        ("tokens: hunter2hunter2 rejected", "tokens: *** rejected"),
        ("login refused, tokens: correcthorse", "login refused, tokens: ***"),
        ("password: correcthorse battery staple", "password: *** battery staple"),
        ("api_key: abcdefghijklmnop expired", "api_key: *** expired"),
        ("password:correcthorse battery", "password:*** battery"),
        ("password: 'correcthorse' battery", "password: '***' battery"),
        ("password=correcthorse battery", "password=*** battery"),
        # A type annotation (a traceback's source line, a signature): shown.
        ("    def __init__(self, api_key: Optional[str] = None):", None),
        ("password: typing.Dict[str, Any], token: list[str]", None),
        # Next to it, masked: a value with brackets that goes on past them, or after "=".
        ("api_key: abcdefgh[12]xyz", "api_key: ***]xyz"),
        ("api_key=abcdefgh[12] (retry)", "api_key=***] (retry)"),
        # ... and a generated password or key with brackets in it, which a type's name does
        # not hold: a digit (a type's name and its arguments are words).
        ("password: Xk9mQ2[vT7pL] rejected", "password: ***] rejected"),
        ("api_key: sk_live_4eC39Hq[LyjWDarjtT1zdp7dc]", "api_key: ***]"),
        # argparse's metavar, the flag's name in capitals (a usage or help line): shown.
        ("usage: serve [-h] [--auth-token AUTH_TOKEN]", None),
        ("  --auth-token AUTH_TOKEN  the service's token", None),
        # Next to it, masked: any other value, capitals or the name in lower case.
        ("--auth-token SERVICE_TOKEN", "--auth-token ***"),
        ("--auth-token auth_token", "--auth-token ***"),
        # A key's identifier (AWS's access key id, a KMS key id): shown; the key, masked.
        (
            "aws_access_key_id=AKIAIOSFODNN7EXAMPLE aws_secret_access_key=wJalrXUtnFEMIK7",
            "aws_access_key_id=AKIAIOSFODNN7EXAMPLE aws_secret_access_key=***",
        ),
        ("key_id: 1234abcd-12ab-34cd", None),
        ("key: 1234abcd-12ab-34cd", "key: ***"),
    ],
    ids=[
        "prose",
        "prose-first",
        "prose-key",
        "prose-digits",
        "prose-line-end",
        "prose-passphrase",
        "prose-singular",
        "prose-glued",
        "prose-quoted",
        "prose-equals",
        "annotation",
        "annotations",
        "annotation-goes-on",
        "annotation-equals",
        "annotation-password",
        "annotation-key",
        "metavar-usage",
        "metavar-help",
        "metavar-other",
        "metavar-lower",
        "key-id",
        "key-id-alone",
        "key-alone",
    ],
)
def test_text_that_only_looks_like_a_credential_s_value_is_shown(
    text: str, masked: str | None
) -> None:
    # Each rule that shows a value that is no credential, with what it still masks beside it.
    assert redact_text(text) == (text if masked is None else masked)


@pytest.mark.parametrize(
    ("name", "named"),
    [
        # A size counted in tokens, a secret's length: a measure, not the credential.
        ("actor.max_token_len_per_worker", False),
        ("token_length", False),
        ("PASSWORD_LEN", False),
        # A key's identifier, not the key.
        ("key_id", False),
        ("AWS_ACCESS_KEY_ID", False),
        ("AWSAccessKeyId", False),
        ("client_key_ids", False),
        # Next to them: a credential word elsewhere in the name still names one.
        ("secret_key_id", True),
        ("api_token_len_secret", True),
        ("access_key", True),
        ("rollout.stop_token_ids", True),
    ],
)
def test_a_credential_s_measure_or_a_key_s_identifier_is_not_credential_named(
    name: str, named: bool
) -> None:
    assert credential_named(name) is named


def test_secret_named_config_fields_and_secrets_in_values_are_masked() -> None:
    register_secret(SECRET)
    config = {
        "wandb": {"api_key": "k", "run_name": f"run-{SECRET}"},
        "steps": 3,
        "none": None,
        # A count of tokens is no credential; a credential-named key's number is masked.
        "model": {"logits_chunk_tokens": 1024, "auth_token": "t", "api_token": 12345678},
        "actor": {"max_token_len_per_worker": 64},
        # Token ids neither; a credential-named key's list is masked.
        "rollout": {"stop_token_ids": [3, 7], "api_tokens": ["sk-live-1234"]},
    }
    assert redact_config(config) == {
        "wandb": {"api_key": "***", "run_name": "run-***"},
        "steps": 3,
        "none": None,
        "model": {"logits_chunk_tokens": 1024, "auth_token": "***", "api_token": "***"},
        "actor": {"max_token_len_per_worker": 64},
        "rollout": {"stop_token_ids": [3, 7], "api_tokens": "***"},
    }


@pytest.mark.parametrize(
    "name",
    [
        "token",
        "access_token",
        "api-key",
        "apiKey",
        "X-Api-Key",
        "key",
        "password",
        "PGPASSWORD",
        "secret",
        "client_secret",
        "sig",
        "X-Amz-Signature",
        "X-Amz-Security-Token",
        "X-Amz-Credential",
        "auth",
        "HF_TOKEN",
        "RAY_AUTH_TOKEN",
        "WANDB_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "MLFLOW_TRACKING_PASSWORD",
        "wandb.api_key",
        "rollout.stop_token_ids",
        # Numbered, plural, glued or short forms (caught by substring before; kept caught).
        "DB_PASSWORD2",
        "MY_SECRET1",
        "TOKEN2",
        "SMTP_PASSWORDS",
        "passwords",
        "SECRETKEY",
        "secretkey",
        "authkey",
        "api_key2",
        "HMAC_KEY",
        "ssh_key",
        "encryption_key",
        "master_key",
        "consumer_key",
        "sessionKey",
        "subscription-key",
        "private_key",
        "passwd",
        "DB_PASS",
        "MYSQL_PWD",
        "Cookie",
        "bearer",
        "jwt",
    ],
)
def test_names_holding_a_credential_word_as_a_part_are_credential_named(name: str) -> None:
    assert credential_named(name)


@pytest.mark.parametrize(
    "name",
    [
        "author",
        "design",
        "keyword",
        "sort_key",
        "data.prompt_key",
        "monkey",
        "passage",
        "TOKENIZERS_PARALLELISM",
        "assignee",
        "passes",
        "bypass",
        "pass_at_k",
        # The working folders, not a MySQL password.
        "PWD",
        "OLDPWD",
        "auth_type",
        # Where a credential is kept, not the credential: a file's path, a variable's name.
        "HF_TOKEN_PATH",
        "RAY_AUTH_TOKEN_PATH",
        "POSTGRES_PASSWORD_FILE",
        "reward.remote.auth_env",
        # A tokenizer's special tokens: tokens of its vocabulary.
        "pad_token",
        "tokenizer.pad_token",
        "eos_token",
        "additional_special_tokens",
        "added_tokens_decoder",
        # Exceptions, whose message follows their name on a traceback's last line.
        "KeyError",
        "InvalidTokenError",
        # A list of keys (verlite metrics --keys); in a URL's query any key is a credential.
        "keys",
    ],
)
def test_names_that_only_contain_a_credential_word_are_not_credential_named(name: str) -> None:
    assert not credential_named(name)


def test_query_parameters_are_credentials_by_their_names_parts() -> None:
    url = "https://mlflow.example/api?author=me&design=b&keyword=x&apiKey=0123&sig=ab&X-Api-Key=c"
    assert secret_query_names(url) == ["apiKey", "sig", "X-Api-Key"]
    # In a query any key is a credential's name (Azure's subscription key, OAuth's consumer key).
    keys = "https://apim.example/score?subscription-key=0&consumer_key=1&keys=2&monkey=3"
    assert secret_query_names(keys) == ["subscription-key", "consumer_key", "keys"]
    assert not carries_secret("trainer.mlflow_tracking_uri", "https://mlflow.example/?author=me")


def test_a_count_of_tokens_in_a_query_is_shown_as_a_config_s_is() -> None:
    # ?max_tokens= names a count, as the config key max_tokens does (holds_credential): its
    # number is no credential, in a message, on a job's command line or in a verifier's URL.
    url = "http://127.0.0.1:8000/score?max_tokens=512&max_new_tokens=64&token=abcdef123"
    assert redact_text(f"POST {url} failed") == (
        "POST http://127.0.0.1:8000/score?max_tokens=512&max_new_tokens=64&token=*** failed"
    )
    assert secret_query_names(url) == ["token"]
    assert not carries_secret("reward.remote.url", url.removesuffix("&token=abcdef123"))
    # Not a number: masked as any value of a credential-named parameter.
    assert redact_text("/x?max_tokens=sk-abcdef12") == "/x?max_tokens=***"
    # A name is read by its parts, as credential_named reads it: an API's camelCase or
    # kebab-case count is one too (it was masked, and such a verifier URL refused).
    counts = "http://127.0.0.1:8000/score?maxTokens=512&max-new-tokens=64&maxOutputTokens=8"
    assert redact_text(counts) == counts and secret_query_names(counts) == []
    assert not carries_secret("reward.remote.url", counts)
    for url in ("/x?tokens=12345678", "/x?token=12345678", "/x?token_count=12345678"):
        assert redact_text(url) == url.split("=")[0] + "=***"  # a bare or unknown count: masked


def test_a_variable_naming_a_credentials_file_carries_no_credential(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not carries_secret("HF_TOKEN_PATH", "/etc/hf/token")
    assert carries_secret("HF_TOKEN", "hf_0123456789abcdef")
    # Its path is shown in messages: it is not masked as the credential it names would be.
    monkeypatch.setenv("HF_TOKEN_PATH", "/etc/hf/token")
    assert redact_text("read /etc/hf/token") == "read /etc/hf/token"


def test_counts_of_tokens_and_token_ids_on_a_command_line_carry_no_credential() -> None:
    for key, value in [
        ("model.logits_chunk_tokens", "512"),
        ("actor.max_token_len_per_worker", "4096"),
        ("rollout.stop_token_ids", "[3, 151645]"),
        ("rollout.stop_token_ids", "[]"),
    ]:
        assert not carries_secret(key, value), (key, value)
    assert carries_secret("rollout.stop_token_ids", "[sk-live-123456]")
    assert carries_secret("reward.api_token", "12345678")


def test_an_error_line_shows_the_token_ids_it_refuses() -> None:
    # A mistyped id of 8 digits or more (the line read up to its ']', '[99999999') was shown as
    # 'rollout.stop_token_ids=***]'.
    for line in [
        "rollout.stop_token_ids=[99999999]: [99999999] outside the model's vocabulary",
        "rollout.stop_token_ids=[1516450, 151643]: [1516450] outside the model's vocabulary",
    ]:
        assert redact_text(line) == line
    assert redact_text("rollout.stop_token_ids=[sk-live-123456]") == "rollout.stop_token_ids=***]"


def test_a_command_line_setting_that_holds_a_known_secret_carries_one() -> None:
    register_secret(SECRET)
    assert carries_secret("wandb.run_name", f"x{SECRET}")
    assert not carries_secret("wandb.run_name", "x")
    assert carries_secret("trainer.mlflow_tracking_uri", "http://u:p@host")


def test_error_messages_and_quoted_values_are_masked() -> None:
    register_secret(SECRET)
    assert SECRET not in str(UserError(f"bad {SECRET}"))
    assert SECRET not in str(RunFailure(f"failed: {SECRET}"))
    # Masked before the middle of a long value is cut out: no part of it on either side.
    quoted = shown("a" * 52 + SECRET + "b" * 60, 120)
    assert "***" in quoted and "51Hx" not in quoted and "sk-" not in quoted


def test_lines_written_in_pieces_are_masked_on_the_streams(
    capfd: pytest.CaptureFixture[str],
) -> None:
    register_secret(SECRET)
    with redacted_output():
        sys.stdout.write(SECRET[:5])
        print(SECRET[5:], "done")
        print(f"\r{SECRET} 1/2", end="", file=sys.stderr)
        sys.stderr.flush()
    out, err = capfd.readouterr()
    assert out == "*** done\n"
    assert err == "\r*** 1/2"
    assert not isinstance(sys.stdout, redaction._RedactedStream), "the streams are restored"


def test_log_records_are_masked(caplog: pytest.LogCaptureFixture) -> None:
    register_secret(SECRET)
    stream = io.StringIO()
    logger = logging.getLogger("verlite.test_redaction")
    with redacted_output(), caplog.at_level(logging.INFO):
        logger.info("token %s", SECRET)
        try:
            raise RuntimeError(f"server said {SECRET}")
        except RuntimeError:
            logger.exception("failed")
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter())
        for record in caplog.records:
            handler.handle(record)
    text = stream.getvalue()
    assert "token ***" in text and "server said ***" in text
    assert SECRET not in text


def test_what_log_handlers_made_before_write_is_masked(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # A handler made before, on the stream of then (as Ray's are, at its import).
    register_secret(SECRET)
    handler = logging.StreamHandler(sys.stderr)
    loggers = [logging.getLogger(f"verlite.test_redaction.{n}") for n in ("a", "b")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with redacted_output():
            loggers[0].warning("a %s", SECRET)
            loggers[1].warning("b %s", SECRET)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    err = capfd.readouterr().err
    assert err == "a ***\nb ***\n"


def test_a_log_call_whose_arguments_do_not_fit_its_message_still_logs() -> None:
    # Reported by the handler when it emits, as without masking; not raised at the call.
    make = redaction._redacted_record_factory(logging.LogRecord)
    record = make("verlite.x", logging.WARNING, __file__, 1, "b %s %s", ("one",), None)
    assert (record.msg, record.args) == ("b %s %s", ("one",))


def test_a_secret_in_the_config_is_no_change_to_a_resumed_run(tmp_path: Path) -> None:
    # The checkpoint holds the config masked (as the trainer saves it): "***" is no change.
    register_secret(SECRET)
    config = {
        "trainer": {"mlflow_tracking_uri": "http://me:pw@mlflow:5000"},
        "reward": {"remote": {"url": f"http://scorer/{SECRET}/score"}},
    }
    checkpoint = fake_checkpoint(tmp_path, 1, ["actor"], config=redact_config(config))
    prompts = {"records": 8, "sha256": "0" * 64}  # the checkpoint records none: any pass
    changed = check_resumable(
        checkpoint, config=config, workers={"actor": 1}, total_steps=2, train_set=prompts
    )
    assert changed.settings == []


def test_masking_twice_is_masking_once() -> None:
    # A message is masked where it is made and again on its way out: a credential ends at
    # a space or a quote, and a masked one is left as it is.
    text = "said 'Authorization: Basic dXNlcjpwYXNz then more' and 'bearer abc-123-xyz'"
    once = redact_text(text)
    assert once == "said 'Authorization: *** then more' and 'bearer ***'"
    assert redact_text(once) == once


def test_every_line_a_command_prints_is_masked(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `verlite metrics` prints the metric names a metrics.jsonl holds, whoever wrote it.
    monkeypatch.setenv("SCORER_API_KEY", "envsecret-42-value")
    records = [{"step": s, "reward/envsecret-42-value/mean": 0.5} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["metrics", str(tmp_path), "--keys", "reward/*"]) == 0
    out, err = capfd.readouterr()
    assert "reward/***/mean" in out
    assert "envsecret" not in out + err


def test_a_bug_s_traceback_is_masked(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not a UserError or RunFailure: the traceback is printed, masked, and the status is 1.
    def bug(args: object) -> int:
        raise KeyError(f"no field envsecret-42-value in {args!r}")

    monkeypatch.setenv("SCORER_API_KEY", "envsecret-42-value")
    monkeypatch.setattr(report, "cmd_metrics", bug)
    assert main(["metrics", str(tmp_path)]) == 1
    out, err = capfd.readouterr()
    assert "Traceback (most recent call last)" in err and 'KeyError: "no field *** in' in err
    assert "envsecret" not in out + err


def test_what_a_run_of_the_python_api_prints_is_masked(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import verlite
    import verlite.driver.run

    def run(cfg: object) -> Path:
        print("step 1 scored by envsecret-42-value")
        return tmp_path

    monkeypatch.setenv("SCORER_API_KEY", "envsecret-42-value")
    monkeypatch.setattr(verlite.driver.run, "run_training", run)
    assert verlite.train("configs/ppo_tiny.yaml", [f"trainer.output_dir={tmp_path}"]) == tmp_path
    assert capfd.readouterr().out == "step 1 scored by ***\n"


def test_lines_ray_forwards_from_workers_are_masked(
    local_ray: object, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def say(text: str) -> None:
        print(text, flush=True)

    # A credential-named variable of the driver; the worker prints its value.
    monkeypatch.setenv("SCORER_API_KEY", "envsecret-42-value")
    seen = ""
    with redacted_output():
        ray.get(say.remote("worker says envsecret-42-value"))
        # Ray forwards a worker's lines to the driver in the background: wait for this one.
        deadline = time.monotonic() + 60
        while "worker says" not in seen and time.monotonic() < deadline:
            time.sleep(0.1)
            out, err = capfd.readouterr()
            seen += out + err
    assert "worker says ***" in seen
    assert "envsecret" not in seen


def _worker_with_a_key(worker: type, role: str) -> Any:
    """A Ray actor of ``worker`` (a ``Worker``) whose environment holds a credential-named
    variable, as a cluster's nodes give one (a Kubernetes secret's); the driver does not
    know it."""
    import ray

    env = {"env_vars": {"SCORER_API_KEY": "envsecret-42-value"}}
    return (
        ray.remote(worker)
        .options(num_cpus=0, runtime_env=env)
        .remote(role=role, rank=0, world_size=1, torch_threads=1)
    )


def test_a_worker_masks_what_ray_writes_to_its_log_files(local_ray: object) -> None:
    import ray

    from verlite.controller import Worker

    class Talker(Worker):
        def say(self, text: str) -> int:
            print(text, flush=True)
            logging.getLogger("verlite.test").warning(text)
            return os.getpid()

    talker = _worker_with_a_key(Talker, "talker")
    try:
        pid = ray.get(talker.say.remote("worker says envsecret-42-value"))
    finally:
        ray.kill(talker)
    # What Ray keeps of the worker's stdout and stderr on its node, beside forwarding it.
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    written = "".join(p.read_text(errors="replace") for p in logs.glob(f"worker-*-{pid}.*"))
    assert written.count("worker says ***") == 2  # printed, and logged
    assert "envsecret" not in written


def test_a_worker_built_outside_ray_starts_none_and_leaves_the_streams() -> None:
    # As the tests and the spawned ranks of verlite.distributed build workers.
    code = (
        "import sys, ray; from verlite.controller import Worker; "
        "Worker(role='a', rank=0, world_size=1, torch_threads=1); "
        "print(ray.is_initialized(), type(sys.stdout).__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert done.stdout == "False TextIOWrapper\n"


def test_a_line_reads_the_environment_s_names_once_not_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each line a worker prints or logs is masked with its environment's credentials, whose
    # names were all parsed again for every line (a millisecond a line in a cluster node's
    # environment): parsed once, the names are looked up.
    monkeypatch.setenv("MY_SERVICE_API_KEY", "envsecret-42-value")

    class CountingSplit:
        calls = 0

        def split(self, name: str) -> list[str]:
            CountingSplit.calls += 1
            return parts.split(name)

    parts = redaction._PART_BOUNDARY
    monkeypatch.setattr(redaction, "_PART_BOUNDARY", CountingSplit())
    line = "step 3: actor/pg_loss=0.12 envsecret-42-value\n"
    assert redact_text(line) == "step 3: actor/pg_loss=0.12 ***\n"  # the names once
    CountingSplit.calls = 0
    for _ in range(3):
        assert redact_text(line) == "step 3: actor/pg_loss=0.12 ***\n"
    assert CountingSplit.calls == 0


def test_the_environment_is_read_again_once_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment's credentials are kept between lines, read again when a variable is
    # added, changed or removed after the first line (a Ray worker's runtime env, a test's).
    names: list[str] = []

    def counting(name: str) -> bool:
        names.append(name)
        return credential_named(name)

    monkeypatch.setattr(redaction, "credential_named", counting)
    monkeypatch.delenv("LATE_SERVICE_TOKEN", raising=False)
    assert redact_text("late-secret-value") == "late-secret-value"
    names.clear()
    assert redact_text("late-secret-value") == "late-secret-value"
    assert names == []  # unchanged: not walked again
    monkeypatch.setenv("LATE_SERVICE_TOKEN", "late-secret-value")
    assert redact_text("late-secret-value") == "***"
    monkeypatch.setenv("LATE_SERVICE_TOKEN", "other-secret-value")
    assert redact_text("late-secret-value other-secret-value") == "late-secret-value ***"
    monkeypatch.delenv("LATE_SERVICE_TOKEN")
    assert redact_text("other-secret-value") == "other-secret-value"


class _FailingWorker:
    """A worker's methods as they fail, the credential built at run time (a traceback
    quotes the source line that raised, which holds none)."""

    @staticmethod
    def make() -> type:
        from verlite.controller import Worker

        class Failing(Worker):
            def __init__(self, *, fail: bool = False, **kwargs: object) -> None:
                if fail:
                    raise ValueError("cannot load from " + os.environ["SCORER_API_KEY"])
                super().__init__(**kwargs)  # type: ignore[arg-type]

            def score(self, url: str) -> None:
                try:
                    raise TimeoutError(os.environ["SCORER_API_KEY"])
                except TimeoutError:  # the context; the cause another
                    failure = ConnectionError(f"cannot reach {url}")
                    failure.request = {"url": url}  # type: ignore[attr-defined]
                    failure.add_note(f"asked {url}")
                    raise failure from KeyError(os.environ["SCORER_API_KEY"])

            def read(self) -> None:
                Path("/nonexistent", os.environ["SCORER_API_KEY"]).read_text()

        class Subclass(Failing):
            pass

        return Subclass


def test_what_a_worker_raises_leaves_it_masked_with_its_type_and_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ray keeps a failed call's exception and the traceback it formats from it (its text in
    # the dashboard's task table, the pickled exception carried to the driver) as the worker
    # raised them: masked there, at the source, whoever prints them.
    import ray
    from ray.exceptions import RayTaskError

    monkeypatch.setenv("SCORER_API_KEY", "envsecret-" + "42-value")
    url = "https://h/score?token=" + "abc123" + "def"
    worker = _FailingWorker.make()(role="r", rank=0, world_size=1, torch_threads=1)
    with pytest.raises(ConnectionError) as raised:  # its own type, for whoever matches it
        worker.score(url)
    error = raised.value
    assert str(error) == "cannot reach https://h/score?token=***"
    assert error.request == {"url": "https://h/score?token=***"}  # type: ignore[attr-defined]
    assert isinstance(error.__cause__, KeyError) and error.__cause__.args == ("***",)
    assert isinstance(error.__context__, TimeoutError) and error.__context__.args == ("***",)
    assert error.__suppress_context__  # as raised: the cause shown, not the context
    # What Ray builds in the worker: the traceback (cause and notes in it), the error whole.
    text = "".join(traceback.format_exception(error))
    assert (
        "in score" in text
        and "KeyError: '***'" in text
        and "asked https://h/score?token=***" in text
    )
    stored = RayTaskError("score", text, error, proctitle="ray::Failing", pid=1, ip="127.0.0.1")
    for what in (text, str(stored), ray.cloudpickle.dumps(stored).decode("latin-1")):
        assert "envsecret" not in what and "abc123def" not in what
    # A built-in exception's own fields (an OSError's file name), its type kept.
    with pytest.raises(FileNotFoundError, match=r"'/nonexistent/\*\*\*'"):
        worker.read()
    # The constructor's failure, which Ray keeps as the actor's death.
    with pytest.raises(ValueError, match=r"^cannot load from \*\*\*$"):
        _FailingWorker.make()(fail=True)


def test_masking_what_workers_raise_keeps_their_classes_method_order() -> None:
    # As ActorWorker(TrainingWorker, PolicyWorker): the constructor of the second base runs,
    # not one the first base only inherits.
    from verlite.controller import Worker

    class Trains(Worker):
        def update(self) -> None: ...

    class Holds(Worker):
        def __init__(self, *, cfg: str, **kwargs: object) -> None:
            super().__init__(**kwargs)  # type: ignore[arg-type]
            self.cfg = cfg

    class Both(Trains, Holds):
        pass

    assert Both(cfg="c", role="r", rank=0, world_size=1, torch_threads=1).cfg == "c"


def test_an_exception_whose_text_masking_cannot_reach_becomes_a_masked_runtime_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SCORER_API_KEY", "envsecret-" + "42-value")

    class Reply:
        text = "denied for " + os.environ["SCORER_API_KEY"]

    class ServiceError(Exception):
        def __init__(self, reply: Reply) -> None:
            super().__init__()
            self.reply = reply

        def __str__(self) -> str:
            return self.reply.text

    try:
        raise ServiceError(Reply())
    except ServiceError as error:
        masked = redaction.redact_exception(error)
    assert type(masked) is RuntimeError
    assert str(masked).endswith("ServiceError: denied for ***")
    assert masked.__traceback__ is not None and "envsecret" not in "".join(
        traceback.format_exception(masked)
    )
    # As the cause of another, replaced there; a context shown beside the cause stays shown.
    outer = ValueError("scoring failed")
    outer.__cause__, outer.__context__ = ServiceError(Reply()), KeyError("k")
    outer.__suppress_context__ = False
    assert redaction.redact_exception(outer) is outer
    assert str(outer.__cause__).endswith("ServiceError: denied for ***")
    assert outer.__suppress_context__ is False


def test_an_exception_holding_named_tuples_and_dict_subclasses_is_masked_in_them() -> None:
    # A named tuple is rebuilt from its fields, not from one iterable (its constructor's
    # arguments are the fields): masking one raised a TypeError in the worker's stead.
    # What holds no credential stays the very object, of its own type. A mapping's text under
    # a credential's name is masked whatever it is (no one told verlite of it), in a copy.
    from collections import OrderedDict, namedtuple

    Request = namedtuple("Request", "url timeout")
    url = "https://h/score?token=" + "abc123" + "def"
    error = ConnectionError("cannot reach the scorer", Request(url, 5))
    error.request = Request(url, 5)  # type: ignore[attr-defined]
    error.headers = OrderedDict(accept="json")  # type: ignore[attr-defined]
    headers = error.headers  # type: ignore[attr-defined]
    login = OrderedDict(user="alice", password="hunter2-" + "unknown")
    error.login = login  # type: ignore[attr-defined]
    assert redaction.redact_exception(error) is error
    shown_login = error.login  # type: ignore[attr-defined]
    masked_login = shown_login == {"user": "alice", "password": "***"}
    assert masked_login and type(shown_login) is OrderedDict, "a password is shown"
    unchanged = login["password"] == "hunter2-" + "unknown"
    assert unchanged, "the caller's own mapping was changed"
    masked = Request("https://h/score?token=***", 5)
    assert error.args == ("cannot reach the scorer", masked)
    assert error.request == masked and type(error.request) is Request  # type: ignore[attr-defined]
    assert error.headers is headers  # type: ignore[attr-defined]


class _Client:
    """An API client as SDKs hold one: its key, and settings that refer back to it."""

    def __init__(self) -> None:
        self.api_key = "sk-" + "unknown-client-key"
        self.settings = {"token": "tok-" + "unknown-setting", "client": self}


def test_mappings_with_credentials_that_refer_to_each_other_are_masked_in_one_copy() -> None:
    # Two mappings holding a credential's name, each reachable from the other (an object's
    # state and a dict that refers back to the object): each was copied by a pickle of its
    # own, which met the other and copied it again, without end: a RecursionError after
    # pickling the whole object graph once per level (minutes for one holding a large
    # body), the exception replaced by a RuntimeError of its text.
    error = ConnectionError("cannot reach the scorer")
    client = _Client()
    error.client = client  # type: ignore[attr-defined]
    assert redaction.redact_exception(error) is error, "the error was replaced"
    shown_client = error.client  # type: ignore[attr-defined]
    assert type(shown_client) is _Client and shown_client is not client
    assert shown_client.api_key == "***" and shown_client.settings["token"] == "***"
    assert shown_client.settings["client"] is shown_client, "the copy lost its cycle"
    unchanged = client.api_key == "sk-" + "unknown-client-key"
    unchanged &= client.settings["token"] == "tok-" + "unknown-setting"
    assert unchanged, "the caller's own objects were changed"
    login: dict[str, object] = {"password": "hunter2-" + "unknown"}
    login["self"] = {"api_key": "key-" + "unknown-value", "login": login}
    masked = redaction.redact_values(login)
    assert masked["password"] == "***" and masked["self"]["api_key"] == "***"
    assert masked["self"]["login"] is masked


def test_an_exception_masking_cannot_walk_becomes_a_masked_runtime_error_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Masking that fails itself (here on an object whose masked copy cannot be rebuilt: its
    # pickle leaves out what its constructor needs) must not leave the worker with its own
    # error in the exception's stead: Ray would show that one, and with it, as its context,
    # the worker's exception unmasked.
    from verlite.controller import Worker

    monkeypatch.setenv("SCORER_API_KEY", "envsecret-" + "42-value")

    class Reply:
        def __init__(self, text: str) -> None:
            self.text = text

        def __reduce__(self) -> tuple[type, tuple[()]]:
            return Reply, ()

    class Holding(Worker):
        def __init__(self, *, nested: bool = False, **kwargs: object) -> None:
            super().__init__(**kwargs)  # type: ignore[arg-type]
            self.nested = nested

        def score(self) -> None:
            error = ValueError("cannot reach " + os.environ["SCORER_API_KEY"])
            failing = error
            if self.nested:  # the object in an exception held by the one raised, not shown
                failing = error.reason = KeyError("scorer")  # type: ignore[attr-defined]
            failing.trail = [Reply("denied"), "https://h?token=" + "abc123def"]  # type: ignore[attr-defined]
            raise error from KeyError(os.environ["SCORER_API_KEY"])

    for nested in (False, True):
        worker = Holding(nested=nested, role="r", rank=0, world_size=1, torch_threads=1)
        with pytest.raises(RuntimeError) as raised:
            worker.score()
        error = raised.value
        assert str(error) == "ValueError: cannot reach ***"
        assert error.__cause__ is None and error.__context__ is None
        text = "".join(traceback.format_exception(error))
        assert "in score" in text and "envsecret" not in text


def _held(secrets: tuple[str, ...], *values: object) -> bool:
    """Whether any of ``secrets`` is in what ``values`` show (their reprs, so bytes too):
    asserted before any comparison, so a failing test's message shows no credential."""
    shown = " ".join(map(repr, values))
    return any(secret in shown for secret in secrets)


@contextlib.contextmanager
def _echoing_server() -> Iterator[int]:
    """A real HTTP server on 127.0.0.1 (its port) that answers 403 quoting the request's path
    and X-Key header, as some services do."""
    import http.server

    class Echo(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(403)
            self.end_headers()
            self.wfile.write(f"denied: {self.path} {self.headers['X-Key']}".encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def test_what_an_exception_s_objects_carry_is_masked_as_ray_pickles_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An HTTP library's error holds the response and the request (their URLs, headers, body
    # that a server may echo): Ray pickles all of it to the driver, where `e.response.url`
    # or `e.request.headers` is one print away. A real requests error from a real server.
    # Headers named like credentials are masked whatever their values (a key no one told
    # verlite of, HTTP basic authentication's encoded password).
    requests = pytest.importorskip("requests")
    import ray

    key = "envsecret-" + "42-value"
    monkeypatch.setenv("SCORER_API_KEY", key)
    headers = {"X-Key": key, "X-Api-Key": "unknown-key-value"}
    with _echoing_server() as port:
        url = f"http://127.0.0.1:{port}/score?token=abc123def456"
        reply = requests.get(url, headers=headers, auth=("alice", "basic-pass"), timeout=30)
        with pytest.raises(requests.HTTPError) as raised:
            reply.raise_for_status()
    error = raised.value
    kept = redaction.redact_exception(error) is error
    assert kept, "the error was replaced"  # its type and all it carries kept
    basic = reply.request.headers["Authorization"].split()[1]
    secrets = ("abc123def456", key, "unknown-key-value", basic)
    shipped = ray.cloudpickle.dumps(error)
    fields = (error.response.url, error.request.url, error.request.headers)
    leaked = _held(secrets, shipped, *fields, error.response.content)
    assert not leaked, "a credential is in the pickled exception or its fields"
    masked_url = f"http://127.0.0.1:{port}/score?token=***"
    assert error.response.url == masked_url and error.request.url == masked_url
    sent = error.request.headers
    assert (sent["X-Key"], sent["X-Api-Key"], sent["Authorization"]) == ("***",) * 3
    assert error.response.request.headers["Authorization"] == "***"
    assert error.response.content == b"denied: /score?token=*** ***"
    assert error.response.status_code == 403
    # The worker's own objects are copied, not changed: its session may still use them.
    unchanged = error.response is not reply and reply.url == url
    unchanged &= reply.request.headers["X-Api-Key"] == "unknown-key-value"
    assert unchanged, "the worker's own response was changed"
    # No connection: urllib3's error in it holds its connection pool (locks, which pickle
    # cannot carry; its own pickle leaves the pool out); the error stays a ConnectionError.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    closed_url = f"http://127.0.0.1:{port}/score?token=abc123def456"
    with pytest.raises(requests.ConnectionError) as refused:  # its line quotes no credential
        requests.get(closed_url, timeout=30)
    error = refused.value
    kept = redaction.redact_exception(error) is error
    assert kept, "the error was replaced"
    text = "".join(traceback.format_exception(error))
    leaked = _held(secrets, text, ray.cloudpickle.dumps(error))
    assert not leaked, "a credential is in the error's text or its pickle"
    assert "/score?token=***" in text


def test_an_object_pickle_refuses_in_any_way_leaves_the_error_masked_in_its_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A ctypes pointer refuses pickling with a ValueError (a lock with a TypeError): masking
    # leaves such a value as it is, not the whole error replaced by a RuntimeError, nor a
    # user error failing to be built.
    key = "envsecret-" + "77-value"
    monkeypatch.setenv("SCORER_API_KEY", key)
    error = ValueError(f"bad reply with {key}")
    error.pointer = ctypes.pointer(ctypes.c_int(1))  # type: ignore[attr-defined]
    kept = redaction.redact_exception(error)
    assert kept is error and isinstance(kept, ValueError), "the error was replaced"
    assert key not in str(kept) and str(kept) == "bad reply with ***"
    held = [ctypes.pointer(ctypes.c_int(1)), f"with {key}"]  # left as it is: Ray cannot carry it
    assert redaction.redact_values(held) is held
    # A user error holding one is still built (masking raised from its constructor).
    assert UserError("cannot use it", ctypes.pointer(ctypes.c_int(2))).args[0] == "cannot use it"


def test_a_failed_command_s_output_and_arguments_are_masked_as_bytes_and_text(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A CalledProcessError carries the command (text or bytes) and its output as bytes.
    key = "envsecret-" + "42-value"
    monkeypatch.setenv("SCORER_API_KEY", key)
    command = [
        sys.executable,
        "-c",
        "import os, sys; k = os.environ['SCORER_API_KEY']; print('out', k); "
        "print('err', k, file=sys.stderr); sys.exit(3)",
        key.encode(),
    ]
    with pytest.raises(subprocess.CalledProcessError) as raised:
        subprocess.run(command, capture_output=True, check=True, timeout=60)
    error = raised.value
    kept = redaction.redact_exception(error) is error
    assert kept, "the error was replaced"
    text = "".join(traceback.format_exception(error))
    leaked = _held((key,), text, error.cmd, error.stdout, error.stderr, pickle.dumps(error))
    assert not leaked, "a credential is in the exception, its text or its pickle"
    assert error.returncode == 3 and error.cmd[:3] == command[:3] and error.cmd[3] == b"***"
    assert error.stdout == b"out ***\n" and error.stderr == b"err ***\n"


def test_an_exception_group_s_members_are_masked_one_by_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A group's members (a batch's concurrent failures), each with its own chain, are all in
    # the traceback Ray formats and in what it pickles; one whose own text masking cannot
    # reach is replaced, in a group made anew with the same message, chain and notes.
    import ray

    key = "envsecret-" + "42-value"
    monkeypatch.setenv("SCORER_API_KEY", key)

    class Opaque(Exception):
        def __str__(self) -> str:
            return "denied for " + os.environ["SCORER_API_KEY"]

    def failing(error: BaseException, cause: BaseException | None = None) -> BaseException:
        try:
            raise error from cause
        except BaseException as raised:
            return raised

    members = [
        failing(ValueError(f"batch 0: {key}"), KeyError(key)),
        failing(Opaque()),
        failing(ExceptionGroup("nested", [TimeoutError(key.encode())])),
    ]
    try:
        raise ExceptionGroup("scoring failed", members) from KeyError(key)
    except ExceptionGroup as raised:
        raised.add_note(f"asked with {key}")
        group = raised
    masked = redaction.redact_exception(group)
    text = "".join(traceback.format_exception(masked))
    leaked = _held((key,), text, ray.cloudpickle.dumps(masked), masked.exceptions, members)
    assert not leaked, "a credential is in the group, its text or its pickle"
    regrouped = type(masked) is ExceptionGroup and masked is not group
    assert regrouped, "not a group made anew"  # a member was replaced
    assert str(masked) == "scoring failed (3 sub-exceptions)"
    assert masked.__notes__ == ["asked with ***"]
    assert masked.__cause__ is group.__cause__ and masked.__cause__.args == ("***",)
    assert masked.__traceback__ is group.__traceback__
    first, opaque, nested = masked.exceptions
    assert first is members[0] and first.args == ("batch 0: ***",)
    assert first.__cause__.args == ("***",)  # type: ignore[union-attr]
    assert type(opaque) is RuntimeError and str(opaque).endswith("Opaque: denied for ***")
    assert nested is members[2] and nested.exceptions[0].args == (b"***",)  # type: ignore[attr-defined]
    assert "batch 0: ***" in text and "Opaque: denied for ***" in text


def test_a_known_secret_is_masked_whole_whatever_characters_it_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The patterns end an unknown query value at "]", "}" or ", " (a list's or dict's repr
    # around the URL); a known value (a variable's, a registered one) is masked as a value
    # first, whole, wherever it appears, so no rest of it is left after the mask.
    monkeypatch.setenv("SCORER_API_KEY", "env]se, cret}42")
    register_secret("reg]is, tered}7")
    for key in ("env]se, cret}42", "reg]is, tered}7"):
        for text in (f"['https://h/?token={key}', 3]", f"{{url: https://h/?sig={key}}}", key):
            masked = redact_text(text)
            leaked = _held(("se, cret", "cret}42", "is, tered", "tered}7"), masked)
            assert not leaked, "a rest of a known secret is shown"
            assert masked.count("***") == 1


def test_a_config_url_s_credentials_are_masked_whole_in_its_record() -> None:
    # A config's URL holds its own credentials: the record masks them as values (a query
    # value with "]", "}" or ", " in it whole, not up to where the patterns stop).
    uri = "https://alice:pass]word-1@mlflow/?token=ab]cd, ef}gh&x=1&api_key=a+b%2Bcdefgh"
    record = redact_config({"trainer": {"mlflow_tracking_uri": uri}})
    shown_uri = record["trainer"]["mlflow_tracking_uri"]
    leaked = _held(("word-1", "cd, ef", "ef}gh", "cdefgh"), shown_uri)
    assert not leaked, "a rest of the URL's credentials is in the record"
    assert shown_uri == "https://***@mlflow/?token=***&x=1&api_key=***"


def test_a_loaded_config_s_url_credentials_are_masked_wherever_they_appear() -> None:
    # Known once the config is loaded (the driver's first step), they are masked in every
    # message, as a registered secret is: a library's error quoting the URL in a list, or
    # quoting the value alone.
    uri = "https://alice:pass]word-1@mlflow/?token=ab]cd, ef}gh&x=1"
    unknown_before = redact_text("denied ab]cd, ef}gh") == "denied ab]cd, ef}gh"
    load_config(
        Path(__file__).parents[1] / "configs" / "ppo_tiny.yaml",
        {"trainer.mlflow_tracking_uri": uri},
    )
    for text in (f"cannot log to {[uri, 5]}", "denied: ab]cd, ef}gh for pass]word-1"):
        masked = redact_text(text)
        leaked = _held(("word-1", "ab]cd", "ef}gh"), masked)
        assert not leaked, "a credential of the config's URL is shown"
    assert unknown_before  # the test's own premise


def test_an_http_error_a_worker_raises_reaches_the_driver_masked_in_its_objects(
    local_ray: object,
) -> None:
    # Through Ray itself: the credential is in the worker's environment only (the driver
    # cannot mask it), and the driver gets the error as Ray carries it, its type kept.
    requests = pytest.importorskip("requests")
    import ray

    from verlite.controller import Worker

    class Scorer(Worker):
        def score(self, port: int) -> None:
            key = os.environ["SCORER_API_KEY"]
            url = f"http://127.0.0.1:{port}/score?token={key}"
            requests.get(url, headers={"X-Key": key}, timeout=30).raise_for_status()

    scorer = _worker_with_a_key(Scorer, "scorer")
    try:
        with _echoing_server() as port, pytest.raises(requests.HTTPError) as raised:
            ray.get(scorer.score.remote(port))
    finally:
        ray.kill(scorer)
    error = raised.value
    cause = error.cause  # type: ignore[attr-defined]
    text = "".join(traceback.format_exception(error))
    leaked = _held(("envsecret",), text, ray.cloudpickle.dumps(cause), cause.request.headers)
    assert not leaked, "a credential reached the driver"
    assert cause.response.url == f"http://127.0.0.1:{port}/score?token=***"
    assert cause.response.content == b"denied: /score?token=*** ***"
