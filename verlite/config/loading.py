"""Loading a run configuration: YAML (a safe loader, :mod:`verlite.yaml_files`), dotted
overrides typed by the schema (a section given as a mapping merges into the section), and
validation errors turned into one line each that names the field, the value and what is
allowed.
"""

from __future__ import annotations

import copy
import difflib
import json
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ValidationError

from verlite.config.schema import Config
from verlite.errors import UserError, one_line, shown
from verlite.redaction import MASK, holds_credential, register_secret, url_secrets
from verlite.user_files import read_text, resolved_path
from verlite.yaml_files import UnspacedKey, field_path, load_text, read_mapping, yaml_kind


class ConfigError(UserError):
    """A configuration problem a user can fix: the message names the field, value and what is allowed."""


ConfigSource = str | Path | Mapping[str, Any] | Config | None
"""A YAML file's path, a mapping of sections, or a loaded config (None: the defaults)."""

Overrides = Sequence[str] | Mapping[str, Any]
"""``dotted.key=value`` strings typed by the schema, or dotted keys to values."""


def load_config(source: ConfigSource, overrides: Overrides = ()) -> Config:
    """Read a config (a YAML file with a safe loader, a mapping, or a loaded config),
    apply the overrides, validate.

    A loaded config is overridden from what it was loaded from, so a field that defaults to
    another (``critic.loss_agg_mode`` follows ``actor.loss_agg_mode``) follows the override."""
    if isinstance(source, Config):
        raw = copy.deepcopy(source._source) if source._source is not None else source.model_dump()
        explicit = source.explicit
    else:
        if isinstance(source, Mapping):
            raw = copy.deepcopy(dict(source))
        elif source is not None:
            # An empty file is refused as one where it is all the run is given; with
            # overrides it is the base they fill, as a config of overrides alone (None) is.
            raw = read_mapping(
                source,
                what="config file",
                example="of sections: model:, data:, ...",
                error=ConfigError,
                empty_ok=bool(overrides),
            )
        else:
            raw = {}
        explicit = frozenset(explicit_fields(raw))
    if isinstance(overrides, str | bytes) or not isinstance(overrides, Mapping | Iterable):
        what = "one string" if isinstance(overrides, str) else _a(type(overrides).__name__)
        raise ConfigError(
            f"overrides={shown(overrides)} is {what}; give a list of dotted.key=value strings "
            "or a mapping of dotted keys to values (or none)"
        )
    # Each override is read once (its key checked, a string's value parsed) and placed twice:
    # into the config, and into an empty mapping that holds the overrides alone, whose fields
    # (explicit_fields) are those the overrides set. Not read off the key: a section given as
    # a mapping (trainer={total_steps: 2}, or {"optim.lr": 0.1} inside it) sets the fields
    # it names, as _assign places them.
    overridden: dict[str, Any] = {}
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            malformed = (
                f"malformed override key {shown(key)}; expected a dotted key such as "
                "actor.loss_agg_mode"
            )
            _place(raw, str(key), copy.deepcopy(value), malformed)
            _place(overridden, str(key), copy.deepcopy(value), malformed)
    else:
        for index, item in enumerate(overrides):
            if not isinstance(item, str):
                raise ConfigError(
                    f"overrides[{index}]={shown(item)}: expected a dotted.key=value string, "
                    f"got {_a(type(item).__name__)}"
                )
            _apply_override(raw, overridden, item)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, raw)) from None
    cfg._source = raw
    cfg._explicit = explicit | explicit_fields(overridden)
    # The credentials of the config's URLs (trainer.mlflow_tracking_uri's), known from here on:
    # masked whole in every message, line and record, wherever they appear.
    for value in flatten(cfg.model_dump()).values():
        for secret in url_secrets(value) if isinstance(value, str) else ():
            register_secret(secret)
    return cfg


def recorded_config(flat: Mapping[str, Any]) -> Config | None:
    """The config a run recorded, by dotted key (a checkpoint's, under today's keys), as this
    version reads it; None where it reads none (a record of the model settings alone, or of
    settings since removed)."""
    try:
        return Config.model_validate(unflatten(flat))
    except ValidationError:
        return None


