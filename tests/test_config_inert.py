"""Settings set without the feature they belong to: named in one line at start-up, never
refused (verlite.config.inert); each declaration checked with its own example."""

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from verlite.config import Config, ConfigError, load_config
from verlite.config.fields import Needs
from verlite.config.inert import NEEDS, covers, inert_settings, inert_settings_line
from verlite.config.loading import _section_type
from verlite.core import advantages
from verlite.driver.run import prepare_run, run_training
from verlite.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# Configs that leave features off between them: every declaration is off in one of them.
BASES: list[dict[str, Any]] = [
    {"data.task": "copy"},
    {
        "data.train_file": "prompts.jsonl",
        "data.val_file": "validation.jsonl",
        "model.path": "model",
        "algorithm.adv_estimator": "grpo",
        "rollout.n": 2,
        "actor.use_dynamic_bsz": True,
        "actor.max_token_len_per_worker": 512,
    },
    {
        "data.task": "copy",
        "critic.use_dynamic_bsz": True,
        "critic.max_token_len_per_worker": 512,
        "actor.optim.name": "sgd",
        "critic.optim.name": "sgd",
        "actor.policy_loss": "reinforce",
        "algorithm.use_kl_in_reward": True,
    },
    {"data.task": "copy", "rollout.temperature": 0.0},
]


def _model_at(dotted: str) -> tuple[type[BaseModel] | None, Any]:
    """The section model at ``dotted`` (None for a field) and the field's info; KeyError for
    a name that is not in the schema."""
    model: type[BaseModel] | None = Config
    info = None
    for part in dotted.split("."):
        if model is None:
            raise KeyError(dotted)
        info = model.model_fields[part]
        model = _section_type(info.annotation)
    return model, info


def _a_field(declared: str) -> str:
    """``declared`` when it is a field, else the first field of the section it names."""
    model, _ = _model_at(declared)
    while model is not None:
        name = next(iter(model.model_fields))
        declared = f"{declared}.{name}"
        model, _ = _model_at(declared)
    return declared


def _default(dotted: str) -> Any:
    _, info = _model_at(dotted)
    value = info.get_default(call_default_factory=True)
    return list(value) if isinstance(value, tuple) else value


CASES = [
    pytest.param(needs, _a_field(declared), id=f"{_a_field(declared)}")
    for needs in NEEDS
    for declared in needs.fields
]


def _named(cfg: Config) -> dict[str, Needs]:
    return {name: needs for names, needs in inert_settings(cfg) for name in names}


def _loaded(overrides: dict[str, Any]) -> Config | None:
    """The config, or None where a base does not take the setting (a value it needs)."""
    try:
        return load_config(None, overrides)
    except ConfigError:
        return None


@pytest.mark.parametrize(("needs", "field"), CASES)
def test_a_setting_without_its_switch_is_named_and_with_it_is_not(needs: Needs, field: str) -> None:
    # Set to its default: setting it at all is what is named, whatever the value.
    setting = {field: _default(field)}
    off = [
        (base, cfg)
        for base in BASES
        if (cfg := _loaded({**base, **setting})) is not None and _named(cfg).get(field) is needs
    ]
    assert off, f"no base config leaves {field} without '{needs.unless}': add one to BASES"
    for base, cfg in off:
        line = inert_settings_line(cfg)
        assert line is not None and "\n" not in line
        assert f"{field}" in line and f"no effect unless {needs.unless}" in line
        on = load_config(None, {**base, **setting, **needs.example})
        assert needs.active(on), f"{needs.example} does not turn on '{needs.unless}'"
        assert field not in _named(on)


@pytest.mark.parametrize("needs", NEEDS, ids=[n.fields[0] for n in NEEDS])
def test_declarations_name_fields_of_the_schema(needs: Needs) -> None:
    assert needs.fields and needs.unless and needs.example
    for name in (*needs.fields, *needs.example):
        try:
            _model_at(name)
        except KeyError:
            pytest.fail(f"{name} is not a field or section of the config")
    # The example turns the feature on: it sets a switch, not only what the switch enables.
    assert not all(any(covers(field, key) for field in needs.fields) for key in needs.example)


