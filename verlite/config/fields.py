"""What every section model is built from: the :class:`Section` base (frozen, strict, unknown
keys refused) and the field types the sections share."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import torch
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict

if TYPE_CHECKING:
    from verlite.config.schema import Config

# Every size and count fits a 32-bit int: a 29-digit step count is a typo, not a plan.
MAX_INT = 2**31 - 1
PositiveInt = Annotated[int, Field(gt=0, le=MAX_INT)]
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_INT)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
# Every timeout and wait is at most a day: what the clocks it is handed to can hold is less
# than "forever" (1e10 s overflows a queue's or a socket's timeout, and 25 days an epoll
# wait's, as an OverflowError inside a worker), and no call is meant to take longer.
MAX_SECONDS = 86_400.0
Seconds = Annotated[float, Field(gt=0.0, le=MAX_SECONDS)]


def _path(value: str) -> str:
    if "\0" in value:
        raise ValueError("a path cannot hold a NUL byte")
    if value.startswith("~"):
        # A shell expands ~ only at a word's start, so trainer.output_dir=~/runs reaches
        # verlite as is, and it would make a folder named "~" here.
        raise ValueError("verlite does not expand '~'; write the home folder out (e.g. $HOME/...)")
    return value


# A file or folder on the machine that runs verlite.
PathStr = Annotated[NonEmptyStr, AfterValidator(_path)]


def _gpus(value: Any) -> Any:
    """``auto``: one GPU per worker when this machine has a CUDA GPU (the workers of an
    embedded Ray run here), none otherwise; any other value a number >= 0, checked here in
    one message rather than one per member of the field's union."""
    if value == "auto":
        return 1.0 if torch.cuda.is_available() else 0.0
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0:
        raise ValueError("expected the GPUs of one worker (a number >= 0), or auto")
    return value


@dataclass(frozen=True)
class ResolvedAtLoad:
    """Field metadata: a word a user may write for the field besides a value of its type,
    which the field's validator turns into one at load. A loaded config holds the type (what
    its readers see); the reference (``config.reference``) lists the word with it."""

    word: str


# The GPUs of one worker: a number, or auto, resolved when the field is validated, so that a
# loaded config holds the number (and the logged config the number the run used).
GpusPerWorker = Annotated[float, Field(ge=0.0), ResolvedAtLoad("auto"), BeforeValidator(_gpus)]
OptionalGpusPerWorker = Annotated[
    Annotated[float, Field(ge=0.0), ResolvedAtLoad("auto")] | None,
    BeforeValidator(lambda value: None if value is None else _gpus(value)),
]


def _scalar(value: Any) -> Any:
    """A template variable's value: one message rather than one per member of the union
    (a list or a mapping is no variable verlite passes)."""
    if value is not None and not isinstance(value, str | int | float | bool):
        raise ValueError("expected a string, a number, true, false or null")
    return value


# A chat template variable's value (data.chat_template_kwargs).
TemplateValue = Annotated[str | int | float | bool | None, BeforeValidator(_scalar)]


# A list (what YAML and JSON give) for a tuple field; its items stay strict.
AsList = Strict(False)


def _distinct(value: tuple[Any, ...]) -> tuple[Any, ...]:
    repeated = sorted({str(item) for item in value if value.count(item) > 1})
    if repeated:
        raise ValueError(f"names {', '.join(repeated)} more than once; give each once")
    return value


# A tuple of names that each mean one thing: a name given twice is a mistake (two JSONL
# loggers would write every step twice to one metrics.jsonl).
Distinct = AfterValidator(_distinct)


class Section(BaseModel):
    # strict: every value has the type its field names, from a file, the command line and the
    # API alike; nothing is coerced (True is no 1, 2.5 or "3" no int, 3 no string). An int
    # is a float (lr: 1), and a tuple field takes a list (AsList). inf and nan are refused
    # everywhere: no setting means anything with them, and torch would only report them
    # after Ray and the workers had started.
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False, strict=True
    )


@dataclass(frozen=True)
class Needs:
    """Settings that take effect only when a feature is on, declared by each section module
    beside its fields (its ``NEEDS``) and gathered by :mod:`verlite.config.inert`: the
    ``fields`` (dotted; a section stands for every field under it) do nothing unless
    ``active(cfg)``; ``unless`` says what turns them on, as the start-up line and
    docs/config.md say it; ``example`` holds overrides that turn it on (docs/config.md shows
    them, and the tests check each declaration with them)."""

    fields: tuple[str, ...]
    unless: str
    active: Callable[[Config], bool]
    example: Mapping[str, Any]


def fields_but(model: type[BaseModel], section: str, switch: str) -> tuple[str, ...]:
    """The dotted fields of ``model`` at ``section`` except its ``switch``: what a feature
    whose section holds its own switch leaves without effect when it is off."""
    return tuple(f"{section}.{name}" for name in model.model_fields if name != switch)
