"""The configuration reference, ``docs/config.md``, generated from the models of
:mod:`verlite.config` (their docstrings and field descriptions), so it cannot drift from
what is validated: ``make docs`` rewrites it and a test checks that it is current.
"""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from verlite.config import MOVED_KEYS, Config
from verlite.config.fields import ResolvedAtLoad
from verlite.config.inert import NEEDS

HEADER = """# Configuration reference

Generated from the section models in `verlite/config/` by `make docs`; do not edit by hand.

A run config is one YAML file with the sections below; any field may also be set on the
command line as a dotted override, `section.field=value` (e.g. `actor.optim.lr=1e-5`).
A section set as a mapping (`trainer={total_steps: 2}`) merges into the file's section; a
mapping-valued field (`reward.combine`) is replaced. Values are never coerced: a whole number
field takes no `true`, `2.0` or `"3"`, a number field no `false` or string (an int is a
number), a string field no number; `1e-3` is a number, and only `true` and `false` are
booleans (`yes`, `no`, `on` and `off` are words, as in YAML 1.2). Unknown keys, wrong types,
out-of-range values, `inf` and `nan` are refused before anything starts, with one line
naming the field, the value and what is allowed; a key that moved is refused with one line
naming its new place (see "Moved keys" at the end). A setting that has no effect because
the feature it belongs to is off (`rollout.multi_turn.max_turns` without
`rollout.multi_turn.env`) is accepted, and a run names every such setting its file or
command line sets in one line at start-up, e.g. `config: rollout.multi_turn.max_turns has no
effect unless rollout.multi_turn.env is set` (see "Settings that need a feature" at the end).
"""


def config_reference() -> str:
    """The Markdown reference of every section and field."""
    lines = [HEADER]
    for name, field in Config.model_fields.items():
        _section(lines, name, _model_of(field), field.description or "")
    lines += [
        "## Settings that need a feature",
        "",
        "Set without their feature, these do nothing; a run names the ones its config sets "
        "(a section stands for every field in it).",
        "",
        "| settings | take effect only if | e.g. |",
        "|---|---|---|",
    ]
    lines += [
        f"| {', '.join(f'`{name}`' for name in needs.fields)} | {needs.unless} | "
        f"{' '.join(f'`{key}={_flow(value)}`' for key, value in needs.example.items())} |"
        for needs in NEEDS
    ]
    lines += ["", "## Moved keys", "", "| old key | now |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in MOVED_KEYS.items()]
    return "\n".join([*lines, ""])


def _section(lines: list[str], path: str, model: type[BaseModel], summary: str) -> None:
    doc = " ".join((model.__doc__ or "").split()) or summary
    lines += [f"## `{path}`", "", doc, ""]
    lines += ["| field | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        sub = _model_of(field)
        if sub is not None:
            nested.append((f"{path}.{name}", sub, field.description or ""))
            kind, default = "section", f"see `{path}.{name}`"
        else:
            kind = " ".join([_type_name(field.annotation), *_bounds(field.metadata)])
            default = _default(field)
        description = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{name}` | {kind} | {default} | {description} |")
    lines.append("")
    for sub_path, sub, sub_summary in nested:
        _section(lines, sub_path, sub, sub_summary)


def _flow(value: Any) -> str:
    """A value as an override writes it: ``true``, ``null``, ``[console, wandb]``."""
    if isinstance(value, list):
        return f"[{', '.join(map(_flow, value))}]"
    return "null" if value is None else json.dumps(value).strip('"')


def _model_of(field: FieldInfo) -> Any:
    annotation = field.annotation
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def _type_name(annotation: Any) -> str:
    """A short, readable type: ``int > 0``, ``"a" | "b"``, ``float | None``, ``list[str]``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return " ".join([_type_name(args[0]), *_bounds(args[1:])])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is tuple:
        return f"list[{_type_name(args[0])}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", re.sub(r"typing\.", "", str(annotation)))


def _bounds(metadata: Any) -> list[str]:
    """``> 0``, ``<= 1``, ``min length 1`` from pydantic constraint metadata, then ``| "auto"``
    for a word the field resolves at load (:class:`~verlite.config.fields.ResolvedAtLoad`)."""
    found = []
    for meta in metadata:
        if isinstance(meta, FieldInfo):  # Field(...) inside Annotated keeps its own metadata
            found += _bounds(meta.metadata)
            continue
        if isinstance(meta, ResolvedAtLoad):
            found.append(f"\\| {json.dumps(meta.word)}")
            continue
        for attr, text in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                found.append(f"{text} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None):
            found.append("non-empty")
    return found


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    return f"`{json.dumps(value if not isinstance(value, tuple) else list(value))}`"


if __name__ == "__main__":
    sys.stdout.write(config_reference())
