"""The folder a run exports its policy to, ``<output_dir>/hf_actor``, and whether it is whole.

The trainer writes it (``Trainer.export_policy``), the output folder's contract resumes a run
that stopped before it was whole (``driver/output_folder.py``), and ``verlite export`` reads
it (``export.py``): each name is owned here, with nothing to import.
"""

from pathlib import Path

POLICY_FOLDER = "hf_actor"
MERGED_FOLDER = "hf_actor_merged"  # ``verlite export --merge``'s default
# Beside POLICY_FOLDER while a run writes it, and while a run continued past its end trains
# (its export is an earlier step's): with the mark, the folder is not the run's whole export.
INCOMPLETE_MARK = f"{POLICY_FOLDER}.incomplete"


def policy_exported(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` wrote its whole policy export: ``hf_actor`` without the
    mark of an export under way."""
    return (run_dir / POLICY_FOLDER).is_dir() and not (run_dir / INCOMPLETE_MARK).exists()
