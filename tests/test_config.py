"""Config loading, overrides, inherited defaults, derived sizes and every error path."""

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from pydantic import BaseModel

from verlite import yaml_files
from verlite.config import MOVED_KEYS, Config, ConfigError, check_paths, load_config
from verlite.config.sections_trainer import TrainerConfig

ROOT = Path(__file__).resolve().parents[1]
BASE = ["data.task=copy"]


def error_of(*overrides: str, path: str | Path | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, [*BASE, *overrides] if path is None else list(overrides))
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    return message


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.sequences_per_step % cfg.actor.ppo_mini_batch_size == 0


TINY = ROOT / "configs" / "ppo_tiny.yaml"


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer={total_steps: 2}", "actor={entropy_coeff: 0.2}"],
        ["actor={optim: {weight_decay: 0.1}, entropy_coeff: 0.2}", "trainer={total_steps: 2}"],
        ["actor.optim={weight_decay: 0.1}", "trainer.total_steps=2", "actor.entropy_coeff=0.2"],
    ],
)
def test_a_section_override_merges_into_the_files_section_at_every_level(
    overrides: list[str],
) -> None:
    file = load_config(TINY)
    cfg = load_config(TINY, overrides)
    assert cfg.trainer.total_steps == 2 and cfg.actor.entropy_coeff == 0.2
    # the file's other fields stay: its output folder, its lr (1e-3, not the default 1e-4)
    assert cfg.trainer.output_dir == file.trainer.output_dir == "outputs/ppo_tiny"
    assert cfg.actor.optim.lr == file.actor.optim.lr == 1e-3
    assert cfg.actor.optim.weight_decay == (0.1 if "weight_decay" in str(overrides) else 0.0)
    assert (
        cfg.critic == file.critic
        and cfg.actor.ppo_mini_batch_size == file.actor.ppo_mini_batch_size
    )


def test_a_remote_verifier_url_with_query_parameters_that_only_contain_a_credential_word() -> None:
    # ?author= holds "auth", ?design= "sig": neither is a credential (verlite.redaction).
    url = "https://scorer.example/score?author=me&design=b"
    assert load_config(TINY, [f"reward.remote.url={url}"]).reward.remote.url == url


def test_a_section_the_file_leaves_out_takes_a_mapping_with_dotted_keys() -> None:
    # ppo_tiny.yaml has no reward section: the mapping still names fields below it
    for overrides in (["reward={remote.timeout_s: 4.0}"], {"reward": {"remote.timeout_s": 4.0}}):
        assert load_config(TINY, overrides).reward.remote.timeout_s == 4.0


def test_a_mapping_valued_field_is_replaced_not_merged() -> None:
    base = load_config(
        TINY, ["reward.model.path=/nonexistent", "reward.combine={fn: 0.5, model: 0.5}"]
    )
    # combine is a value: {model: 1} replaces the mapping (fn leaves it), in a section too
    for overrides in (["reward.combine={model: 1}"], ["reward={combine: {model: 1}}"]):
        assert load_config(base, overrides).reward.combine == {"model": 1.0}
    assert load_config(base, {"reward": {"combine": {"model": 1}}}).reward.combine == {"model": 1.0}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["trainer.total_steps=True"],
            "trainer.total_steps=true: Input should be a valid integer, got a boolean",
        ),
        (
            ["trainer.total_steps=2.0"],
            "trainer.total_steps=2.0: Input should be a valid integer, got a float",
        ),
        (["trainer.seed=2.5"], "trainer.seed=2.5: Input should be a valid integer, got a float"),
        (
            ["trainer.total_steps='3'"],
            "trainer.total_steps='3': Input should be a valid integer, got a string",
        ),
        (
            ["rollout.temperature=False"],
            "rollout.temperature=false: Input should be a valid number, got a boolean",
        ),
        (
            ["actor.optim.lr='1e-3'"],
            "actor.optim.lr='1e-3': Input should be a valid number, got a string",
        ),
        (
            ["reward.combine={fn: true}"],
            "reward.combine.fn=true: Input should be a valid number, got a boolean",
        ),
        (
            ["actor.optim.betas=[0.9, true]"],
            "actor.optim.betas[1]=true: Input should be a valid number",
        ),
        (
            ["data.shuffle=1"],
            "data.shuffle=1: Input should be a valid boolean (true or false), got an integer",
        ),
        (
            ["trainer={total_steps: true}"],
            "trainer.total_steps=true: Input should be a valid integer",
        ),
        (["trainer.loggers=[console, 1]"], "trainer.loggers[1]=1: Input should be 'console'"),
        (
            ["data.max_prompt_length=null"],
            "data.max_prompt_length=null: Input should be a valid integer, got null",
        ),
        (
            ["actor.optim.betas=[0.9, {b: true}]"],
            "actor.optim.betas[1]={b: true}: Input should be a valid number, got a mapping",
        ),
        # containers as YAML names them: pydantic said "a valid tuple", "a valid dictionary"
        (
            ["trainer.loggers=console"],
            "trainer.loggers='console': Input should be a list ([a, b, ...]), got a string",
        ),
        (
            ["rollout.stop_token_ids=5"],
            "rollout.stop_token_ids=5: Input should be a list ([a, b, ...]), got an integer",
        ),
        (
            ["reward.combine=fn"],
            "reward.combine='fn': Input should be a mapping ({key: value, ...}), got a string",
        ),
    ],
)
def test_a_value_of_another_type_is_never_coerced(overrides: list[str], expected: str) -> None:
    assert expected in error_of(*overrides)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("trainer.total_steps=", "trainer.total_steps is empty: Input should be a valid integer"),
        ("trainer.total_steps= ", "trainer.total_steps is empty: Input should be a valid integer"),
        ("actor.optim.lr=", "actor.optim.lr is empty: Input should be a valid number"),
        (
            "actor.use_kl_loss=",
            "actor.use_kl_loss is empty: Input should be a valid boolean (true or false)",
        ),
        ("trainer.loggers=", "trainer.loggers is empty: Input should be a list ([a, b, ...])"),
        (
            "data.chat_template_kwargs=",
            "data.chat_template_kwargs is empty: Input should be a mapping ({key: value, ...})",
        ),
        ("actor.strategy=", "actor.strategy is empty: Input should be 'ddp', 'fsdp' or 'none'"),
        (
            "trainer.output_dir=",
            "trainer.output_dir is empty: String should have at least 1 character",
        ),
        # a field that also takes null says so: `key=` is not null, which is written out
        (
            "model.vocab_size=",
            "model.vocab_size is empty: Input should be a valid integer (or null)",
        ),
        (
            "trainer=",
            "trainer is empty: expected a section: a mapping of its fields, as in "
            "trainer={field: value, ...}",
        ),
    ],
)
def test_an_empty_override_value_is_named_empty_with_what_the_field_takes(
    override: str, expected: str
) -> None:
    """``trainer.total_steps=`` was read as YAML's null ("trainer.total_steps=null: ... got
    null"), and a field that takes null (model.vocab_size, a section) took it silently."""
    assert error_of(override) == expected