def flatten(
    config: Mapping[str, Any], prefix: str = "", model: type[BaseModel] | None = Config
) -> dict[str, Any]:
    """A config mapping (a ``model_dump``, a checkpoint's record) by dotted key: each field of
    its sections (``model``'s) under the keys that lead to it, a tuple as a list (as JSON reads
    it back). A field whose value is a mapping (``reward.combine``,
    ``data.chat_template_kwargs``) is one value, as a section is not: its names come and go
    with the setting, so a key per name would hide a name added or removed (an empty mapping
    would have no key at all). A key the schema does not know (a record's setting since moved)
    is read as a section. :func:`unflatten` inverts it."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        field = model.model_fields.get(key) if model is not None else None
        section = _section_type(field.annotation) if field is not None else None
        if isinstance(value, Mapping) and (field is None or section is not None):
            flat.update(flatten(value, f"{prefix}{key}.", section))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The nested mapping whose :func:`flatten` is ``flat``."""
    nested: dict[str, Any] = {}
    for dotted, value in flat.items():
        *sections, name = dotted.split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = value
    return nested


def explicit_fields(raw: Mapping[str, Any], model: type[BaseModel] = Config) -> set[str]:
    """The dotted fields a raw mapping of ``model`` sets: its values that are not sections,
    and those inside the sections it gives as mappings (an empty section sets nothing)."""
    found = set()
    for key, value in raw.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            continue  # an unknown key: validation refuses it
        section = _section_type(field.annotation)
        if section is None:
            found.add(key)
        elif isinstance(value, Mapping):
            found.update(f"{key}.{name}" for name in explicit_fields(value, section))
    return found


def _apply_override(raw: dict[str, Any], overridden: dict[str, Any], item: str) -> None:
    """Apply the ``dotted.key=value`` string ``item``, its value parsed once, to ``raw`` and
    to ``overridden`` (:func:`load_config`: the overrides alone)."""
    key, sep, text = item.partition("=")
    malformed = f"malformed override {shown(item)}; expected dotted.key=value, e.g. actor.loss_agg_mode=token-sum"
    if not sep:  # a key or a value alone: a shell splits `key = value` into three words
        raise ConfigError(
            f"malformed override {shown(item)}: no '='; write dotted.key=value as one word (no "
            "spaces around '='), e.g. actor.loss_agg_mode=token-sum"
        )
    section, leaf, annotation = _slot(raw, key.strip(), malformed, item=item)
    try:
        value = _parse_value(text.strip(), annotation)
    except UnspacedKey as exc:  # valid YAML, not what was meant
        raise ConfigError(f"override {shown(item)}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        problem = one_line(getattr(exc, "problem", None) or exc)
        raise ConfigError(
            f"override {shown(item)}: its value is not valid YAML ({problem}); a section is given "
            f"as {key.strip()}={{field: value, ...}}"
            if _section_type(annotation) is not None
            else f"override {shown(item)}: its value is not valid YAML ({problem})"
        ) from None
    _assign(section, leaf, value, annotation)
    _place(overridden, key.strip(), copy.deepcopy(value), malformed)


def _place(raw: dict[str, Any], key: str, value: Any, malformed: str) -> None:
    """Set the dotted ``key`` of ``raw`` to an override's ``value`` (:func:`_assign`);
    ``malformed``: the message for a key that is no dotted key."""
    section, leaf, annotation = _slot(raw, key, malformed)
    _assign(section, leaf, value, annotation)


def _assign(section: dict[str, Any], leaf: str, value: Any, annotation: Any) -> None:
    """Set ``section[leaf]``, of schema type ``annotation``, to an override's ``value``. A
    mapping given for a section merges into what the section holds, field by field and into
    its subsections, so ``trainer={total_steps: 2}`` keeps the file's other trainer fields;
    any other value replaces what is there, a mapping-valued field's mapping included
    (``reward.combine`` is a value, not a section)."""
    model = _section_type(annotation)
    # A section the file leaves out (or empty, ``trainer:``) is merged into as an empty one.
    current = {} if section.get(leaf) is None else section[leaf]
    if model is None or not isinstance(value, Mapping) or not isinstance(current, Mapping):
        section[leaf] = value
        return
    merged = dict(current)
    for dotted, item in value.items():
        key, dot, rest = dotted.partition(".") if isinstance(dotted, str) else (dotted, "", "")
        if dot:  # {"optim.lr": 0.1} in a section: the dotted key names a field below
            item = {rest: item}
        field = model.model_fields.get(key) if isinstance(key, str) else None
        # An unknown key is set as given: validation names it with a suggestion.
        _assign(merged, key, item, field.annotation if field is not None else None)
    section[leaf] = merged


def _slot(
    raw: dict[str, Any], key: str, malformed: str, *, item: str | None = None
) -> tuple[dict[str, Any], str, Any]:
    """Where dotted ``key`` lives in ``raw`` (its sections created as needed): the section,
    the last part of the key, and the schema type of the field."""
    parts = key.split(".")
    if not key or any(not p.isidentifier() for p in parts):
        raise ConfigError(malformed)
    annotation = _field_annotation(parts)
    section = raw
    for i, part in enumerate(parts[:-1]):
        child = section.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"override {shown(item or key)}: {'.'.join(parts[: i + 1])} is not a section here "
                f"(the file or an earlier override set it to {shown(child)})"
            )
        section = child
    return section, parts[-1], annotation


