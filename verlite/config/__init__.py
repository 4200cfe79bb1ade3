"""The run configuration: the root model (:mod:`verlite.config.schema`) and its sections
(``sections_*``, built on :mod:`verlite.config.fields`), the fields that default to others
(:mod:`verlite.config.defaults`), the checks across fields (:mod:`verlite.config.checks`),
the values derived from a config (:mod:`verlite.config.derived`), loading with overrides and
one-line errors (:mod:`verlite.config.loading`), and the generated reference
(:mod:`verlite.config.reference`, ``make docs``)."""

from verlite.config.derived import RoleSizes
from verlite.config.loading import (
    MOVED_KEYS,
    ConfigError,
    check_inputs,
    check_paths,
    flatten,
    format_validation_error,
    input_paths,
    load_config,
    recorded_config,
    relative_path_hint,
    unflatten,
)
from verlite.config.schema import Config
from verlite.config.sections_inputs import DataConfig, ModelConfig
from verlite.config.sections_reward import RemoteRewardConfig, RewardConfig, RewardModelConfig
from verlite.config.sections_rollout import RolloutConfig
from verlite.config.sections_trainer import TrainerConfig, WandbConfig
from verlite.config.sections_training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    KLControlConfig,
    LoraConfig,
    OptimConfig,
    TrainedRole,
    WorkerRoleConfig,
)

__all__ = [
    "MOVED_KEYS",
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "KLControlConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RemoteRewardConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RoleSizes",
    "RolloutConfig",
    "TrainedRole",
    "TrainerConfig",
    "WandbConfig",
    "WorkerRoleConfig",
    "check_inputs",
    "check_paths",
    "flatten",
    "format_validation_error",
    "input_paths",
    "load_config",
    "recorded_config",
    "relative_path_hint",
    "unflatten",
]