def test_an_empty_string_is_a_value_where_the_schema_takes_one(tmp_path: Path) -> None:
    # an empty system turn is one (data.system_prompt allows it); from a file alike
    overrides = ["model.path=m", "data.chat_template=true"]
    assert load_config(TINY, [*overrides, "data.system_prompt="]).data.system_prompt == ""
    path = tmp_path / "c.yaml"
    path.write_text("data: {task: copy}\ntrainer: {total_steps: ''}\n")
    assert error_of(path=path) == "trainer.total_steps is empty: Input should be a valid integer"


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "Yes", "OFF"])
def test_only_true_and_false_are_booleans_as_in_yaml_1_2(word: str, tmp_path: Path) -> None:
    # YAML 1.1 reads these as booleans: a file or override would be coerced behind the user
    expected = (
        f"actor.use_kl_loss='{word}': Input should be a valid boolean (true or false), got a string"
    )
    assert error_of(f"actor.use_kl_loss={word}") == expected
    path = tmp_path / "c.yaml"
    path.write_text(f"data: {{task: copy}}\nactor: {{use_kl_loss: {word}}}\n")
    assert error_of(path=path) == expected
    for word in ("true", "True", "TRUE", "false", "False", "FALSE"):
        path.write_text(f"data: {{task: copy}}\nactor: {{use_kl_loss: {word}}}\n")
        assert load_config(path, [f"critic.packing={word}"]).actor.use_kl_loss is (word[0] in "tT")


def test_numbers_from_a_file_and_the_api_are_as_strict_as_from_the_command_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text('data: {task: copy}\ntrainer: {total_steps: "3"}\n')
    assert "trainer.total_steps='3': Input should be a valid integer, got a string" in error_of(
        path=path
    )
    path.write_text("data: {task: copy}\ntrainer: {total_steps: true}\n")
    assert "trainer.total_steps=true: Input should be a valid integer" in error_of(path=path)
    for overrides in (
        {"trainer.total_steps": True},
        {"rollout.top_p": "0.5"},
        {"trainer.seed": 1.0},
    ):
        with pytest.raises(ConfigError, match="Input should be a valid"):
            load_config(TINY, overrides)
    # what is a number of the field's kind passes: an int for a float, 1e-3 as YAML 1.2 reads it
    path.write_text("data: {task: copy}\nactor: {optim: {lr: 1e-3, betas: [0, 0.5]}}\n")
    cfg = load_config(path, ["rollout.temperature=1", "actor.optim.weight_decay=1E-2"])
    assert (cfg.actor.optim.lr, cfg.actor.optim.betas) == (1e-3, (0.0, 0.5))
    assert (cfg.rollout.temperature, cfg.actor.optim.weight_decay) == (1.0, 0.01)
    assert load_config(TINY, {"rollout.temperature": 1}).rollout.temperature == 1.0


@pytest.mark.parametrize(
    "field", ["trainer.output_dir", "model.path", "data.val_file", "trainer.resume"]
)
@pytest.mark.parametrize(
    ("value", "expected"),
    [("out\0put", "a path cannot hold a NUL byte"), ("~/runs", "verlite does not expand '~'")],
)
def test_a_path_that_cannot_be_meant_is_one_line(field: str, value: str, expected: str) -> None:
    assert f"{field}={value!r}: {expected}" in error_of(f"{field}={value}")


def test_overrides_are_typed_by_the_schema() -> None:
    cfg = load_config(
        ROOT / "configs" / "ppo_tiny.yaml",
        [
            "actor.loss_agg_mode=token-sum",
            "actor.optim.lr=3e-4",  # YAML 1.1 reads this as a string; the schema makes it a float
            "trainer.total_steps=7",
            "actor.use_dynamic_bsz=true",
            "actor.max_token_len_per_worker=64",
            "trainer.loggers=[console, jsonl, tensorboard]",
            "trainer.ray_address=127.0.0.1:6379",
            "trainer.resume=123",  # a str field keeps digits as text
            "model.path=null",
            "actor.optim.betas=[0.9, 0.95]",
        ],
    )
    assert cfg.actor.loss_agg_mode == "token-sum"
    assert cfg.actor.optim.lr == 3e-4
    assert cfg.trainer.total_steps == 7
    assert cfg.actor.use_dynamic_bsz is True
    assert cfg.trainer.loggers == ("console", "jsonl", "tensorboard")
    assert cfg.trainer.ray_address == "127.0.0.1:6379"
    assert cfg.trainer.resume == "123"
    assert cfg.model.path is None
    assert cfg.actor.optim.betas == (0.9, 0.95)