def _field_annotation(parts: Sequence[str]) -> Any:
    """The schema type at a dotted path; unknown keys raise with a suggestion."""
    model: type[BaseModel] | None = Config
    annotation: Any = None
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        if model is None:
            # A mapping-valued field (data.chat_template_kwargs) is given whole, not by key
            # as verl's (Hydra's) data.apply_chat_template_kwargs.enable_thinking=false is.
            whole = (
                f"; give the whole mapping: {prefix}={{{part}: ...}}"
                if any(typing.get_origin(arg) is dict for arg in _union_args(annotation))
                else ""
            )
            raise ConfigError(
                f"{prefix} is a value, not a section: cannot set {'.'.join(parts)!r}{whole}"
            )
        if part not in model.model_fields:
            raise ConfigError(
                _unknown_key_message(".".join(parts[: i + 1]), prefix, list(model.model_fields))
            )
        annotation = model.model_fields[part].annotation
        model = _section_type(annotation)
    return annotation


def _union_args(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _keeps_text(annotation: Any, text: str) -> bool:
    """Whether an override's text is its value as it is: a string field's, a field of words'
    (``actor.loss_agg_mode``), or one of the words of a field that also takes numbers
    (``trainer.gpus_per_worker=auto``; its other values parse as YAML)."""
    words = others = False
    for arg in _union_args(annotation):
        while typing.get_origin(arg) is Annotated:
            arg = typing.get_args(arg)[0]
        if arg is str:
            return True
        if typing.get_origin(arg) is Literal and any(
            isinstance(v, str) for v in typing.get_args(arg)
        ):
            if text in typing.get_args(arg):
                return True
            words = True
        elif arg is not type(None):
            others = True
    return words and not others


def _parse_value(text: str, annotation: Any) -> Any:
    """Typed by the schema: a string field keeps the text as is (except null); others parse as
    YAML. An empty value (``trainer.total_steps=``) is the empty string for every field, not
    YAML's null: the schema takes it where a field allows it (``data.system_prompt``) and
    refuses it in one line elsewhere; null is written out."""
    if text in ("null", "~", "None") and type(None) in _union_args(annotation):
        return None
    if not text or _keeps_text(annotation, text):
        return text
    return load_text(text)


# Keys that moved, by their old dotted name: the old one is refused in one line that names the
# new one, from a file, the command line and the API alike (a checkpoint's saved config is
# read under the new names, verlite.driver.checkpoint).
MOVED_KEYS = {"trainer.max_staleness": "rollout.max_staleness"}


def _unknown_key_message(dotted: str, prefix: str, known: Sequence[str]) -> str:
    if dotted in MOVED_KEYS:
        return f"{dotted} moved to {MOVED_KEYS[dotted]}; set {MOVED_KEYS[dotted]} instead"
    leaf = dotted.rsplit(".", 1)[-1]
    section = _model_at(prefix.split(".") if prefix else [])
    candidates = {path.rsplit(".", 1)[-1]: path for path in reversed(_field_paths(section, prefix))}
    close = difflib.get_close_matches(leaf.lower(), list(candidates), n=1)  # fields: lower case
    hint = f"; did you mean {candidates[close[0]]!r}?" if close else ""
    where = f"in {prefix}" if prefix else "at the top level"
    return f"unknown key {shown(dotted)}{hint} (known keys {where}: {', '.join(known)})"


def _field_paths(model: type[BaseModel], prefix: str) -> list[str]:
    """Every dotted field path under ``model``, shallow ones first (they win suggestions)."""
    paths = [".".join(filter(None, [prefix, name])) for name in model.model_fields]
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        if sub is not None:
            paths += _field_paths(sub, ".".join(filter(None, [prefix, name])))
    return paths


def _section_type(annotation: Any) -> type[BaseModel] | None:
    return next(
        (t for t in _union_args(annotation) if isinstance(t, type) and issubclass(t, BaseModel)),
        None,
    )


def _annotation_at(loc: Sequence[str]) -> Any:
    """The schema type of the field at ``loc``; None past a field (an item of a list field)."""
    model: type[BaseModel] | None = Config
    annotation: Any = None
    for part in loc:
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = _section_type(annotation)
    return annotation


# The types of values that are no text.
_NOT_TEXT = (int, float, bool, type(None))


def _takes_no_text(annotation: Any) -> bool:
    """Whether a schema field of type ``annotation`` takes no text: numbers, switches, lists
    of them (``model.logits_chunk_tokens``, ``rollout.stop_token_ids``). None, past a field
    (a mapping's key: ``data.chat_template_kwargs.api_token``), takes any."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) is not Literal:
        return all(_takes_no_text(arg) for arg in args)
    return annotation in _NOT_TEXT


def _model_at(loc: Sequence[str]) -> type[BaseModel]:
    """The section model at ``loc`` (the root's at none)."""
    model = _section_type(_annotation_at(loc)) if loc else Config
    assert model is not None, f"{'.'.join(loc)} is not a section"
    return model


def format_validation_error(exc: ValidationError, raw: Mapping[str, Any]) -> str:
    """One line per problem: the dotted field, the value given and what is allowed."""
    lines = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        dotted = field_path(err["loc"])
        if err["type"] == "extra_forbidden":
            prefix = field_path(err["loc"][:-1])
            lines.append(
                _unknown_key_message(dotted, prefix, list(_model_at(loc[:-1]).model_fields))
            )
            continue
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "bool_type":
            message += " (true or false)"
        if err["type"] in _CONTAINERS:  # pydantic's "valid tuple", "valid dictionary"
            message = f"Input should be {_CONTAINERS[err['type']]}"
        if err["type"] in ("too_short", "too_long"):  # "Tuple should have at least 1 item ..."
            message = message.replace(" after validation", "")
            if err.get("ctx", {}).get("field_type") == "Tuple":
                message = "List" + message.removeprefix("Tuple")
        if err["type"] == "model_type":  # a section given as something else
            message = (
                f"expected a section: a mapping of its fields, as in {dotted}={{field: value, ...}}"
            )
        if err["type"] == "missing" and isinstance(err["loc"][-1], int):
            # a fixed-length list given short: pydantic names each index it lacks a field
            lines.append(_short_list(loc[:-1], err["input"]))
        elif err["type"] == "missing":
            lines.append(f"{dotted}: required field is missing")
        elif not loc or message.startswith(dotted):  # a cross-field check names its fields
            lines.append(message)
        elif err["type"] == "value_error" and not _has_field_value(raw, loc):
            lines.append(f"{dotted}: {message}")
        elif err.get("input") == "":  # `key=`: the value is empty, whatever type it lacks
            null = " (or null)" if type(None) in _union_args(_annotation_at(loc)) else ""
            lines.append(f"{dotted} is empty: {message}{null}")
        else:
            value = err.get("input")
            if err["type"].endswith("_type"):  # strict: a value of another type, never coerced
                message += f", got {yaml_kind(value)}"
            # A credential-named key's value (a template variable's, data.chat_template_kwargs.
            # api_token) is masked here as in config.json; a field that takes no text holds no
            # credential, whatever its name (model.logits_chunk_tokens=4k: a size mistyped).
            secret = holds_credential(str(loc[-1]), value) and not _takes_no_text(
                _annotation_at(loc)
            )
            text = MASK if secret else shown(value, render=_as_yaml)
            lines.append(f"{dotted}={text}: {message}")
    return "; ".join(dict.fromkeys(lines))


# The kinds of container a field takes, as YAML names them (a field's tuple is a list there).
_CONTAINERS = {
    "tuple_type": "a list ([a, b, ...])",
    "list_type": "a list ([a, b, ...])",
    "dict_type": "a mapping ({key: value, ...})",
}


def _short_list(loc: Sequence[str], value: Sequence[Any]) -> str:
    """The line for a fixed-length list field (``actor.optim.betas``) given fewer items, in
    the words of a longer one ("List should have at most 2 items, not 3")."""
    annotation = _model_at(loc[:-1]).model_fields[loc[-1]].annotation
    tuples = [t for t in _union_args(annotation) if typing.get_origin(t) is tuple]
    length = len(typing.get_args(tuples[0]))
    return (
        f"{field_path(loc)}={shown(value, render=_as_yaml)}: List should have {length} items, "
        f"not {len(value)}"
    )


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def _as_yaml(value: object) -> str:
    """``value`` spelled as in YAML's flow style: ``true``, ``null``, ``[1, 'a']``,
    ``{fn: 0.5}``; a string quoted (``'3'`` is not the number 3)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_as_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_as_yaml, value)) + "]"
    return repr(value)


def _has_field_value(raw: Mapping[str, Any], loc: Sequence[str]) -> bool:
    node: Any = raw
    for part in loc:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return not isinstance(node, Mapping)


def check_paths(cfg: Config) -> None:
    """Fail early, before Ray starts, on the inputs (:func:`check_inputs`) and an output
    folder that overlaps an input (the run would write over what it reads)."""
    given = input_paths(cfg)
    inputs = check_inputs(cfg)
    output = resolved_path(
        cfg.trainer.output_dir,
        f"trainer.output_dir={shown(cfg.trainer.output_dir)}",
        error=ConfigError,
    )
    resume = cfg.trainer.resume
    if resume not in ("auto", "disable"):
        given["trainer.resume"] = resume
        inputs["trainer.resume"] = resolved_path(
            resume, f"trainer.resume={shown(resume)}", error=ConfigError
        )
    for dotted, path in inputs.items():
        if dotted == "trainer.resume" and path.is_relative_to(output / "checkpoints"):
            continue  # a checkpoint of the run in this folder: resuming it is what it is for
        if path == output or path.is_relative_to(output) or output.is_relative_to(path):
            raise ConfigError(
                f"trainer.output_dir={shown(cfg.trainer.output_dir)} overlaps "
                f"{dotted}={shown(given[dotted])}: the run would write where it reads; choose "
                "an output folder apart from its inputs"
            )


def input_paths(cfg: Config) -> dict[str, str | None]:
    """The run's input files and folders by field (None: not set)."""
    return {
        "model.path": cfg.model.path,
        "reward.model.path": cfg.reward.model.path,
        "data.train_file": cfg.data.train_file,
        "data.val_file": cfg.data.val_file,
    }


def check_inputs(cfg: Config) -> dict[str, Path]:
    """Fail on input paths that do not exist on this machine and a model folder that cannot
    be a Hugging Face model; the inputs set, by field, resolved (:func:`resolved_path`: a
    link loop, a name too long for the file system, a path it cannot look at is one line)."""
    given = {dotted: value for dotted, value in input_paths(cfg).items() if value is not None}
    inputs = {}
    for dotted, value in given.items():
        path = resolved_path(value, f"{dotted}={shown(value)}", error=ConfigError)
        if not path.exists():
            raise ConfigError(
                f"{dotted}={shown(value)}: no such file or directory{_hint(dotted)}"
                f"{relative_path_hint(value)}"
            )
        if dotted.startswith("data.") and not path.is_file():
            # a folder cannot be read, a pipe or device may block or never end
            raise ConfigError(
                f"{dotted}={shown(value)}: not a regular file; give a JSONL or Parquet file"
            )
        inputs[dotted] = path
    for dotted in ("model.path", "reward.model.path"):
        if dotted in inputs:
            _check_model_dir(given[dotted], dotted)
    return inputs


def _hint(dotted: str) -> str:
    """What a missing model path is: a Hugging Face Hub id (``Qwen/Qwen2.5-0.5B-Instruct``)
    reads as a relative path that does not exist, and nothing is downloaded."""
    if not dotted.endswith("model.path"):
        return ""
    return "; give a local folder written by save_pretrained (nothing is downloaded)"


def relative_path_hint(value: str) -> str:
    """Where a relative input (or ``trainer.resume``) was looked for: the current folder,
    which a config file in another folder may not have meant (its paths are not read from
    the file's folder)."""
    if Path(value).is_absolute():
        return ""
    return f"; a relative path is read from the current folder, {shown(str(Path.cwd()))}"


# What Hugging Face's from_pretrained loads weights from, in one file or sharded.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _check_model_dir(path: str, field: str) -> None:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(
            f"{field}={path!r} is not a Hugging Face model directory (no config.json "
            "in it); give a local folder written by save_pretrained"
            + (", or leave it unset for the built-in model" if field == "model.path" else "")
        )
    text = read_text(config, what=f"{field}'s config.json", error=ConfigError)
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{field}={path!r}: its config.json cannot be read as JSON ({one_line(exc, 200)})"
        ) from None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ConfigError(
            f"{field}={path!r}: its config.json names no model_type; it is not a Hugging "
            "Face model config"
        )
    if not any((Path(path) / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(
            f"{field}={path!r} holds no weights (none of {', '.join(WEIGHT_FILES)}); "
            "save the model with save_pretrained"
        )
    for name in _safetensors_files(Path(path), field):
        problem = _safetensors_problem(Path(path) / name)
        if problem is not None:
            raise ConfigError(f"{field}={path!r}: {name} {problem}; copy or save the model again")


# The largest header the safetensors format allows (its own reader refuses a larger one).
SAFETENSORS_MAX_HEADER = 100_000_000


def _safetensors_files(folder: Path, field: str) -> list[str]:
    """The safetensors files a load of ``folder`` reads: model.safetensors, or the shards its
    index names (each must be there)."""
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    text = read_text(index, what=f"{field}'s {index.name}", error=ConfigError)
    try:
        weight_map = json.loads(text)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{field}={str(folder)!r}: {index.name} cannot be read as a safetensors index "
            f"({one_line(exc, 200)}); copy or save the model again"
        ) from None
    for shard in shards:
        if not isinstance(shard, str) or not (folder / shard).is_file():
            raise ConfigError(
                f"{field}={str(folder)!r}: {index.name} names {shard}, which is not in the "
                "folder; copy or save the model again"
            )
    return shards


def _safetensors_problem(file: Path) -> str | None:
    """What makes ``file`` unloadable as safetensors, read from its header alone (an 8-byte
    length, a JSON header, then the tensors' bytes, which must fill the rest exactly); None
    when its size is what the header describes."""
    size = file.stat().st_size
    with file.open("rb") as stream:
        head = stream.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(SAFETENSORS_MAX_HEADER, size - 8):
            return "is not a safetensors file (no header of a readable length)"
        try:
            header = json.loads(stream.read(length))
            ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
            expected = 8 + length + max((int(end) for end in ends), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "is not a safetensors file (its header is not a tensor table)"
    if size != expected:
        return f"is cut short or damaged: {size} bytes where its header describes {expected}"
    return None
