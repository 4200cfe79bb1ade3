"""Every field of the schema, found by walking it, so that a field added later is covered
too: a value of a kind it does not take, or outside what it can mean, is refused at load in
one line that names the field (a ``ConfigError``: exit 2 at the command line), never
accepted to fail inside a worker, never a traceback."""

import math
import selectors
import socket
import threading
import types
import typing
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from verlite.config import Config, ConfigError, load_config
from verlite.config.fields import MAX_INT, MAX_SECONDS

# Fields that take a value a rule below refuses elsewhere, and why.
EMPTY_TEXT_ALLOWED = {"data.system_prompt"}  # an empty string is an empty system turn


def _leaves(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            yield from _leaves(section, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def _kinds(annotation: Any) -> set[Any]:
    """The kinds of value a field's type takes: int, float, str, bool, list, dict."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in typing.get_args(annotation)))
    if origin is Literal:
        return {type(value) for value in typing.get_args(annotation)}
    if origin in (tuple, list):
        return {list}
    if origin is dict:
        return {dict}
    return {annotation}


def _section(annotation: Any) -> type[BaseModel] | None:
    args = typing.get_args(annotation) or (annotation,)
    return next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)


LEAVES = dict(_leaves(Config))
# A value of each kind YAML gives, as a file or the API hands it over.
VALUES = {
    int: -1,
    float: 0.5,
    str: "word",
    bool: True,
    list: [1, 2],
    dict: {"a": 1},
}


def _load(dotted: str, value: Any) -> Config:
    """The config with one field set as a YAML file (or the API) sets it."""
    raw: dict[str, Any] = {"data": {"task": "copy"}}
    *sections, leaf = dotted.split(".")
    section = raw
    for name in sections:
        section = section.setdefault(name, {})
    section[leaf] = value
    return load_config(raw)


def _refused(dotted: str, value: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _load(dotted, value)
    message = str(info.value)
    assert "\n" not in message, f"{dotted}={value!r}: errors are one line"
    assert dotted in message, f"{dotted}={value!r}: the error names the field: {message}"
    return message


def test_the_walk_finds_every_section_s_fields() -> None:
    assert {"trainer.total_steps", "actor.optim.lr", "rollout.multi_turn.tool_timeout_s"} <= set(
        LEAVES
    )
    assert len(LEAVES) > 100


@pytest.mark.parametrize("dotted", sorted(LEAVES))
def test_a_value_of_a_kind_the_field_does_not_take_is_refused_naming_it(dotted: str) -> None:
    kinds = _kinds(LEAVES[dotted].annotation)
    for kind, value in VALUES.items():
        if kind in kinds or (kind is int and float in kinds):  # an int is a float
            try:
                _load(dotted, value)  # may be refused, as a value: never a traceback
            except ConfigError as exc:
                assert "\n" not in str(exc)
            continue
        _refused(dotted, value)


@pytest.mark.parametrize(
    "dotted", sorted(d for d, f in LEAVES.items() if _kinds(f.annotation) & {int, float})
)
def test_a_number_field_refuses_nan_negatives_and_sizes_past_its_bound(dotted: str) -> None:
    kinds = _kinds(LEAVES[dotted].annotation)
    _refused(dotted, -1)
    if float in kinds:
        _refused(dotted, math.nan)
        _refused(dotted, math.inf)
    if int in kinds and float not in kinds:
        _refused(dotted, MAX_INT + 1)  # every size and count fits 32 bits
    if dotted.endswith("_s"):  # seconds: 1e10 overflows the clocks a timeout is handed to
        _refused(dotted, math.nextafter(MAX_SECONDS, math.inf))


@pytest.mark.parametrize(
    "dotted", sorted(d for d, f in LEAVES.items() if str in _kinds(f.annotation))
)
def test_a_text_field_refuses_the_empty_string(dotted: str) -> None:
    if dotted in EMPTY_TEXT_ALLOWED:
        return
    _refused(dotted, "")


def _item_kinds(annotation: Any) -> set[Any]:
    """What the items of a list or tuple field take (empty for any other field)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(_item_kinds(arg) for arg in args))
    if typing.get_origin(annotation) in (tuple, list) and args:
        return _kinds(args[0])
    return set()


NAME_LISTS = sorted(d for d, f in LEAVES.items() if _item_kinds(f.annotation) == {str})


def test_the_lists_of_names_are_found() -> None:
    assert {"trainer.loggers", "actor.lora.target_modules"} <= set(NAME_LISTS)


@pytest.mark.parametrize("dotted", NAME_LISTS)
def test_a_list_of_names_refuses_a_name_given_twice(dotted: str) -> None:
    """``trainer.loggers: [jsonl, jsonl]`` opened two writers of one metrics.jsonl: every
    step was written twice, and `verlite metrics` then refused the run's own record."""
    name = LEAVES[dotted].default[0]
    assert "more than once" in _refused(dotted, [name, name])


def test_the_longest_timeout_fits_every_clock_a_timeout_is_handed_to() -> None:
    """MAX_SECONDS within what a socket, a lock or queue, and an epoll wait take (1e10 s
    overflowed the first two, 2.5e6 s the last, as an OverflowError inside a worker)."""
    read, write = socket.socketpair()
    with read, write, selectors.DefaultSelector() as selector:
        read.settimeout(MAX_SECONDS)
        assert threading.Lock().acquire(timeout=MAX_SECONDS)  # a free lock: at once
        write.send(b"x")
        selector.register(read, selectors.EVENT_READ)
        assert selector.select(MAX_SECONDS)  # a ready socket: at once
