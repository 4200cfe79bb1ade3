"""What every section model is built from: the :class:`Section` base (frozen, strict, unknown
keys refused) and the field types the sections share."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict

# Every size and count fits a 32-bit int: a 29-digit step count is a typo, not a plan.
MAX_INT = 2**31 - 1
PositiveInt = Annotated[int, Field(gt=0, le=MAX_INT)]
NonNegativeInt = Annotated[int, Field(ge=0, le=MAX_INT)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


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


# A list (what YAML and JSON give) for a tuple field; its items stay strict.
AsList = Strict(False)


class Section(BaseModel):
    # strict: every value has the type its field names, from a file, the command line and the
    # API alike; nothing is coerced (True is no 1, 2.5 or "3" no int, 3 no string). An int
    # is a float (lr: 1), and a tuple field takes a list (AsList). inf and nan are refused
    # everywhere: no setting means anything with them, and torch would only report them
    # after Ray and the workers had started.
    model_config = ConfigDict(
        frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False, strict=True
    )
