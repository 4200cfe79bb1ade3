"""What a failed load of a checkpoint's files is: damaged bytes (``CheckpointLoadError``,
which a resume reports as a damaged checkpoint), whole values of another model
(``CheckpointMismatchError``: the config's to fix, no damage), or an I/O error of the
machine (the ``OSError`` itself: neither). Over files the real save code writes."""

from __future__ import annotations

import errno
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from verlite.distributed.rng_state import read_rng_states
from verlite.distributed.sharded_state import (
    CheckpointLoadError,
    CheckpointMismatchError,
    load_train_state,
    save_train_state,
    shard_problems,
)

# Reading it fails with EIO (its offset 0 is no address of the reading process): a real I/O
# error, which a root user's chmod cannot give.
FAILING_READ = Path("/proc/self/mem")
needs_failing_read = pytest.mark.skipif(
    not FAILING_READ.exists(), reason="needs /proc/self/mem (Linux)"
)


def _model(width: int = 4) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _saved(tmp_path: Path) -> Path:
    save_train_state(*_model(), tmp_path / "ck")
    return tmp_path / "ck"


def _load(path: Path, width: int = 4) -> None:
    load_train_state(*_model(width), path, create_state=lambda: None)


def test_another_models_checkpoint_is_a_mismatch_and_altered_bytes_are_damage(
    tmp_path: Path,
) -> None:
    path = _saved(tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"another model's \(ValueError: Size mis"):
        _load(path, width=5)
    extra = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(extra.parameters())
    with pytest.raises(CheckpointMismatchError, match=r"RuntimeError: Missing key in checkpoint"):
        load_train_state(extra, optimizer, path, create_state=lambda: None)
    with (path / "__0_0.distcp").open("r+b") as shard:
        shard.write(bytes(64))  # its size whole: only loading sees it
    with pytest.raises(CheckpointLoadError, match=r"Weights only load failed") as info:
        _load(path)
    assert not isinstance(info.value, CheckpointMismatchError)


@needs_failing_read
@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_an_io_error_reading_a_checkpoint_is_raised_as_it_is(tmp_path: Path, name: str) -> None:
    path = _saved(tmp_path)
    (path / name).unlink()
    (path / name).symlink_to(FAILING_READ)
    with pytest.raises(OSError) as info:
        _load(path)
    assert info.value.errno == errno.EIO
    if name == ".metadata":
        with pytest.raises(OSError, match="Input/output error"):
            shard_problems(path)


def test_a_random_state_file_is_checked_whole(tmp_path: Path) -> None:
    saved = {"cpu": torch.get_rng_state()}  # as TrainingWorker.save_checkpoint writes it
    torch.save(saved, tmp_path / "rng_rank0.pt")
    assert torch.equal(read_rng_states(tmp_path / "rng_rank0.pt")["cpu"], saved["cpu"])
    # A GPU rank's file holds its GPU's state too: torch.cuda.get_rng_state's bytes (a CPU
    # tensor: the seed and the offset), read by the driver without a GPU.
    gpu = torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.zeros(16).byte()
    torch.save({**saved, "cuda": gpu}, tmp_path / "rng_rank0.pt")
    assert torch.equal(read_rng_states(tmp_path / "rng_rank0.pt")["cuda"], gpu)
    for content, named in [
        ({"cpu": saved["cpu"].float()}, r"its 'cpu' is not a CPU random state \(RNG state must"),
        ({"cpu": saved["cpu"][:7]}, r"Expected a CPUGeneratorImplState of size \d+ but found"),
        ({"cuda": saved["cpu"]}, r"holds a mapping of \['cuda'\], not a mapping with the CPU"),
        (saved["cpu"], r"holds a torch\.uint8 tensor of shape \(\d+,\), not a mapping"),
        ({**saved, "cuda": torch.zeros(2)}, r"its 'cuda' is a torch\.float32 tensor of shape"),
    ]:
        torch.save(content, tmp_path / "rng_rank0.pt")
        with pytest.raises(CheckpointLoadError, match=named):
            read_rng_states(tmp_path / "rng_rank0.pt")
    whole = (tmp_path / "rng_rank0.pt").read_bytes()
    (tmp_path / "rng_rank0.pt").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointLoadError, match=r"^is cut short or damaged \(RuntimeError: "):
        read_rng_states(tmp_path / "rng_rank0.pt")


@needs_failing_read
def test_an_io_error_reading_a_random_state_is_raised_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "rng_rank0.pt").symlink_to(FAILING_READ)
    with pytest.raises(OSError) as info:
        read_rng_states(tmp_path / "rng_rank0.pt")
    assert info.value.errno == errno.EIO


@pytest.mark.parametrize("lost", ["length", "relative_path", "state_dict_metadata"])
def test_an_index_whose_records_lost_a_field_is_damage(tmp_path: Path, lost: str) -> None:
    """A byte flipped in a field's name unpickles into a record without that field: the check
    before Ray names the index as damaged instead of failing on the missing attribute."""
    path = _saved(tmp_path)
    metadata = FileSystemReader(str(path)).read_metadata()
    record = (
        metadata if lost == "state_dict_metadata" else next(iter(metadata.storage_data.values()))
    )
    delattr(record, lost)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    assert shard_problems(path) == [".metadata is damaged (its records are not DCP's)"]


def test_an_index_naming_a_value_by_bytes_is_damage(tmp_path: Path) -> None:
    """One byte (a name's SHORT_BINUNICODE opcode made SHORT_BINBYTES) unpickles a value's name
    into bytes: the check before Ray names the index as damaged, where the workers' load failed
    on it with a TypeError (reading which values hold optimizer state)."""
    path = _saved(tmp_path)
    raw = (path / ".metadata").read_bytes()
    name = b"optim.state.0.weight.exp_avg"
    at = raw.index(b"\x8c" + bytes([len(name)]) + name)
    (path / ".metadata").write_bytes(raw[:at] + b"C" + raw[at + 1 :])
    assert shard_problems(path) == [".metadata is damaged (its records are not DCP's)"]
