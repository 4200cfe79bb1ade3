"""Save and load one worker group's training state with torch.distributed.checkpoint (DCP).

Trainable parameters and optimizer state go through ``get_state_dict`` (the parameters back
through ``set_model_state_dict``), which keys everything by the unwrapped model's parameter
names whatever the wrapping (none, DDP, FSDP2), and DCP writes each rank's shard. Loading
reshards: a checkpoint saved by N ranks loads into M ranks. Frozen parameters (a LoRA
policy's base) are not saved, nor is optimizer state a parameter does not have yet (it
resumes without, as uninterrupted).

Loading runs no code from the files. DCP's stock reader unpickles ``.metadata`` with plain
``pickle`` and its planner reads non-tensor values (optimizer hyperparameters) with
``torch.load(weights_only=False)``: a crafted checkpoint would run code on every worker at
resume. Here the metadata unpickler resolves only DCP's own record types, torch sizes,
dtypes and layouts, and non-tensor values load with ``weights_only=True``. Tensor shards
are already read with ``weights_only=True`` by DCP.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path, PosixPath
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
)
from torch.serialization import _get_layout

# What a DCP ``.metadata`` pickle may name besides DCP's classes and torch dtypes; each is
# data or a lookup, none runs code of the file's choosing.
_METADATA_GLOBALS = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("pathlib", "PosixPath"): PosixPath,
}


# DCP's index of a checkpoint's values: where in which file each is.
_METADATA = ".metadata"


class CheckpointLoadError(RuntimeError):
    """A checkpoint's file could not be loaded: its bytes are damaged (cut short, altered,
    not what verlite writes); names the folder and each cause. An ``OSError`` reading a file
    is no such fault and is raised as it is."""


class CheckpointMismatchError(RuntimeError):
    """A checkpoint's values, whole, do not fit the model and optimizer they are loaded into:
    another model's names or shapes (a config that builds another model than the one the
    checkpoint was trained as)."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's metadata names something other than checkpoint records."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return _METADATA_GLOBALS[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        raise UnsafeCheckpointError(
            f"checkpoint metadata refers to {module}.{name}, which is not a checkpoint record; "
            "refusing to load it"
        )


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UnsafeCheckpointError(f"{path} holds a {type(metadata).__name__}, not Metadata")
        if metadata.storage_meta is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeLoadPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes, with weights_only=True
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# What training changes: frozen parameters (a LoRA policy's base weights) are not saved;
# a resumed run builds them again, as the first run did.
_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)


@contextlib.contextmanager
def _single_process_intended() -> Iterator[None]:
    """DCP warns at every save and load of a group of one worker (no process group) that
    it assumes a single process, which is what is meant: the warning is left out of the run's
    console."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def save_train_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Collective: every rank of the group calls it with the same ``path``.

    The optimizer's state is saved for the parameters that have some: a parameter that has
    never had a gradient has none (nor does any parameter of an optimizer that has not
    stepped yet, the actor's during the critic's warm-up, or of one that keeps none, SGD),
    and its absence from the checkpoint is what a load reads as "none yet". Nothing is
    created to be saved: ``get_state_dict`` would give an optimizer without state some by a
    zero-gradient step of the whole model (every gradient and AdamW moment at once)."""
    if optimizer.state:
        model_state, optim_state = get_state_dict(model, optimizer, options=_TRAINED_ONLY)
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": get_model_state_dict(model, options=_TRAINED_ONLY)}
    with _single_process_intended():
        dcp.save(state, checkpoint_id=str(path))


_OPTIM_STATE = "optim.state."


def _names_with_optimizer_state(metadata: dcp_metadata.Metadata) -> set[str]:
    """The parameters (by name) a checkpoint holds optimizer state for: DCP keys a value
    ``optim.state.<parameter name>.<state key>`` (``exp_avg``, ``step``, ...)."""
    keys = metadata.state_dict_metadata
    return {
        key[len(_OPTIM_STATE) :].rsplit(".", 1)[0] for key in keys if key.startswith(_OPTIM_STATE)
    }