@pytest.mark.parametrize(
    "address",
    [
        "auto",
        "localhost:6379",
        "10.0.0.1:6379",
        "head.default.svc.cluster.local:6379",
        "[::1]:6379",
        "[fe80::1%eth0]:6379",  # link-local IPv6 with its zone, which Ray parses too
        "ray://head",
        "ray://head:10001",
        "ray://[::1]:10001",
    ],
)
def test_the_ray_addresses_users_write_are_accepted(address: str) -> None:
    """The forms ray.init connects to pass the field's check (its refusals: test_cli_errors's
    test_bad_override). Mutation: the IPv6 zone left out of the pattern -> the zone case
    fails."""
    cfg = load_config(ROOT / "configs" / "ppo_tiny.yaml", [f"trainer.ray_address={address}"])
    assert cfg.trainer.ray_address == address


def test_later_override_wins_and_value_may_contain_equals() -> None:
    cfg = load_config(None, [*BASE, "trainer.output_dir=a", "trainer.output_dir=b=c"])
    assert cfg.trainer.output_dir == "b=c"


def test_critic_inherits_actor_loss_settings_unless_set() -> None:
    cfg = load_config(
        None,
        [*BASE, "actor.loss_agg_mode=seq-mean-token-sum-norm", "rollout.max_response_length=12"],
    )
    assert cfg.actor.loss_scale_factor == 12  # the configured max response length
    assert cfg.critic.loss_agg_mode == "seq-mean-token-sum-norm"
    assert cfg.critic.loss_scale_factor == 12
    cfg = load_config(
        None, [*BASE, "actor.loss_agg_mode=token-sum", "critic.loss_agg_mode=token-mean"]
    )
    assert (cfg.actor.loss_agg_mode, cfg.critic.loss_agg_mode) == ("token-sum", "token-mean")
    cfg = load_config(
        None, [*BASE, "actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=100"]
    )
    assert cfg.critic.loss_scale_factor == 100


def test_critic_with_its_own_norm_mode_gets_the_response_length_as_scale() -> None:
    """The critic's mode may differ from the actor's: its scale default follows its own."""
    cfg = load_config(
        None,
        [*BASE, "critic.loss_agg_mode=seq-mean-token-sum-norm", "rollout.max_response_length=12"],
    )
    assert (cfg.actor.loss_agg_mode, cfg.actor.loss_scale_factor) == ("token-mean", None)
    assert cfg.critic.loss_scale_factor == 12
    cfg = load_config(
        None,
        [*BASE, "critic.loss_agg_mode=seq-mean-token-sum-norm", "critic.loss_scale_factor=7"],
    )
    assert cfg.critic.loss_scale_factor == 7


def test_workers_per_node_inherited_and_role_sizes() -> None:
    cfg = load_config(
        None,
        [
            *BASE,
            "trainer.nnodes=2",
            "trainer.workers_per_node=2",
            "critic.workers_per_node=1",
            "data.train_batch_size=32",
            "actor.ppo_mini_batch_size=16",
            "critic.ppo_mini_batch_size=8",
            "actor.micro_batch_size_per_worker=2",
            "critic.micro_batch_size_per_worker=4",
        ],
    )
    assert (cfg.actor.workers_per_node, cfg.critic.workers_per_node) == (2, 1)
    actor, critic = cfg.role_sizes("actor"), cfg.role_sizes("critic")
    assert (actor.dp_size, actor.mini_batch_size_per_worker, actor.num_mini_batches) == (4, 4, 2)
    assert (critic.dp_size, critic.mini_batch_size_per_worker, critic.num_mini_batches) == (2, 4, 4)


def test_rollout_resources_default_to_the_trainers_and_tis_may_run_on_policy() -> None:
    cfg = load_config(
        None,
        [
            *BASE,
            "trainer.workers_per_node=2",
            "trainer.cpus_per_worker=0.5",
            "rollout.placement=split",
            "rollout.gpus_per_worker=1",
            "algorithm.rollout_correction=tis",
        ],
    )
    rollout = cfg.rollout
    assert (rollout.workers_per_node, rollout.cpus_per_worker, rollout.gpus_per_worker) == (
        2,
        0.5,
        1,
    )
    assert cfg.rollout.max_staleness == 0 and cfg.roles == ["actor", "critic"]
    # one line for an invalid trainer value, not a second for the rollout that inherits it
    message = error_of("trainer.cpus_per_worker=-1")
    assert message.count("cpus_per_worker") == 1, message