@pytest.mark.parametrize(
    "name", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml"))
)
def test_shipped_configs_set_nothing_without_effect(name: str) -> None:
    paths = {"model.path": "model", "data.train_file": "train.parquet"}
    cfg = load_config(ROOT / name, paths if "recipes" in name else {})
    assert inert_settings_line(cfg) is None


def test_the_line_names_a_feature_once_with_every_setting_of_it() -> None:
    cfg = load_config(
        ROOT / "configs" / "grpo_tiny.yaml",
        [
            "rollout.multi_turn.max_turns=5",
            "rollout.multi_turn.tool_timeout_s=10",
            "critic.ppo_epochs=2",
        ],
    )
    assert inert_settings_line(cfg) == (
        "config: rollout.multi_turn.max_turns, rollout.multi_turn.tool_timeout_s have no "
        "effect unless rollout.multi_turn.env is set; critic.ppo_epochs has no effect unless "
        "algorithm.adv_estimator trains a critic (gae)"
    )


def test_explicit_fields_are_the_files_and_the_overrides_not_the_filled_in_defaults() -> None:
    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml", ["trainer={save_freq: 2}"])
    assert {
        "model.arch",
        "critic.warmup_steps",
        "trainer.save_freq",
        "trainer.val_freq",
    } <= cfg.explicit
    # Filled in from other fields at load (verlite.config.defaults), not set by the user.
    for filled in ("rollout.workers_per_node", "critic.loss_agg_mode", "reward.combine"):
        assert filled not in cfg.explicit
    again = load_config(cfg, {"rollout.multi_turn.max_turns": 3})
    assert again.explicit == cfg.explicit | {"rollout.multi_turn.max_turns"}
    copied = load_config(cfg.model_copy(update={"rollout": cfg.rollout}), [])
    assert copied.explicit == cfg.explicit  # a copy's dump is not what the user set


def test_the_actors_loss_scale_factor_is_not_named_while_the_critic_takes_it() -> None:
    """A critic that sets no loss_scale_factor takes the actor's (config.defaults): under a
    critic in seq-mean-token-sum-norm the actor's scales the critic's loss."""
    ppo = ROOT / "configs" / "ppo_tiny.yaml"
    scaled = [
        "actor.loss_agg_mode=token-mean",
        "actor.loss_scale_factor=100",
        "critic.loss_agg_mode=seq-mean-token-sum-norm",
    ]
    cfg = load_config(ppo, scaled)
    assert cfg.critic.loss_scale_factor == 100.0
    assert inert_settings_line(cfg) is None
    # An explicit null is none: the critic takes the actor's.
    assert inert_settings_line(load_config(ppo, [*scaled, "critic.loss_scale_factor=null"])) is None
    own = load_config(ppo, [*scaled, "critic.loss_scale_factor=10"])
    assert inert_settings_line(own) == (
        "config: actor.loss_scale_factor has no effect unless "
        "actor.loss_agg_mode=seq-mean-token-sum-norm (or the critic's, which takes it unless "
        "it sets its own)"
    )


def test_an_estimator_names_only_settings_there_are() -> None:
    assert advantages.ESTIMATOR_SETTINGS["gae"] == {"gamma", "lam"}
    with pytest.raises(ValueError, match="not among"):
        advantages.register_advantage("_typo", reads=frozenset({"lamda"}))


def test_a_run_prints_the_line_once_its_checks_pass_before_ray_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    settings = ["data.task=copy", "algorithm.kl_penalty=abs", f"trainer.output_dir={tmp_path}"]
    # More CPUs than this machine has: refused before Ray starts, in its one line alone.
    with pytest.raises(UserError):
        run_training(load_config(None, [*settings, "trainer.cpus_per_worker=100000"]))
    assert capsys.readouterr().out == ""
    # Its checks passed, the run says it first, before its workers start.
    prepare_run(load_config(None, settings), in_session=False, cpus=8).folder.release()
    assert capsys.readouterr().out.splitlines()[0] == (
        "config: algorithm.kl_penalty has no effect unless algorithm.use_kl_in_reward=true"
    )