def _check_held_in_place(optimizer: torch.optim.Optimizer, optim_state: dict[str, Any]) -> None:
    """Every state tensor ``get_state_dict`` handed back is one the optimizer holds, so that
    DCP's load into them is the optimizer's (torch 2.11 and 2.13 hand back the optimizer's
    own without full-state or CPU-offload options); a copy would make the load a silent no-op,
    the run resuming from placeholder moments."""
    held = {
        id(value)
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    }
    for name, entry in optim_state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and id(value) not in held:
                raise RuntimeError(
                    f"the optimizer state {name}.{key} that DCP would load into is a copy, not "
                    "the optimizer's own tensor: this torch's get_state_dict differs from the "
                    "one verlite's in-place load was written for"
                )


def shard_problems(path: Path) -> list[str]:
    """What the checkpoint at ``path`` (a DCP folder holding its ``.metadata`` index) shows
    to be damaged before any worker loads it, each naming its file relative to ``path``: the
    index unreadable (cut short, or not DCP's records), or a file it names missing or shorter
    than the bytes the index reads from it (each value's offset and length). Read from the
    index and the files' sizes alone; what only loading finds (a shard's bytes altered in
    place) is :func:`load_train_state`'s ``CheckpointLoadError``. An ``OSError`` reading the
    index is raised as it is."""
    try:
        metadata = _SafeReader(str(path)).read_metadata()
    except OSError:  # reading failed (the disk's fault, or a file it may not read)
        raise
    except Exception as exc:  # damaged bytes unpickle into nearly any exception
        return [f"{_METADATA} is cut short or damaged ({type(exc).__name__}: {exc})"]
    entries = metadata.storage_data
    # getattr: a byte flipped in a field's name unpickles into a record without that field.
    # The values' names are read before DCP reads the index (``_names_with_optimizer_state``):
    # a byte that makes a name's opcode SHORT_BINBYTES unpickles that name into bytes.
    if (
        not _has(metadata, state_dict_metadata=dict, storage_data=dict)
        or not all(
            isinstance(entry, _StorageInfo)
            and _has(entry, relative_path=str, offset=int, length=int)
            for entry in entries.values()
        )
        or not all(isinstance(name, str) for name in metadata.state_dict_metadata)
    ):
        return [f"{_METADATA} is damaged (its records are not DCP's)"]
    needed: dict[str, int] = {}
    for entry in entries.values():
        end = entry.offset + entry.length
        needed[entry.relative_path] = max(needed.get(entry.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        if not (path / name).is_file():
            problems.append(f"{name} is missing")
        elif (size := (path / name).stat().st_size) < end:
            problems.append(f"{name} is cut short ({size} bytes; its index needs {end})")
    return problems


def _has(record: object, **kinds: type) -> bool:
    """Whether ``record`` holds each field named, of its type."""
    return all(isinstance(getattr(record, name, None), kind) for name, kind in kinds.items())


def load_train_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    *,
    create_state: Callable[[], None],
) -> None:
    """Collective: load in place into an identically built model and optimizer.

    The optimizer's state is read into the tensors it holds, where they are (on the CPU,
    for state offloaded there): ``create_state`` gives a fresh optimizer its state, called
    only when the checkpoint holds some. A parameter the checkpoint holds no state for had
    none when it was saved (it had never had a gradient): its placeholder is dropped, so
    that its first update is, as in the run that saved, the first of its state (AdamW's
    bias correction of step 1). ``set_state_dict`` would load the state again with
    ``Optimizer.load_state_dict``, which casts every moment to its parameter's device at
    once: it sets the model alone, and the optimizer gets its groups' settings (learning
    rate, betas, ...) here, from a checkpoint that holds optimizer state (one without
    leaves the optimizer as built: ``TrainEngine`` applies its run's settings after a load
    in either case)."""
    reader = _SafeReader(str(path))
    try:
        # Read and checked before DCP reads it again: DCP's loader (torch 2.11) swallows a
        # reader's refusal and reports only "metadata is None".
        saved = _names_with_optimizer_state(reader.read_metadata())
    except (pickle.UnpicklingError, EOFError) as exc:
        raise CheckpointLoadError(f"cannot load {path}: {type(exc).__name__}: {exc}") from None
    placeholders: dict[str, dict[str, Any]] = {}
    state: dict[str, Any]  # DCP's STATE_DICT_TYPE: its "model" and "optim" are read back below
    if saved:
        create_state()
        model_state, optim = get_state_dict(model, optimizer, options=_TRAINED_ONLY)
        # torch's OptimizerStateType types every key's value as a dict or a list; an
        # optimizer's "state" is {parameter name: {key: value}} ("param_groups" the list),
        # as _check_held_in_place reads it.
        optim_state = cast(dict[str, Any], optim)
        _check_held_in_place(optimizer, optim_state)
        placeholders = {n: e for n, e in optim_state["state"].items() if n not in saved}
        optim_state["state"] = {n: e for n, e in optim_state["state"].items() if n in saved}
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": get_model_state_dict(model, options=_TRAINED_ONLY)}
    try:
        with _single_process_intended():
            dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner())
    except (pickle.UnpicklingError, EOFError) as exc:
        raise CheckpointLoadError(f"cannot load {path}: {type(exc).__name__}: {exc}") from None
    except CheckpointException as exc:
        # DCP gathers each rank's exception with its traceback into one BaseException;
        # the causes alone say what is wrong (a refused pickle, a shape that differs).
        failures = [e for e, _ in exc.failures.values()]
        unread = next((e for e in failures if isinstance(e, OSError)), None)
        if unread is not None:  # reading failed: no fault of the bytes
            raise unread from None
        causes = sorted({load_error_line(e) for e in failures})
        if all(load_error_line(e).startswith(_MISMATCH) for e in failures):
            raise CheckpointMismatchError(
                f"cannot load {path}: its values are another model's ({'; '.join(causes)})"
            ) from None
        raise CheckpointLoadError(f"cannot load {path}: {'; '.join(causes)}") from None
    set_model_state_dict(
        model,
        state["model"],
        # Not strict about the frozen parameters, which are not loaded; every trained one
        # was requested above, and DCP fails on any the checkpoint lacks.
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    if saved:
        _drop_placeholders(optimizer, placeholders)
        loaded_groups = state["optim"]["param_groups"]
        for group, loaded in zip(optimizer.param_groups, loaded_groups, strict=True):
            group.update((key, value) for key, value in loaded.items() if key != "params")


# How DCP's load planner (torch 2.13) says the values asked for are not those saved: another
# model's shapes or names (tests/distributed/test_checkpoint_load_errors.py).
_MISMATCH = ("ValueError: Size mismatch between saved", "RuntimeError: Missing key in checkpoint")


def load_error_line(exc: BaseException) -> str:
    """A load's exception in one line, ``torch.load(weights_only=True)``'s refusal unwrapped:
    said by the error of its unpickler, which the refusal wraps in paragraphs of advice (to
    load the file without ``weights_only``, which verlite never does)."""
    text = f"{type(exc).__name__}: {exc}"
    inner = exc.__context__
    if text.startswith("UnpicklingError: Weights only load failed") and inner is not None:
        text = f"UnpicklingError: Weights only load failed: {type(inner).__name__}: {inner}"
    return " ".join(text.split())


def _drop_placeholders(
    optimizer: torch.optim.Optimizer, placeholders: dict[str, dict[str, Any]]
) -> None:
    """Drop the optimizer's state whose tensors are among ``placeholders`` (named as
    ``get_state_dict`` names them, held in place: ``_check_held_in_place``)."""
    ids = {id(v) for entry in placeholders.values() for v in entry.values()}
    for param in [
        p for p, entry in optimizer.state.items() if any(id(v) in ids for v in entry.values())
    ]:
        del optimizer.state[param]