@pytest.mark.parametrize("has_gpu", [False, True])
def test_auto_gpus_per_worker_is_resolved_at_load_from_this_machine(
    has_gpu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
    gpus = float(has_gpu)
    cfg = load_config(None, [*BASE, "trainer.gpus_per_worker=auto", "rollout.placement=split"])
    # the number, where the run and its logged config read it; the rollout inherits it
    assert (cfg.trainer.gpus_per_worker, cfg.rollout.gpus_per_worker) == (gpus, gpus)
    assert cfg.on_gpu is has_gpu and cfg.generates_on_gpu is has_gpu
    assert cfg.precision == ("bf16-mixed" if has_gpu else "fp32")
    split = load_config(
        None,
        [*BASE, "rollout.placement=split", "rollout.gpus_per_worker=auto"],
    )
    assert (split.trainer.gpus_per_worker, split.rollout.gpus_per_worker) == (0, gpus)
    # a config reloaded with overrides resolves again, from the file's auto; so does the
    # section validated on its own (a loaded config never holds the word)
    assert load_config(cfg, ["trainer.total_steps=3"]).trainer.gpus_per_worker == gpus
    assert TrainerConfig(gpus_per_worker="auto").gpus_per_worker == gpus


def test_ranks_of_a_training_group_on_cuda_do_not_share_a_gpu() -> None:
    """NCCL runs each rank of a group on its own GPU ("Duplicate GPU detected" otherwise,
    in the first collective inside a worker, on a GPU only): two actor workers per node with
    half a GPU each, which one GPU would hold, are refused at load; one worker per node, a
    GPU each (actor and critic may share one: two groups), or CPU workers are not."""
    half = ["trainer.gpus_per_worker=0.5", "trainer.workers_per_node=2"]
    micro = ["actor.micro_batch_size_per_worker=2", "critic.micro_batch_size_per_worker=2"]
    assert error_of("model.device=cuda", *half, *micro) == (
        "trainer.gpus_per_worker=0.5 with 2 actor workers per node puts several actor ranks "
        "on one GPU, which NCCL cannot join into one group; use trainer.gpus_per_worker=1 (a "
        "GPU per actor worker; actor and critic may share it), one actor worker per node, or "
        "model.device=cpu"
    )
    assert "2 critic workers" in error_of(
        "model.device=auto", *half, "actor.workers_per_node=1", *micro
    )
    for fine in (
        ["model.device=cuda", "trainer.gpus_per_worker=0.5"],
        ["model.device=cuda", "trainer.gpus_per_worker=1", "trainer.workers_per_node=2", *micro],
        ["model.device=cpu", *half, *micro],
    ):
        load_config(None, [*BASE, *fine])


@pytest.mark.parametrize("section", ["trainer", "rollout"])
def test_auto_gpus_per_worker_is_refused_for_a_cluster_and_other_words_are_named(
    section: str,
) -> None:
    message = error_of(f"{section}.gpus_per_worker=auto", "trainer.ray_address=10.0.0.1:6379")
    assert message == (
        f"{section}.gpus_per_worker=auto gives each worker a GPU when this machine has one, for "
        "an embedded Ray; on a Ray cluster, trainer.ray_address='10.0.0.1:6379', give the GPUs "
        "of one worker as a number (1: a GPU each, 0: CPU workers)"
    )
    # one line for a bad value, not one per member of the field's union, beside other errors
    both = error_of(f"{section}.gpus_per_worker=-1", "data.task=countdown")
    assert both.startswith("data.task='countdown': ") and both.endswith(
        f"; {section}.gpus_per_worker=-1: expected the GPUs of one worker (a number >= 0), or auto"
    )
    for value, echoed in (("many", "'many'"), ("true", "true"), (".inf", "inf")):
        assert error_of(f"{section}.gpus_per_worker={value}") == (
            f"{section}.gpus_per_worker={echoed}: expected the GPUs of one worker (a number >= 0), "
            "or auto"
        )


MOVED_STALENESS = (
    "trainer.max_staleness moved to rollout.max_staleness; set rollout.max_staleness instead"
)


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.max_staleness=1"],
        {"trainer.max_staleness": 1},
        {"trainer": {"max_staleness": 1}},
        ["trainer={max_staleness: 1, total_steps: 2}"],
    ],
    ids=["command line", "dotted key", "section mapping", "section on the command line"],
)
def test_a_moved_key_is_refused_in_one_line_that_names_its_new_place(
    overrides: list[str] | dict[str, object],
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"data": {"task": "copy"}}, overrides)
    assert str(info.value) == MOVED_STALENESS


