"""A user's YAML file read as one mapping: a safe loader (no tags that build Python objects;
``1e-3`` is a number), one line for every problem, a key set twice refused, and aliases
bounded.

YAML aliases share nodes, so a few hundred bytes can describe a structure of billions of
values ("billion laughs"): every later walk over it (validation, error messages, logging)
would take that long. The composed node graph is measured once, each shared node counted
once per place it is used but computed once, and a file that expands past
:data:`MAX_VALUES` is refused before anything reads the values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from verlite.errors import UserError
from verlite.user_files import read_text


class SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads numbers and booleans as YAML 1.2 does: ``1e-3`` is a
    number (YAML 1.1 needs a dot, ``1.0e-3``, and would otherwise give the string "1e-3",
    which a number field refuses), and only true and false are booleans (YAML 1.1 also reads
    yes, no, on and off as booleans, which would turn ``enable: yes`` into true
    behind the user's back: config fields are never coerced, so it is refused as a string)."""


_BOOL = "tag:yaml.org,2002:bool"
SafeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
SafeLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_text(text: str) -> Any:
    """The value of YAML ``text`` read with :class:`SafeLoader` (a config override's value);
    a value that cannot be built (``2020-13-45`` as a date, ``!!int x``) is a YAML error."""
    try:
        value = yaml.load(text, Loader=SafeLoader)
    except (ValueError, TypeError) as exc:  # what a constructor raised
        problem = f"a value cannot be built: {exc}"
        raise yaml.constructor.ConstructorError(None, None, problem) from None
    _refuse_unspaced_pairs(value, set())
    return value


class UnspacedKey(yaml.constructor.ConstructorError):
    """Valid YAML that says something other than what was meant: ``{a:b}`` is the key ``a:b``."""


def _refuse_unspaced_pairs(value: Any, seen: set[int]) -> None:
    """Refuse a mapping key such as ``enable_thinking:false`` without a value: YAML reads
    ``{enable_thinking:false}`` as that one key (a colon separates only with a space after
    it), so the setting meant would be another name, or quietly unset. ``seen``: the
    containers walked already (an alias shares one)."""
    if id(value) in seen or not isinstance(value, (dict, list)):
        return
    seen.add(id(value))
    for key, item in value.items() if isinstance(value, dict) else enumerate(value):
        name, _, rest = key.partition(":") if isinstance(key, str) else ("", "", "")
        if item is None and name and rest:
            problem = (
                f"{key!r} is one key without a value, as YAML reads a colon without a space "
                f"after it; write {name}: {rest}"
            )
            raise UnspacedKey(None, None, problem)
        _refuse_unspaced_pairs(item, seen)


# Values a file may expand to, aliases counted where they are used: a run config has a few
# hundred, a runtime env a few thousand at most.
MAX_VALUES = 100_000
# Bytes a file may hold: a run config is a few KB. Reading stops there, so a device such as
# /dev/zero, or a pipe that never ends, is refused instead of filling the memory.
MAX_BYTES = 1 << 20


def read_mapping(
    path: str | Path,
    *,
    what: str,
    example: str,
    error: type[UserError] = UserError,
    empty_ok: bool = False,
) -> dict[str, Any]:
    """The mapping in the YAML file ``path``. ``what`` names the file in messages ("config
    file"), ``example`` says what the mapping holds ("of sections: model:, data:, ...");
    problems raise ``error`` with one line. A file without a document (no bytes, or blank
    lines and comments alone) is one: it is refused as empty unless ``empty_ok``, which
    reads it, and a null document, as {}."""
    shown = repr(str(path))
    text = read_text(path, what=what, error=error, max_bytes=MAX_BYTES)
    try:
        root = yaml.compose(text, Loader=SafeLoader)
        values = _expanded_size(root, {})
        if values > MAX_VALUES:
            raise error(
                f"{what} {shown} expands to {values:,} values through YAML aliases "
                f"(at most {MAX_VALUES:,}); write the values out instead of nesting aliases"
            )
        _refuse_duplicate_keys(root, (), set(), what=f"{what} {shown}", error=error)
        data = load_text(text)
    except RecursionError:
        raise error(f"{what} {shown} nests too deeply to read") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow: no mark
        line = text.count("\n", 0, exc.position) + 1
        raise error(
            f"{what} {shown} is not valid YAML at line {line}: {exc.reason} "
            f"(U+{exc.character:04X}); is it a text file?"
        ) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise error(f"{what} {shown} is not valid YAML{at}: {problem}") from None
    if data is None and empty_ok:
        return {}
    if root is None:
        raise error(
            f"{what} {shown} is empty (comments and blank lines aside); it must hold a "
            f"mapping {example}"
        )
    if not isinstance(data, dict):
        raise error(f"{what} {shown} must hold a mapping {example}, got {yaml_kind(data)}")
    return data


def field_path(parts: Iterable[str | int]) -> str:
    """Where a value sits in a user's YAML, as every message names it: mapping keys dotted, a
    list's items by index, ``trainer.loggers[2]``, ``pip.packages[0].name``."""
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


# A value's kind as YAML names it: what the user wrote, not Python's type ("a str").
_KINDS = {bool: "a boolean", str: "a string", int: "an integer", float: "a float"}


def yaml_kind(value: object) -> str:
    """``value``'s kind as YAML names it, with its article: "a mapping", "an integer",
    "null"."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return _KINDS.get(type(value), f"a {type(value).__name__}")


def _expanded_size(node: yaml.Node | None, sizes: dict[int, int]) -> int:
    """Values under ``node`` as if every alias were written out; each node computed once."""
    if node is None:
        return 0
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = 1  # a node that contains itself (a recursive alias) counts once
    if isinstance(node, yaml.MappingNode):
        total = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_size(item, sizes) for item in node.value)
    else:
        total = 1
    sizes[id(node)] = total
    return total


def _refuse_duplicate_keys(
    node: yaml.Node | None,
    where: tuple[str | int, ...],
    checked: set[int],
    *,
    what: str,
    error: type[UserError],
) -> None:
    """A key given twice in one mapping is an error: YAML would silently keep the last one.
    A node shared through aliases is checked once."""
    if node is None or id(node) in checked:
        return
    checked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            name = str(key.value)
            if name in seen:
                raise error(
                    f"{what} sets {field_path((*where, name))} twice "
                    f"(line {key.start_mark.line + 1}); remove one"
                )
            seen.add(name)
            _refuse_duplicate_keys(value, (*where, name), checked, what=what, error=error)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, (*where, i), checked, what=what, error=error)
