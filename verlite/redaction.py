"""What no log, message, config record or job command line may show: credentials. The
secret-named config fields, ``user:pass@`` in URLs, authorization headers and bearer tokens,
and the values of credential-named environment variables; the one owner of those rules,
used by every sink (the loggers, the CLI's error line, the job commands, the remote
verifier's messages)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Config keys whose values are never logged, whatever the section: a credential field, should
# one be added (the config names environment variables that hold them: reward.remote.auth_env).
_SECRET_KEY = re.compile(r"token|secret|password|passwd|api_key|credential", re.IGNORECASE)
MIN_SECRET_LENGTH = 8
# user:password@ in a URL such as an MLflow tracking URI or a Ray address.
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def redact_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without credentials: secret-named fields and ``user:pass@`` in URLs masked."""
    clean: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            clean[key] = redact_config(value)
        elif _SECRET_KEY.search(str(key)) and value is not None:
            clean[key] = "***"
        else:
            clean[key] = redact_url(value) if isinstance(value, str) else value
    return clean


def carries_secret(key: str, value: str) -> bool:
    """Whether a config setting holds a credential: a secret-named key, or a URL with ``user:pass@``."""
    return bool(value) and bool(_SECRET_KEY.search(key) or _URL_CREDENTIALS.search(value))


def redact_url(text: str) -> str:
    """``text`` with the ``user:pass@`` of any URL in it masked."""
    return _URL_CREDENTIALS.sub("***@", text)


# An HTTP authorization header or bearer credential quoted in a message (a server that
# echoes the request back in its error).
_AUTH_HEADER = re.compile(r"(?i)((?:x-ray-)?authorization\W{0,3}\s*[:=]\s*)(\S+(?:\s+\S+)?)")
_BEARER = re.compile(r"(?i)(bearer\s+)\S+")


def secrets_in_environment() -> list[str]:
    """Values of environment variables named like credentials (``RAY_AUTH_TOKEN``,
    ``MLFLOW_TRACKING_PASSWORD``, ``WANDB_API_KEY``, ...): what no message may show, whoever
    wrote it (a user's reward function may quote one in its exception). Values shorter than
    8 characters are switches such as ``HF_HUB_DISABLE_IMPLICIT_TOKEN=1``, not credentials:
    masking them would garble every message."""
    return [
        value
        for name, value in os.environ.items()
        if _SECRET_KEY.search(name) and len(value) >= MIN_SECRET_LENGTH
    ]


def redact_text(text: str, secrets: Sequence[str] = ()) -> str:
    """``text`` (a server's answer, an error message) without credentials: the given
    ``secrets``, authorization headers, bearer tokens and ``user:pass@`` in URLs masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = _AUTH_HEADER.sub(r"\1***", text)
    return redact_url(_BEARER.sub(r"\1***", text))
