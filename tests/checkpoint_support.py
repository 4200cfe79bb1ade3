"""A checkpoint folder as verlite writes it, with empty weight files: enough for every check
made before Ray starts (which reads the JSON files and sees that the others exist)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verlite.checkpoint_files import ENGINE_FILES


def fake_checkpoint(output_dir: Path, step: int, roles: Sequence[str], **saved: Any) -> Path:
    """``output_dir/checkpoints/step_<step>``; ``saved`` joins the trainer state (``config=``
    or the ``model=`` settings older checkpoints recorded)."""
    folder = output_dir / "checkpoints" / f"step_{step}"
    for role in roles:
        for name in ENGINE_FILES:
            (folder / role / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / role / name).write_text("{}" if name.endswith(".json") else "")
    state = {"step": step, "loader": {}, "kl_coef": 0.0, **saved}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder
