"""Settings a config sets that have no effect, because the feature they belong to is off
(``rollout.multi_turn.max_turns`` without ``rollout.multi_turn.env``, a critic's settings
under an estimator without a critic). Each section module declares what its settings need
beside them (its ``NEEDS``, of :class:`~verlite.config.fields.Needs`); this module gathers
them and names, in one line a run prints at start-up, the settings a config sets explicitly
(in its file or its overrides: ``Config.explicit``) that are without effect. They are
accepted, not refused: a config that also serves runs with the feature on stays loadable."""

from __future__ import annotations

from typing import TYPE_CHECKING

from verlite.config import (
    sections_inputs,
    sections_reward,
    sections_rollout,
    sections_trainer,
    sections_training,
)
from verlite.config.fields import Needs

if TYPE_CHECKING:
    from verlite.config.schema import Config

# Every declaration, in the order of the sections; a setting two of them name (a critic's
# optimizer schedule) is named for the first that leaves it without effect.
NEEDS: tuple[Needs, ...] = (
    *sections_inputs.NEEDS,
    *sections_rollout.NEEDS,
    *sections_training.NEEDS,
    *sections_reward.NEEDS,
    *sections_trainer.NEEDS,
)


def covers(declared: str, dotted: str) -> bool:
    """Whether the declared field or section ``declared`` names the field ``dotted``."""
    return dotted == declared or dotted.startswith(f"{declared}.")


def _declares(needs: Needs, dotted: str) -> bool:
    """Whether ``needs`` names the field ``dotted`` (itself or a section above it)."""
    return any(covers(field, dotted) for field in needs.fields)


def without_effect(cfg: Config, dotted: str) -> bool:
    """Whether the field ``dotted`` has no effect in ``cfg``, set explicitly or not: a
    declaration names it and its feature is off (a resume compares no such field:
    ``verlite.driver.checkpoint``)."""
    return any(_declares(needs, dotted) and not needs.active(cfg) for needs in NEEDS)


def inert_settings(cfg: Config) -> list[tuple[list[str], Needs]]:
    """The settings ``cfg`` sets explicitly that have no effect, grouped by what they need."""
    claimed: set[str] = set()
    found = []
    for needs in NEEDS:
        names = [
            name for name in sorted(cfg.explicit) if name not in claimed and _declares(needs, name)
        ]
        if names and not needs.active(cfg):
            claimed.update(names)
            found.append((names, needs))
    return found


def inert_settings_line(cfg: Config) -> str | None:
    """One line naming the settings without effect and what each needs; None when none is."""
    parts = [
        f"{', '.join(names)} {'has' if len(names) == 1 else 'have'} no effect unless {needs.unless}"
        for names, needs in inert_settings(cfg)
    ]
    return f"config: {'; '.join(parts)}" if parts else None