def test_a_moved_key_in_a_config_file_is_refused_and_its_new_place_works(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text("data: {task: copy}\nrollout: {placement: split}\ntrainer: {max_staleness: 1}\n")
    assert error_of(path=old) == MOVED_STALENESS
    new = tmp_path / "new.yaml"
    new.write_text("data: {task: copy}\nrollout: {placement: split, max_staleness: 1}\n")
    assert load_config(new).rollout.max_staleness == 1
    assert (
        load_config(
            None, [*BASE, "rollout.placement=split", "rollout.max_staleness=2"]
        ).rollout.max_staleness
        == 2
    )


def test_derived_roles() -> None:
    assert load_config(None, BASE).use_critic
    grpo = load_config(
        None, [*BASE, "algorithm.adv_estimator=grpo", "rollout.n=2", "actor.use_kl_loss=true"]
    )
    assert not grpo.use_critic and grpo.use_reference
    # the critic's sizes are not checked when there is no critic
    load_config(
        None, [*BASE, "algorithm.adv_estimator=rloo", "rollout.n=2", "critic.ppo_mini_batch_size=5"]
    )


def test_configs_are_frozen() -> None:
    cfg = load_config(None, BASE)
    with pytest.raises(Exception, match="frozen"):
        cfg.actor.ppo_epochs = 3  # type: ignore[misc]


def all_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    found = [model]
    for field in model.model_fields.values():
        args = getattr(field.annotation, "__args__", ()) or (field.annotation,)
        for arg in args:
            if isinstance(arg, type) and issubclass(arg, BaseModel) and arg not in found:
                found += all_models(arg)
    return found


def test_every_field_has_a_description() -> None:
    for model in all_models(Config):
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


# ------------------------------------------------------------------------ error paths

ERRORS = [
    (["actor.lrr=1"], "unknown key 'actor.lrr'; did you mean 'actor.optim.lr'?"),
    (["trainer.totl_steps=3"], "did you mean 'trainer.total_steps'?"),
    (["actr.ppo_epochs=1"], "unknown key 'actr'; did you mean 'actor'?"),
    (["TRAINER.total_steps=3"], "unknown key 'TRAINER'; did you mean 'trainer'?"),
    (["actor.optim.LR=1"], "unknown key 'actor.optim.LR'; did you mean 'actor.optim.lr'?"),
    (
        ["actor.loss_agg_mode=mean"],
        "actor.loss_agg_mode='mean': unknown loss aggregation mode; allowed: token-mean, token-sum",
    ),
    (["critic.loss_agg_mode=sum"], "critic.loss_agg_mode='sum'"),
    (
        ["actor.policy_loss=ppo"],
        "actor.policy_loss='ppo': unknown policy loss; allowed: gspo, reinforce, vanilla",
    ),
    (
        ["algorithm.adv_estimator=ppo"],
        "algorithm.adv_estimator='ppo': unknown advantage estimator; allowed: gae, grpo",
    ),
    (["actor.kl_loss_type=k9"], "actor.kl_loss_type='k9': unknown KL kind; allowed: k1"),
    (["algorithm.kl_penalty=k3++"], "algorithm.kl_penalty='k3++'"),
    (
        ["actor.ppo_mini_batch_size=0"],
        "actor.ppo_mini_batch_size=0: Input should be greater than 0",
    ),
    (["data.train_batch_size=-4"], "data.train_batch_size=-4: Input should be greater than 0"),
    (["trainer.total_steps=ten"], "trainer.total_steps='ten': Input should be a valid integer"),
    (["actor.optim.lr=abc"], "actor.optim.lr='abc': Input should be a valid number"),
    (["rollout.top_p=1.5"], "rollout.top_p=1.5: Input should be less than or equal to 1"),
    (["rollout.temperature=1e-40"], "rollout.temperature=1e-40: must be 0 (greedy) or at least"),
    (["rollout.temperature=0.005"], "rollout.temperature=0.005: must be 0 (greedy) or at least"),
    (["actor.clip_ratio_c=0.5"], "actor.clip_ratio_c=0.5: Input should be greater than 1"),
    (
        ["trainer.loggers=[console, comet]"],
        "trainer.loggers[1]='comet': Input should be 'console', 'jsonl'",
    ),
    (
        ["trainer.placement=spread"],
        "trainer.placement='spread': Input should be 'colocate' or 'split'",
    ),
    (
        ["actor.ppo_mini_batch_size=12"],
        "actor.ppo_mini_batch_size=12 must divide the sequences per step, data.train_batch_size * rollout.n = 16 * 1 = 16",
    ),
    (
        ["trainer.workers_per_node=3"],
        "actor.ppo_mini_batch_size=16 must be divisible by the actor's 3 workers",
    ),
    (
        ["actor.micro_batch_size_per_worker=32"],
        "actor.micro_batch_size_per_worker=32 is larger than the per-worker mini-batch 16",
    ),
    (
        ["actor.micro_batch_size_per_worker=3"],
        "must be divisible by micro_batch_size_per_worker * workers = 3 * 1",
    ),
    (["critic.micro_batch_size_per_worker=32"], "critic.micro_batch_size_per_worker=32 is larger"),
    (
        ["actor.use_dynamic_bsz=true"],
        "actor.use_dynamic_bsz=true needs actor.max_token_len_per_worker (>= 48)",
    ),
    (
        ["actor.use_dynamic_bsz=true", "actor.max_token_len_per_worker=20"],
        "actor.max_token_len_per_worker=20 is below the longest sequence",
    ),
    (["trainer.workers_per_node=2", "actor.strategy=none"], "actor.strategy=none runs one worker"),
    (["algorithm.adv_estimator=grpo"], "rollout.n must be >= 2, got 1"),
    (  # the task came from the file: the line says so, and how to train on the file
        ["data.train_file=prompts.jsonl"],
        "data.task='copy' and data.train_file='prompts.jsonl' are both set: set exactly one of "
        "them (a synthetic task or a prompt file); data.task=null trains on the file",
    ),
    (["model.hidden_size=30"], "model.hidden_size=30 must be divisible by model.num_heads=4"),
    (  # a head of 3 dimensions: the first forward failed inside a worker (rotary sizes 3 vs 4)
        ["model.hidden_size=12"],
        "model.hidden_size=12 / model.num_heads=4 gives heads of 3 dimensions; rotary "
        "position embeddings rotate pairs of them: give each head an even number",
    ),
    (["data.min_digits=6"], "data.min_digits=6 must be <= data.max_digits=5"),
    (
        ["actor.optim=3"],
        "actor.optim=3: expected a section: a mapping of its fields, as in "
        "actor.optim={field: value, ...}, got an integer",
    ),
    (
        ["trainer=5", "trainer.total_steps=1"],
        "override 'trainer.total_steps=1': trainer is not a section here (the file or an "
        "earlier override set it to 5)",
    ),
    (
        ["trainer={total_steps: 5"],
        "override 'trainer={total_steps: 5': its value is not valid YAML (expected ',' or '}', "
        "but got '<stream end>'); a section is given as trainer={field: value, ...}",
    ),
    (["actor.optim.lr=[1"], "override 'actor.optim.lr=[1': its value is not valid YAML"),
    (
        ["trainer.total_steps=2020-13-45"],  # YAML's date, which cannot be built
        "override 'trainer.total_steps=2020-13-45': its value is not valid YAML (a value cannot "
        "be built: month must be in 1..12)",
    ),
    (
        ["trainer.total_steps=!!int x"],
        "its value is not valid YAML (a value cannot be built: invalid literal for int()",
    ),
    (["actor.optim.lr.x=1"], "actor.optim.lr is a value, not a section"),
    (  # verl's (Hydra's) way of setting one template variable
        ["data.chat_template_kwargs.enable_thinking=false"],
        "data.chat_template_kwargs is a value, not a section: cannot set "
        "'data.chat_template_kwargs.enable_thinking'; give the whole mapping: "
        "data.chat_template_kwargs={enable_thinking: ...}",
    ),
    (  # YAML reads {a:b} as the one key 'a:b', without a value
        ["data.chat_template_kwargs={enable_thinking:false}"],
        "override 'data.chat_template_kwargs={enable_thinking:false}': 'enable_thinking:false' "
        "is one key without a value, as YAML reads a colon without a space after it; write "
        "enable_thinking: false",
    ),
    (["trainer={total_steps:5}"], "'total_steps:5' is one key without a value"),
    (  # a credential-named key's value is masked, as in config.json (it was shown)
        ["data.chat_template_kwargs={api_token: [sk-live-abcdefgh12345678]}"],
        "data.chat_template_kwargs.api_token=***: expected a string, a number, true, false or null",
    ),
    (  # a size counted in tokens names no credential: its value is shown (it was masked)
        ["actor.max_token_len_per_worker=4k"],
        "actor.max_token_len_per_worker='4k': Input should be a valid integer",
    ),
    (  # a field that takes no text holds no credential, whatever its name (it was masked)
        ["model.logits_chunk_tokens=4k"],
        "model.logits_chunk_tokens='4k': Input should be a valid integer",
    ),
    (["rollout.stop_token_ids=abc"], "rollout.stop_token_ids='abc': Input should be a list"),
    (["actor.loss_scale_factor=-1"], "actor.loss_scale_factor=-1: Input should be greater than 0"),
    (
        ["rollout.max_staleness=-1"],
        "rollout.max_staleness=-1: Input should be greater than or equal to 0",
    ),
    (
        ["rollout.max_staleness=1"],
        "rollout.max_staleness=1 generates while the actor trains, which needs rollout.placement=split",
    ),
    (
        ["rollout.placement=apart"],
        "rollout.placement='apart': Input should be 'colocated' or 'split'",
    ),
    (["rollout.cpus_per_worker=0"], "rollout.cpus_per_worker=0: Input should be greater than 0"),
    (["rollout.sync_bucket_mb=0"], "rollout.sync_bucket_mb=0: Input should be greater than 0"),
    (
        ["algorithm.rollout_correction=tis", "rollout.temperature=0"],
        "algorithm.rollout_correction=tis weighs tokens by how likely the sampler made them, "
        "but rollout.temperature=0 samples greedily",
    ),
    (
        ["rollout.placement=split", "rollout.workers_per_node=32"],
        "32 rollout workers (trainer.nnodes=1 * rollout.workers_per_node=32) outnumber the 16 "
        "sequences of a step",
    ),
    (
        ["reward.model.path=rm", "reward.model.workers_per_node=32"],
        "32 reward model workers (trainer.nnodes=1 * reward.model.workers_per_node=32) "
        "outnumber the 16 sequences of a step",
    ),
    (
        ["algorithm.rollout_correction=is"],
        "algorithm.rollout_correction='is': Input should be 'none' or 'tis'",
    ),
    (["algorithm.rollout_is_cap=0"], "algorithm.rollout_is_cap=0: Input should be greater than 0"),
    (
        ["algorithm.recompute_old_log_probs=never"],
        "algorithm.recompute_old_log_probs='never': Input should be 'auto' or 'always'",
    ),
    (
        ["reward.remote.url=ftp://scorer/score"],
        "reward.remote.url='ftp://scorer/score': must be an http:// or https:// URL with a host",
    ),
    (["reward.remote.url=http:///score"], "reward.remote.url='http:///score': must be an http://"),
    (["reward.remote.url=http://h:99999/"], "reward.remote.url='http://h:99999/': the port must"),
    (
        ["reward.remote.url=https://me:hunter22@scorer/score"],
        "reward.remote.url='https://***@scorer/score': must not hold credentials",
    ),
    (
        ["reward.remote.url=https://scorer/score?model=a&api_key=hunter22"],
        "reward.remote.url='https://scorer/score': must not hold credentials (?api_key=***)",
    ),
    (
        ["reward.remote.url=http://scorer.internal:8000/score", "reward.remote.auth_env=SCORER"],
        "reward.remote.auth_env='SCORER' with an http:// URL to scorer.internal: the token "
        "would cross the network in cleartext; use https",
    ),
    (
        ["reward.remote.auth_env=sk-live-51Hx"],
        "reward.remote.auth_env must be the name of an environment variable",
    ),
    (["reward.remote.batch_size=0"], "reward.remote.batch_size=0: Input should be greater than 0"),
    (
        ["reward.remote.concurrency=1000"],
        "reward.remote.concurrency=1000: Input should be less than or equal to 256",
    ),
    (["reward.remote.timeout_s=0"], "reward.remote.timeout_s=0: Input should be greater than 0"),
    (
        ["reward.remote.max_retries=-1"],
        "reward.remote.max_retries=-1: Input should be greater than or equal to 0",
    ),
    (
        ["reward.remote.retry_backoff_s=-1"],
        "reward.remote.retry_backoff_s=-1: Input should be greater than or equal to 0",
    ),
    (
        [
            "reward.remote.url=http://127.0.0.1:8000/score",
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=64",
        ],
        "reward.remote.url with rollout.multi_turn.env='lookup': a multi-turn run is scored by "
        "its environment; unset one of them",
    ),
    (["actor.lora.rank=-1"], "actor.lora.rank=-1: Input should be greater than or equal to 0"),
    (["actor.lora.alpha=0"], "actor.lora.alpha=0: Input should be greater than 0"),
    (["actor.lora.dropout=1"], "actor.lora.dropout=1: Input should be less than 1"),
    (
        ["actor.lora.target_modules=[]"],
        "actor.lora.target_modules=[]: List should have at least 1 item, not 0",
    ),
    (
        ["actor.optim.betas=[0.9, 0.99, 0.999]"],
        "actor.optim.betas=[0.9, 0.99, 0.999]: List should have at most 2 items, not 3",
    ),
    (  # a short one was "actor.optim.betas.1: required field is missing", as if a field
        ["critic.optim.betas=[0.9]"],
        "critic.optim.betas=[0.9]: List should have 2 items, not 1",
    ),
    (["actor.optim.betas=[]"], "actor.optim.betas=[]: List should have 2 items, not 0"),
    (["foo"], "malformed override 'foo': no '='; write dotted.key=value as one word"),
    (  # trainer.total_steps = 5, split by the shell
        ["trainer.total_steps", "=", "5"],
        "malformed override 'trainer.total_steps': no '='; write dotted.key=value as one word "
        "(no spaces around '='), e.g. actor.loss_agg_mode=token-sum",
    ),
    (["=3"], "malformed override '=3'"),
    (["actor..lr=3"], "malformed override 'actor..lr=3'"),
]


@pytest.mark.parametrize(("overrides", "expected"), ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_error_names_field_value_and_what_is_allowed(overrides: list[str], expected: str) -> None:
    assert expected in error_of(*overrides)


def test_an_invalid_actor_value_is_reported_once() -> None:
    message = error_of("actor.loss_agg_mode=mean")
    assert message.count("unknown loss aggregation mode") == 1


def test_missing_data_source_is_reported() -> None:
    with pytest.raises(ConfigError, match="data: required field is missing"):
        load_config(None, [])


def test_file_errors(tmp_path: Path) -> None:
    assert "cannot read config file" in error_of(path=tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert "must hold a mapping of sections" in error_of(path=tmp_path / "list.yaml")
    assert "got a list" in error_of(path=tmp_path / "list.yaml")
    for text, kind in (("5", "an integer"), ("hello", "a string")):  # said "a int", "a str"
        (tmp_path / "scalar.yaml").write_text(text + "\n")
        assert error_of(path=tmp_path / "scalar.yaml").endswith(f"model:, data:, ..., got {kind}")
    (tmp_path / "bad.yaml").write_text("data:\n  task: [copy\n")
    assert "is not valid YAML at line" in error_of(path=tmp_path / "bad.yaml")
    (tmp_path / "colon.yaml").write_text("data: {task: copy}\ntrainer: {total_steps:5}\n")
    assert "'total_steps:5' is one key without a value" in error_of(path=tmp_path / "colon.yaml")
    (tmp_path / "section.yaml").write_text("data: 3\n")
    assert "data=3: expected a section: a mapping of its fields" in error_of(
        path=tmp_path / "section.yaml"
    )
    for text in ("", "\n# a comment\n"):  # was: "data: required field is missing"
        (tmp_path / "empty.yaml").write_text(text)
        assert error_of(path=tmp_path / "empty.yaml") == (
            f"config file {str(tmp_path / 'empty.yaml')!r} is empty (comments and blank lines "
            "aside); it must hold a mapping of sections: model:, data:, ..."
        )
    (tmp_path / "null.yaml").write_text("null\n")  # a document: what it holds is named
    assert error_of(path=tmp_path / "null.yaml").endswith("model:, data:, ..., got null")
    # With overrides an empty file is the base they fill, as a config of overrides alone is.
    for name in ("empty.yaml", "null.yaml"):
        assert load_config(tmp_path / name, BASE) == load_config(None, BASE)
    # a list's item by its index, as every message names a place in a file
    (tmp_path / "items.yaml").write_text("data: {task: copy}\nx: [{a: 1}, {b: 1, b: 2}]\n")
    assert "sets x[1].b twice (line 2)" in error_of(path=tmp_path / "items.yaml")


@pytest.mark.parametrize(
    "override",
    [
        "trainer.total_steps=10000000000000000000000000000",
        "data.train_batch_size=2147483648",
        "trainer.seed=-1",
    ],
)
def test_sizes_and_seeds_outside_32_bits_are_refused(override: str) -> None:
    key = override.split("=")[0]
    message = error_of(override)
    assert message.startswith(key) and (
        "less than or equal to 2147483647" in message or "greater than or equal to 0" in message
    )


def test_a_pasted_megabyte_is_quoted_shortened_and_a_too_long_path_is_one_line(
    tmp_path: Path,
) -> None:
    message = error_of("actor.loss_agg_mode=" + "b" * 100_000)
    assert len(message) < 400 and "[...]" in message
    assert len(error_of("z" * 5000 + "=1")) < 2000
    too_long = str(tmp_path / ("a" * 5000))
    with pytest.raises(ConfigError, match=r"model\.path=.*\[\.\.\.\].*: File name too long"):
        check_paths(load_config(None, [*BASE, f"model.path={too_long}"]))


def test_yaml_aliases_that_expand_past_the_bound_are_refused_in_linear_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 450 bytes that expand to 1.2e9 values: walking the expansion (as the duplicate-key
    # check once did, ~10x per level) would take hours. Counted, not timed: each check of
    # the file walks each value written in it (an alias once) at most once, and fails at
    # the first step past that.
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    written = sum(
        isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionStartEvent))
        for event in yaml.parse(bomb.read_text())
    )
    walked: Counter[str] = Counter()

    def counting(walk: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            walked[walk.__name__] += 1
            assert walked[walk.__name__] <= written, f"{walk.__name__} walks the expansion"
            return walk(*args, **kwargs)

        return counted

    with monkeypatch.context() as patch:
        for name in ("_expanded_size", "_refuse_duplicate_keys"):
            patch.setattr(yaml_files, name, counting(getattr(yaml_files, name)))
        message = error_of(path=bomb)
    assert "expands to 1,234,567,909 values through YAML aliases" in message
    assert walked["_expanded_size"] > 0  # counted
    # A few aliases are fine, and a key set twice under a shared node is still found once.
    shared = tmp_path / "shared.yaml"
    shared.write_text("x: &t {task: copy, task: add}\ndata: *t\n")
    assert "sets x.task twice" in error_of(path=shared)
    deep = tmp_path / "deep.yaml"
    deep.write_text("data: " + "[" * 5000 + "]" * 5000 + "\n")
    assert "nests too deeply to read" in error_of(path=deep)


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text("data: !!python/object/apply:os.system ['echo pwned']\n")
    assert "is not valid YAML" in error_of(path=evil)
    # a value YAML cannot build is one line too, not a traceback
    evil.write_text("data: {task: copy}\ntrainer: {total_steps: 2020-13-45}\n")
    assert error_of(path=evil) == (
        f"config file '{evil}' is not valid YAML: a value cannot be built: month must be in 1..12"
    )


def test_check_paths(tmp_path: Path) -> None:
    cfg = load_config(None, ["data.train_file=" + str(tmp_path / "nope.jsonl")])
    with pytest.raises(ConfigError, match=r"data\.train_file=.*nope\.jsonl.*no such file"):
        check_paths(cfg)
    (tmp_path / "p.jsonl").write_text("{}\n")
    check_paths(load_config(None, ["data.train_file=" + str(tmp_path / "p.jsonl")]))


def test_check_paths_resolves_each_path_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """check_paths resolved every input twice: to see that it exists (check_inputs), and
    again to compare it with the output folder; once now, the same overlap refused."""
    from verlite.config import loading

    resolved: list[str] = []
    resolve = loading.resolved_path
    monkeypatch.setattr(
        loading,
        "resolved_path",
        lambda value, named, **kw: resolved.append(str(value)) or resolve(value, named, **kw),
    )
    train, out, resume = tmp_path / "p.jsonl", tmp_path / "out", tmp_path / "ckpt"
    train.write_text("{}\n")
    paths = [f"data.train_file={train}", f"trainer.output_dir={out}", f"trainer.resume={resume}"]
    check_paths(load_config(None, paths))
    assert sorted(resolved) == sorted(map(str, [train, out, resume]))
    with pytest.raises(ConfigError, match=r"trainer.output_dir=.* overlaps data.train_file="):
        check_paths(load_config(None, [*paths, f"trainer.output_dir={tmp_path}"]))


def test_a_data_file_that_is_a_folder_pipe_or_device_is_refused_before_reading(
    tmp_path: Path,
) -> None:
    # Opening a pipe with no writer blocks forever; /dev/zero never ends.
    os.mkfifo(tmp_path / "pipe.jsonl")
    for path in (tmp_path / "pipe.jsonl", Path("/dev/zero"), tmp_path):
        cfg = load_config(None, [*BASE, f"data.val_file={path}"])
        with pytest.raises(ConfigError, match=r"data\.val_file=.*: not a regular file"):
            check_paths(cfg)


def test_a_config_file_that_never_ends_is_refused_after_a_bounded_read(tmp_path: Path) -> None:
    assert "is larger than 1,048,576 bytes" in error_of(path=Path("/dev/zero"))
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    assert "is larger than" in error_of(path=big)


def test_the_config_reference_is_current_and_covers_every_field() -> None:
    from verlite.config.reference import config_reference

    reference = config_reference()
    assert (ROOT / "docs" / "config.md").read_text() == reference, "run `make docs`"

    def fields(model: type, prefix: str) -> list[str]:
        found = []
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                found += [f"## `{prefix}{name}`", *fields(sub, f"{prefix}{name}.")]
            else:
                found.append(f"| `{name}` |")
        return found

    for entry in fields(Config, ""):
        assert entry in reference, entry
    for old, new in MOVED_KEYS.items():
        assert f"| `{old}` | `{new}` |" in reference


def test_credentials_given_for_the_remote_verifier_are_never_shown() -> None:
    assert "hunter22" not in error_of("reward.remote.url=https://me:hunter22@scorer/score")
    assert "hunter22" not in error_of("reward.remote.url=ftp://scorer/score?token=hunter22")
    assert "hunter22" not in error_of("reward.remote.url=http://scorer/score?sig=hunter22")
    # A token pasted where the variable's name belongs.
    assert "sk-live-51Hx" not in error_of("reward.remote.auth_env=sk-live-51Hx")


def test_each_override_is_read_once_and_sets_the_fields_it_names(monkeypatch) -> None:
    """load_config parsed every string override twice (once into the config, once into the
    overrides alone, whose fields are Config.explicit): each is parsed once now, placed in
    both, and the fields it sets are the same, a section given as a mapping included."""
    from verlite.config import loading

    parsed: list[str] = []
    load_text = loading.load_text
    monkeypatch.setattr(loading, "load_text", lambda text: parsed.append(text) or load_text(text))
    overrides = ["actor.optim.lr=0.5", "critic={ppo_epochs: 2, optim.lr: 0.25}", "data.task=copy"]
    cfg = load_config(None, overrides)
    assert parsed == ["0.5", "{ppo_epochs: 2, optim.lr: 0.25}"]
    assert (cfg.actor.optim.lr, cfg.critic.ppo_epochs, cfg.critic.optim.lr) == (0.5, 2, 0.25)
    assert {"actor.optim.lr", "critic.ppo_epochs", "critic.optim.lr", "data.task"} == set(
        cfg.explicit
    )
    mapped = load_config(None, {"critic": {"ppo_epochs": 2, "optim.lr": 0.25}, "data.task": "copy"})
    assert set(mapped.explicit) == {"critic.ppo_epochs", "critic.optim.lr", "data.task"}


def test_a_recorded_config_is_read_back_from_its_dotted_keys() -> None:
    """A checkpoint records the config by dotted key (config.flatten: a section's fields each
    under its own, a mapping-valued field such as reward.combine one value, an empty one
    too); recorded_config reads it back (config.unflatten)."""
    from verlite.config import flatten, recorded_config, unflatten

    cfg = load_config(TINY, ["reward.combine={fn: 1.0}", "actor.lora.target_modules=[q_proj]"])
    dumped = cfg.model_dump(mode="json")
    flat = flatten(dumped)
    assert flat["reward.combine"] == {"fn": 1.0} and flat["actor.lora.target_modules"] == ["q_proj"]
    assert flat["data.chat_template_kwargs"] == {} and flat["actor.optim.lr"] == cfg.actor.optim.lr
    assert unflatten(flat) == dumped
    recorded = recorded_config(flat)
    assert recorded is not None and recorded.model_dump() == cfg.model_dump()
    assert recorded_config({**flat, "trainer.removed_setting": 1}) is None


@pytest.mark.parametrize(
    ("value", "given"), [("[1]", "=[1]"), ("{b: 1}", "")], ids=["list", "mapping"]
)
def test_a_template_variable_that_is_no_scalar_is_one_message(value: str, given: str) -> None:
    # It was pydantic's four-part union error, one part per scalar type.
    with pytest.raises(ConfigError) as exc:
        load_config(
            TINY,
            [
                "model.path=/models/chat",
                "data.chat_template=true",
                f"data.chat_template_kwargs={{a: {value}}}",
            ],
        )
    assert str(exc.value) == (
        f"data.chat_template_kwargs.a{given}: expected a string, a number, true, false or null"
    )
    variables = "{a: 1, b: x, c: null, d: 1.5, e: true}"
    cfg = load_config(
        TINY,
        [
            "model.path=/models/chat",
            "data.chat_template=true",
            f"data.chat_template_kwargs={variables}",
        ],
    )
    assert cfg.data.chat_template_kwargs == {"a": 1, "b": "x", "c": None, "d": 1.5, "e": True}
    assert [type(v) for v in cfg.data.chat_template_kwargs.values()][:2] == [int, str]
