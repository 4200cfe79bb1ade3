"""Fields that default to other fields, resolved once on the raw mapping before validation
(the per-role worker counts, the rollout workers' resources, the critic's loss settings, the
``seq-mean-token-sum-norm`` scale), so that the resolved config a run logs is the config it
uses; and ``gpus_per_worker: auto``, refused for a cluster."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from verlite.config.sections_rollout import RolloutConfig
from verlite.config.sections_trainer import TrainerConfig
from verlite.config.sections_training import ActorConfig


def fill_inherited(data: Any) -> Any:
    """``data`` (what a config is validated from) with the fields that default to other
    fields filled in; anything but a mapping as it is."""
    if not isinstance(data, Mapping):
        return data
    data = dict(data)
    sections = {name: as_dict(data.get(name)) for name in ("actor", "critic", "trainer", "rollout")}
    rollout, trainer = sections["rollout"], sections["trainer"]
    if isinstance(trainer, dict):
        _check_auto_gpus(trainer, "trainer", trainer)
    if isinstance(rollout, dict):
        _check_auto_gpus(rollout, "rollout", trainer)
        for key in ("workers_per_node", "cpus_per_worker", "gpus_per_worker"):
            value = _get(trainer, key, TrainerConfig)
            # An invalid trainer value is reported once, on the trainer.
            if rollout.get(key) is None and _is_valid(TrainerConfig, key, value):
                rollout[key] = value
        data["rollout"] = rollout
    reward = as_dict(data.get("reward"))
    reward_model = as_dict(reward.get("model")) if isinstance(reward, dict) else None
    if isinstance(reward_model, dict) and reward_model.get("workers_per_node") is None:
        value = _get(trainer, "workers_per_node", TrainerConfig)
        if _is_valid(TrainerConfig, "workers_per_node", value):
            data["reward"] = {**reward, "model": {**reward_model, "workers_per_node": value}}
    actor, critic = sections["actor"], sections["critic"]
    if isinstance(actor, dict) and isinstance(critic, dict):
        trainer_wpn = _get(sections["trainer"], "workers_per_node", TrainerConfig)
        for role in (actor, critic):
            if role.get("workers_per_node") is None:
                role["workers_per_node"] = trainer_wpn
        for key in ("loss_agg_mode", "loss_scale_factor"):
            value = actor.get(key, ActorConfig.model_fields[key].default)
            # An invalid actor value is reported once, on the actor, not again on the critic.
            if critic.get(key) is None and _is_valid(ActorConfig, key, value):
                critic[key] = value
        for role in (actor, critic):  # each role's own mode: the critic may set its own
            if (
                role.get("loss_agg_mode") == "seq-mean-token-sum-norm"
                and role.get("loss_scale_factor") is None
            ):
                role["loss_scale_factor"] = _get(
                    sections["rollout"], "max_response_length", RolloutConfig
                )
        data.update(actor=actor, critic=critic)
    return data


def _check_auto_gpus(section: dict[str, Any], name: str, trainer: Any) -> None:
    """``gpus_per_worker: auto`` (resolved by its field, ``config.fields``) counts this
    machine's GPUs, where the workers of an embedded Ray run (a Ray session this process
    opened itself is taken to be of this machine); a cluster's are not known here, so with
    ``trainer.ray_address`` auto is refused."""
    address = trainer.get("ray_address") if isinstance(trainer, dict) else None
    if section.get("gpus_per_worker") != "auto" or address is None:
        return
    job = " (which verlite submit sets for its jobs)" if address == "auto" else ""
    raise ValueError(
        f"{name}.gpus_per_worker=auto gives each worker a GPU when this machine has one, for "
        f"an embedded Ray; on a Ray cluster, trainer.ray_address={address!r}{job}, give the "
        "GPUs of one worker as a number (1: a GPU each, 0: CPU workers)"
    )


def as_dict(section: Any) -> Any:
    """A section as a mapping (a model dumped, None empty); anything else as it is."""
    if section is None:
        return {}
    if isinstance(section, BaseModel):
        return section.model_dump()
    return dict(section) if isinstance(section, Mapping) else section


def _is_valid(model: type[BaseModel], key: str, value: Any) -> bool:
    field = model.model_fields[key]
    # A type expression built at run time, which mypy cannot type (TypeAdapter takes any).
    annotation: Any = (
        Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
    )
    try:
        TypeAdapter(annotation).validate_python(value, strict=model.model_config.get("strict"))
    except ValidationError:
        return False
    return True


def _get(section: Any, key: str, model: type[BaseModel]) -> Any:
    if isinstance(section, dict) and section.get(key) is not None:
        return section[key]
    return model.model_fields[key].default
