"""The run configuration's root model, :class:`Config`: one section per YAML section.

Every YAML section maps 1:1 onto a model of its own module (``sections_*.py``), built on
:class:`~verlite.config.fields.Section`: frozen, strict, unknown keys refused, every field
described (the reference in docs/config.md is generated from them). Around the sections:
fields that default to other fields are filled in once, at load, on the raw mapping
(:mod:`~verlite.config.defaults`), so the resolved config a run logs is the config it uses;
checks that need several fields run once every section is valid
(:mod:`~verlite.config.checks`); values derived from the config live in
:mod:`~verlite.config.derived`, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from verlite.config.checks import check_across_fields
from verlite.config.defaults import fill_inherited
from verlite.config.derived import Derived
from verlite.config.fields import Section
from verlite.config.sections_inputs import DataConfig, ModelConfig
from verlite.config.sections_reward import RewardConfig
from verlite.config.sections_rollout import RolloutConfig
from verlite.config.sections_trainer import TrainerConfig
from verlite.config.sections_training import ActorConfig, AlgorithmConfig, CriticConfig


class Config(Section, Derived):
    """A whole run. Load with :func:`load_config`."""

    # The raw mapping it was loaded from: overrides apply to it, so that fields defaulting to
    # other fields follow them (``load_config(cfg, overrides)``).
    _source: dict[str, Any] | None = PrivateAttr(None)
    # The dotted fields its file and overrides set (verlite.config.loading), as against those
    # left to their defaults or filled in from other fields.
    _explicit: frozenset[str] = PrivateAttr(frozenset())

    @property
    def explicit(self) -> frozenset[str]:
        """The dotted fields the config's file and overrides set (the others hold defaults,
        or values filled in from other fields); none for a config built otherwise."""
        return self._explicit

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Config:
        """A copy; one with ``update`` forgets the mapping it was loaded from, which no
        longer describes it."""
        copy = super().model_copy(update=update, deep=deep)
        if update:
            copy._source = None
        return copy

    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(description="Prompts.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy training.")
    critic: CriticConfig = Field(
        default_factory=CriticConfig, description="Value-model training (GAE only)."
    )
    algorithm: AlgorithmConfig = Field(
        default_factory=AlgorithmConfig, description="Advantages and KL-in-reward."
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Scoring.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The run.")

    @model_validator(mode="before")
    @classmethod
    def _fill_inherited(cls, data: Any) -> Any:
        """Resolve fields that default to other fields, before validation, on the raw mapping."""
        return fill_inherited(data)

    @model_validator(mode="after")
    def _cross_field(self) -> Config:
        check_across_fields(self)
        return self
