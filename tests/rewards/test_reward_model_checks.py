"""What ``reward.model`` and ``reward.combine`` refuse, each in one line naming the field:
in config validation, and at start-up before Ray (``verlite train`` exits 2 without a
traceback) for a reward-model folder that is missing or holds no usable classifier; and
the weighted sum of ``rewards.combine``."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from chat_model_support import save_chat_model
from reward_model_support import chat_reward_tokenizer, save_tiny_reward_model
from transformers import (
    AutoModelForCausalLM,
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
)

from verlite.cli import main
from verlite.config import ConfigError, load_config
from verlite.driver.preflight import RunInputs
from verlite.errors import RunFailure
from verlite.models.reward_model import check_reward_model
from verlite.rewards.combine import combine_scores

CONFIG = "configs/ppo_tiny.yaml"
URL = "http://127.0.0.1:8000/score"

CONFIG_ERRORS = [
    (
        ["reward.combine={model: 1}"],
        "reward.combine.model: not a configured reward source (reward.model.path is unset); "
        "configured: fn",
    ),
    (
        ["reward.combine={fn: 1, judge: 1}"],
        "reward.combine.judge: not a configured reward source; configured: fn",
    ),
    (["reward.combine={fn: -0.5}"], "reward.combine.fn=-0.5: weights must be >= 0"),
    (
        ["reward.model.path=rm", "reward.combine={fn: 0, model: 0}"],
        "reward.combine={'fn': 0.0, 'model': 0.0}: no source has a weight > 0",
    ),
    (["reward.combine={}"], "reward.combine={}: no source has a weight > 0"),
    (
        ["reward.combine={fn:0.5,model:0.5}"],
        "override 'reward.combine={fn:0.5,model:0.5}': 'fn:0.5' is one key without a value, as "
        "YAML reads a colon without a space after it; write fn: 0.5",
    ),
    (
        ["reward.model.path=rm", "reward.combine={fn: 1}"],
        "reward.combine={'fn': 1.0} leaves out model, but reward.model.path is set",
    ),
    (["reward.combine={fn: .nan}"], "reward.combine.fn=nan: Input should be a finite number"),
    (
        ["reward.model.path=rm", f"reward.remote.url={URL}"],
        "reward.model.path and reward.remote.url are both set: give reward.combine",
    ),
    (
        [f"reward.remote.url={URL}", "reward.combine={fn: 1}"],
        "reward.combine={'fn': 1.0} leaves out remote, but reward.remote.url is set",
    ),
    (
        ["reward.fn=exact_match", f"reward.remote.url={URL}"],
        "reward.fn='exact_match' is set, but reward.combine={'remote': 1.0} leaves out fn",
    ),
    (
        ["reward.combine={remote: 1}"],
        "reward.combine.remote: not a configured reward source (reward.remote.url is unset)",
    ),
    (
        [
            "reward.model.path=rm",
            "rollout.multi_turn.env=lookup",
            "rollout.multi_turn.max_total_length=24",
        ],
        "reward.model.path='rm' with rollout.multi_turn.env='lookup': a multi-turn run is "
        "scored by its environment",
    ),
    (
        ["reward.model.micro_batch_size_per_worker=0"],
        "reward.model.micro_batch_size_per_worker=0: Input should be greater than 0",
    ),
    (["reward.model.workers_per_node=0"], "reward.model.workers_per_node=0: Input should be"),
    (
        ["reward.model.path=rm", "reward.model.chat_template=always"],
        "reward.model.chat_template='always': allowed: auto, true, false",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "expected"), CONFIG_ERRORS, ids=[e[1][:40] for e in CONFIG_ERRORS]
)
def test_config_errors_name_the_field(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(CONFIG, overrides)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_combine_defaults_to_the_reward_model_or_the_remote_verifier_when_one_is_set() -> None:
    assert load_config(CONFIG, []).reward.combine == {"fn": 1.0}
    with_model = load_config(
        CONFIG,
        [
            "reward.model.path=rm",
            "trainer.workers_per_node=2",
            "actor.micro_batch_size_per_worker=8",
            "critic.micro_batch_size_per_worker=8",
        ],
    )
    assert with_model.reward.combine == {"model": 1.0}
    assert with_model.reward.model.workers_per_node == 2  # the trainer's, like the critic's
    remote = load_config(CONFIG, [f"reward.remote.url={URL}"])
    assert remote.reward.combine == {"remote": 1.0}
    mixed = load_config(CONFIG, [f"reward.remote.url={URL}", "reward.combine={fn: 1, remote: 3}"])
    assert mixed.reward.combine == {"fn": 1.0, "remote": 3.0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm_checks")
    good = save_tiny_reward_model(root / "good")
    two_labels = save_tiny_reward_model(root / "two_labels", num_labels=2)
    small_vocab = save_tiny_reward_model(root / "small_vocab", vocab_size=8)
    causal = root / "causal"
    AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(causal)
    encoder = root / "encoder"
    BertForSequenceClassification(
        BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=1,
        )
    ).save_pretrained(encoder)
    # A template that takes no conversation without a system turn (the main job has none).
    system_first = (
        "{%- if messages[0]['role'] != 'system' %}"
        "{{- raise_exception('a system turn must come first') }}{%- endif %}"
    )
    save_tiny_reward_model(
        root / "system_first", tokenizer=chat_reward_tokenizer(system_first), max_positions=256
    )
    save_tiny_reward_model(root / "chat", tokenizer=chat_reward_tokenizer(), max_positions=256)
    broken = chat_reward_tokenizer("{% for m in messages %}{{ m['content'] }")
    save_tiny_reward_model(root / "broken_template", tokenizer=broken, max_positions=256)
    no_tokenizer = root / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(good / name, no_tokenizer / name)
    return {
        "good": good,
        "two_labels": two_labels,
        "causal": causal,
        "encoder": encoder,
        "no_tokenizer": no_tokenizer,
        "small_vocab": small_vocab,
        "system_first": root / "system_first",
        "chat": root / "chat",
        "broken_template": root / "broken_template",
    }


@pytest.mark.parametrize(
    ("folder", "extra", "expected"),
    [
        ("missing", [], "reward.model.path='{path}': no such file or directory"),
        (
            "causal",
            [],
            "reward.model.path='{path}' is not a sequence-classification model "
            "(config.json architectures: ['LlamaForCausalLM'])",
        ),
        (
            "encoder",
            [],
            "reward.model.path='{path}': BertForSequenceClassification is not a decoder "
            "classifier whose score head reads the last token",
        ),
        (
            "two_labels",
            [],
            "reward.model.path='{path}' has num_labels=2; a reward model has one "
            "label, whose sigmoid is the score",
        ),
        ("no_tokenizer", [], "reward.model.path='{path}': no tokenizer loads from it"),
        (
            "small_vocab",
            [],
            "reward.model.path='{path}': its tokenizer has 62 tokens but the model's "
            "vocabulary holds 8 (config.json vocab_size)",
        ),
        (
            "good",
            ["reward.model.max_length=65"],
            "reward.model.max_length=65 is more than the model's max_position_embeddings=64",
        ),
        (
            "good",
            ["reward.model.chat_template=true"],
            "reward.model.chat_template=true, but the tokenizer of reward.model.path='{path}' "
            "has no chat template",
        ),
        (
            "system_first",
            [],
            "the chat template of reward.model.path='{path}' fails on a conversation of turns "
            "['user', 'assistant'] (reward.model.chat_template=auto; false scores the prompt and "
            "response as plain text): 'TemplateError: a system turn must come first'",
        ),
        (
            "system_first",
            ["reward.model.chat_template=true"],
            "the chat template of reward.model.path='{path}' fails on a conversation of turns "
            "['user', 'assistant'] (reward.model.chat_template=true; false scores the prompt and "
            "response as plain text): 'TemplateError: a system turn must come first'",
        ),
        (
            "broken_template",
            [],
            "the chat template of reward.model.path='{path}' cannot be parsed (line 1: "
            "unexpected '}}'); fix it in the folder's tokenizer, or set "
            "reward.model.chat_template=false",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and "=" not in value else "",
)
def test_a_reward_model_that_cannot_score_is_one_line_before_ray(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    folders: dict[str, Path],
    folder: str,
    extra: list[str],
    expected: str,
) -> None:
    path = folders.get(folder, tmp_path / "missing")
    code = main(
        [
            "train",
            "--config",
            CONFIG,
            f"reward.model.path={path}",
            f"trainer.output_dir={tmp_path / 'out'}",
            *extra,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("verlite: error: ") and err.count("\n") == 1, err
    assert expected.format(path=path) in err
    assert "(worker group" not in err  # before Ray: not a worker's refusal


@pytest.mark.parametrize(
    ("folder", "setting", "reads"),
    [
        ("chat", "auto", True),
        ("chat", "true", True),
        ("chat", "false", False),
        ("good", "auto", False),
        ("broken_template", "false", False),  # a template it does not read: not parsed
    ],
)
def test_the_run_knows_whether_its_reward_model_reads_conversations(
    tmp_path: Path, folders: dict[str, Path], folder: str, setting: str, reads: bool
) -> None:
    """Start-up's answer, which decides whether the driver's scorer sends the prompts'
    conversations to the reward workers (``Scorer``): only a reward model that reads them
    in its chat template gets them (``auto`` without a template does not). Mutation: the
    answer left False (the e2e chat run fails: its workers get no conversations) or
    ``auto`` taken as reading (the template-less case fails)."""
    cfg = load_config(
        CONFIG,
        [
            f"reward.model.path={folders[folder]}",
            f"reward.model.chat_template={setting}",
            f"trainer.output_dir={tmp_path / 'out'}",
        ],
    )
    inputs = RunInputs.load(cfg)
    inputs.folder.release()
    assert inputs.reward_model_reads_chat is reads


def _reading_fails(monkeypatch: pytest.MonkeyPatch, target: Path, code: int) -> None:
    """Opening ``target`` raises OSError ``code`` (as a failing read does: no file name)."""
    real_open = builtins.open

    def failing_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(file, (str, os.PathLike)) and Path(file) == target:
            raise OSError(code, os.strerror(code))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", failing_open)  # Hugging Face's loader
    monkeypatch.setattr(io, "open", failing_open)  # Path.open, the model folder's check


@pytest.mark.parametrize(("code", "exit_code"), [(errno.EIO, 1), (errno.EACCES, 2)])
def test_an_io_error_reading_the_config_json_is_not_the_users(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    folders: dict[str, Path],
    code: int,
    exit_code: int,
) -> None:
    """An I/O error (EIO) reading reward.model.path's config.json is the machine's: one line
    naming the file, exit 1; a file this user may not read is the user's, exit 2, at load
    (the model folder's check) and in the model's config loader alike."""
    target = folders["good"] / "config.json"
    args = [f"reward.model.path={folders['good']}", f"trainer.output_dir={tmp_path / 'out'}"]
    cfg = load_config(CONFIG, args)
    _reading_fails(monkeypatch, target, code)
    assert main(["train", "--config", CONFIG, *args]) == exit_code
    err = capsys.readouterr().err
    assert err.startswith("verlite: error: ") and err.count("\n") == 1, err
    if code == errno.EIO:
        assert err == (
            f"verlite: error: reading reward.model.path's config.json {str(target)!r} failed: "
            "Input/output error (an I/O error of this machine, not the file's content; try "
            "again)\n"
        )
    else:
        assert f"cannot read reward.model.path's config.json {str(target)!r}" in err
    with pytest.raises(RunFailure if code == errno.EIO else ConfigError) as info:
        check_reward_model(cfg.reward.model)
    named = str(target) if code == errno.EIO else f"reward.model.path={str(folders['good'])!r}"
    assert named in str(info.value)


def test_combine_is_the_weighted_sum_with_each_sources_mean() -> None:
    combined = combine_scores(
        {"fn": [1.0, 0.0, 0.5], "model": [0.2, 0.4, 0.9]}, {"fn": 0.5, "model": 2.0}
    )
    assert combined.scores == pytest.approx([0.9, 0.8, 2.05])
    assert combined.metrics == pytest.approx({"reward/fn/mean": 0.5, "reward/model/mean": 0.5})
    with pytest.raises(ValueError, match=r"scored \(fn\) are not the sources weighed"):
        combine_scores({"fn": [1.0]}, {"fn": 1.0, "model": 1.0})
    with pytest.raises(ValueError, match="different numbers of responses: fn 2, model 1"):
        combine_scores({"fn": [1.0, 0.0], "model": [0.5]}, {"fn": 1.0, "model": 1.0})


def test_a_later_prompts_turns_the_reward_template_refuses_stop_the_run_before_ray(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, folders: dict[str, Path]
) -> None:
    """A prompt file of conversations, verl's format: the first rows have no system turn,
    the last one has; a reward model whose template has no system role fails on that row's
    conversation at start-up, in one line naming its turns, not at the step that scores it.
    Mutation: the first prompt's conversation alone rendered -> the run starts (and stops at
    its first step's scoring)."""
    save_chat_model(tmp_path / "policy")
    question = [{"role": "user", "content": "What is 6 x 7?"}]
    rows = [question] * 15 + [[{"role": "system", "content": "Be brief."}, *question]]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": row, "answer": "42"}) + "\n" for row in rows))
    save_tiny_reward_model(
        tmp_path / "no_system",
        tokenizer=chat_reward_tokenizer(
            "{%- for m in messages %}{%- if m['role'] == 'system' %}"
            "{{- raise_exception('System role not supported') }}{%- endif %}"
            "{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
        ),
        max_positions=256,
    )
    capsys.readouterr()  # the folders' saving progress
    code = main(
        [
            "train",
            "--config",
            CONFIG,
            f"model.path={tmp_path / 'policy'}",
            "data.task=null",
            f"data.train_file={prompts}",
            f"data.val_file={prompts}",
            "data.chat_template=true",
            "data.max_prompt_length=64",
            "data.train_batch_size=16",
            f"reward.model.path={tmp_path / 'no_system'}",
            f"trainer.output_dir={tmp_path / 'out'}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1, err
    assert (
        f"the chat template of reward.model.path='{tmp_path / 'no_system'}' fails on a "
        "conversation of turns ['system', 'user', 'assistant'] (reward.model.chat_template=auto; "
        "false scores the prompt and response as plain text): 'TemplateError: System role not "
        "supported'"
    ) in err
    assert not (tmp_path / "out").exists()  # refused before the run's folder, and Ray
