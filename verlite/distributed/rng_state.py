"""A rank's random states in a checkpoint (``rng_rank<N>.pt``, ``torch.save``'s archive of
``{"cpu": ..., "cuda": ...}``), read and checked without setting them: the driver checks a
checkpoint's files before any worker starts, and the worker restores what the same read
gives it."""

from __future__ import annotations

from pathlib import Path

import torch

from verlite.distributed.sharded_state import CheckpointLoadError, load_error_line


def read_rng_states(path: Path) -> dict[str, torch.Tensor]:
    """The random states the file ``path`` holds: the CPU generator's (``"cpu"``) and, from a
    run on cuda, its GPU's (``"cuda"``). Content that is not that raises
    :class:`CheckpointLoadError` saying what it is ("is cut short or damaged (...)", without
    the file's name); an ``OSError`` reading it (the disk's, a file it may not read) is raised
    as it is: no fault of the file's bytes. Loaded with ``weights_only=True``: a crafted file
    runs no code."""
    try:
        states = torch.load(path, weights_only=True)
    except OSError:
        raise
    except Exception as exc:  # damaged bytes fail the archive's reader or its unpickler
        # Its first sentence: the archive reader's follows it with advice on corrupted files.
        cause = load_error_line(exc).split(". ", 1)[0]
        raise CheckpointLoadError(f"is cut short or damaged ({cause})") from None
    if not isinstance(states, dict) or not isinstance(states.get("cpu"), torch.Tensor):
        raise CheckpointLoadError(
            f"is damaged: holds {_what(states)}, not a mapping with the CPU's random state ('cpu')"
        )
    try:
        torch.Generator().set_state(states["cpu"])  # a generator of its own: no state set
    except (RuntimeError, TypeError) as exc:
        raise CheckpointLoadError(
            f"is damaged: its 'cpu' is not a CPU random state ({exc})"
        ) from None
    cuda = states.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.dim() == 1
    ):
        raise CheckpointLoadError(
            f"is damaged: its 'cuda' is {_what(cuda)}, not a GPU's random state (bytes)"
        )
    return states


def _what(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return f"a mapping of {sorted(map(str, value))}"
    return f"a {type(value).__name__}"
