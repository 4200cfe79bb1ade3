"""The folder a run exports its policy to, ``<output_dir>/hf_actor``: whether it is whole, and
the step whose policy it holds.

The trainer writes it (``Trainer.export_policy``), the output folder's contract resumes a run
that stopped before it was whole (``driver/output_folder.py``), and ``verlite export`` reads
it (``export.py``): each name is owned here, with nothing to import.
"""

import json
from pathlib import Path

POLICY_FOLDER = "hf_actor"
MERGED_FOLDER = "hf_actor_merged"  # ``verlite export --merge``'s default
# Beside POLICY_FOLDER while a run writes it, and while a run continued past its end trains
# (its export is an earlier step's): with the mark, the folder is not the run's whole export.
INCOMPLETE_MARK = f"{POLICY_FOLDER}.incomplete"
# In POLICY_FOLDER: the step whose policy it holds. A run continued past its end with
# trainer.save_freq=0 exports a later step's policy than its latest checkpoint's.
STEP_RECORD = "verlite_step.json"


def policy_exported(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` wrote its whole policy export: ``hf_actor`` without the
    mark of an export under way."""
    return (run_dir / POLICY_FOLDER).is_dir() and not (run_dir / INCOMPLETE_MARK).exists()


def record_exported_step(run_dir: Path, step: int) -> None:
    """Record in the run's export that it holds step ``step``'s policy."""
    (run_dir / POLICY_FOLDER / STEP_RECORD).write_text(json.dumps({"step": step}) + "\n")


def exported_step(run_dir: Path) -> int | None:
    """The step whose policy the run's whole export holds; None where it has no whole export,
    or one that does not say (written before verlite recorded it, or damaged)."""
    if not policy_exported(run_dir):
        return None
    try:
        step = json.loads((run_dir / POLICY_FOLDER / STEP_RECORD).read_text(encoding="utf-8"))
        step = step["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if type(step) is int else None
