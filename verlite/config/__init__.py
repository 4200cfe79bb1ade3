"""The run configuration: the schema (:mod:`verlite.config.schema`), loading with overrides
and one-line errors (:mod:`verlite.config.loading`), and the generated reference
(:mod:`verlite.config.reference`, ``make docs``)."""

from verlite.config.loading import (
    ConfigError,
    check_inputs,
    check_paths,
    format_validation_error,
    load_config,
)
from verlite.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    KLControlConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RewardModelConfig,
    RoleSizes,
    RolloutConfig,
    TrainerConfig,
    WandbConfig,
    WorkerRoleConfig,
)

__all__ = [
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
    "RewardConfig",
    "RewardModelConfig",
    "RoleSizes",
    "RolloutConfig",
    "TrainerConfig",
    "WandbConfig",
    "WorkerRoleConfig",
    "check_inputs",
    "check_paths",
    "format_validation_error",
    "load_config",
]
