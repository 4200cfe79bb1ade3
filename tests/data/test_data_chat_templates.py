"""Prompts as the policy reads them: the tokenizer's own chat template (data.chat_template)
with an optional system turn and instruction suffix, tokenized once as ``apply_chat_template``
tokenizes it, through the batches a run draws; and the default path as it always was."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from chat_model_support import (
    BOS_TEMPLATE,
    PROBLEMS,
    QWEN3_TEMPLATE,
    QWEN_TEMPLATE,
    THINKING_TEMPLATE,
    VERL_INSTRUCTION,
    save_chat_model,
    write_gsm8k_parquet,
    write_verl_gsm8k_parquet,
)
from transformers import PreTrainedTokenizerBase

from verlite.config import Config, load_config
from verlite.data import (
    DataError,
    PromptDataset,
    build_datasets,
    load_tokenizer,
    record_conversation,
)
from verlite.driver.step_source import StepSource

SYSTEM = "You are a careful tutor."
SUFFIX = "Put the final answer after ####."


def file_config(folder: Path, path: Path, *overrides: str) -> Config:
    """The main job's config over the prompt file ``path`` (validation: the same file, in
    file order) and the chat model saved in ``folder``."""
    return load_config(
        "configs/ppo_tiny.yaml",
        [
            f"model.path={folder}",
            "data.task=null",
            f"data.train_file={path}",
            f"data.val_file={path}",
            "data.train_batch_size=4",
            "data.shuffle=false",
            "actor.ppo_mini_batch_size=4",
            "actor.micro_batch_size_per_worker=4",
            "critic.ppo_mini_batch_size=4",
            "critic.micro_batch_size_per_worker=4",
            *overrides,
        ],
    )


def gsm8k_config(folder: Path, *overrides: str) -> Config:
    """:func:`file_config` over a GSM8K parquet, by its own fields."""
    path = write_gsm8k_parquet(folder / "gsm8k.parquet")
    return file_config(
        folder,
        path,
        "data.prompt_key=question",
        "data.answer_rule=gsm8k",
        "data.max_prompt_length=128",
        *overrides,
    )


def refusal(cfg: Config) -> str:
    """The one-line error that building ``cfg``'s datasets with its model's tokenizer raises."""
    with pytest.raises(DataError) as exc:
        build_datasets(cfg, load_tokenizer(cfg.model.path))
    return str(exc.value)


def drawn_step(cfg: Config, tokenizer: PreTrainedTokenizerBase, train: PromptDataset):
    """The first step's prompts, as the run's step source draws and tokenizes them."""
    source = StepSource(
        cfg,
        actor=None,
        rollout=None,
        tokenizer=tokenizer,
        train_set=train,
        sampling=None,
        actor_split=None,
        with_old=False,
        with_reference=False,
    )
    return source._draw(1)


def real_tokens(td) -> list[list[int]]:
    return [
        row[mask.bool()].tolist()
        for row, mask in zip(td["input_ids"], td["attention_mask"], strict=True)
    ]


def template_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)[
        "input_ids"
    ]


@pytest.mark.parametrize(
    ("template", "bos"), [(QWEN_TEMPLATE, False), (BOS_TEMPLATE, True)], ids=["qwen", "with bos"]
)
def test_prompts_are_the_tokens_of_apply_chat_template(
    tmp_path: Path, template: str, bos: bool
) -> None:
    save_chat_model(tmp_path, template, bos=bos)
    cfg = gsm8k_config(
        tmp_path,
        "data.chat_template=true",
        f"data.system_prompt={SYSTEM}",
        f"data.prompt_suffix={SUFFIX}",
    )
    tokenizer = load_tokenizer(cfg.model.path)  # as the run loads it, from the folder
    train, val = build_datasets(cfg, tokenizer)
    expected = [
        template_ids(
            tokenizer,
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{question} {SUFFIX}"},
            ],
        )
        for question, _, _ in PROBLEMS
    ]
    if bos:  # the template's BOS, once: verlite adds none of its own
        assert all(ids[0] == tokenizer.bos_token_id != ids[1] for ids in expected)
    assert real_tokens(drawn_step(cfg, tokenizer, train).prompts) == expected[:4]
    source = StepSource.__new__(StepSource)  # validation draws through the same path
    source.cfg, source.tokenizer = cfg, tokenizer
    assert real_tokens(source._tensordict(list(val), repeat=1, temperature=0.0)) == expected
    # Rewards receive the rendered text and the answer the rule took.
    assert val[0]["prompt"] == tokenizer.decode(expected[0]) and val[0]["answer"] == "72"


# The training prompts' fingerprint of the settings below, as verlite wrote it before records
# kept their messages: checkpoints written then resume.
CHAT_TRAIN_FINGERPRINT = "36acc6bcf9ecf8e72a7857ef826b987e1a8dcbab58a6c87826c7feb307d6289c"


def test_a_record_keeps_the_conversation_the_policy_read(tmp_path: Path) -> None:
    """What a reward model reading its own chat template gets of a prompt: the messages the
    policy's template rendered (the system turn, the question with the suffix), not the
    rendered text; without a template, the prompt and suffix as the user's turn. The
    datasets' fingerprint stays that of the prompts and answers. Mutations: the rendered
    prompt as the user's turn; the fingerprint over the whole record."""
    save_chat_model(tmp_path)
    cfg = gsm8k_config(
        tmp_path,
        "data.chat_template=true",
        f"data.system_prompt={SYSTEM}",
        f"data.prompt_suffix={SUFFIX}",
    )
    train, _ = build_datasets(cfg, load_tokenizer(cfg.model.path))
    assert [record_conversation(r) for r in train] == [
        (
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{question} {SUFFIX}"},
        )
        for question, _, _ in PROBLEMS
    ]
    assert train.fingerprint == {"records": len(PROBLEMS), "sha256": CHAT_TRAIN_FINGERPRINT}
    plain = gsm8k_config(tmp_path, f"data.prompt_suffix={SUFFIX}")
    train, _ = build_datasets(plain, load_tokenizer(plain.model.path))
    assert [record_conversation(r) for r in train] == [
        ({"role": "user", "content": f"{question} {SUFFIX}"},) for question, _, _ in PROBLEMS
    ]


def test_without_a_system_prompt_the_conversation_is_the_user_turn(tmp_path: Path) -> None:
    save_chat_model(tmp_path)
    cfg = gsm8k_config(tmp_path, "data.chat_template=true")
    tokenizer = load_tokenizer(cfg.model.path)
    _, val = build_datasets(cfg, tokenizer)
    question = PROBLEMS[1][0]
    assert val[1]["prompt"] == (f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def test_a_suffix_without_a_template_follows_the_prompt_after_a_space(tmp_path: Path) -> None:
    save_chat_model(tmp_path)
    cfg = gsm8k_config(tmp_path, f"data.prompt_suffix={SUFFIX}")
    tokenizer = load_tokenizer(cfg.model.path)
    _, val = build_datasets(cfg, tokenizer)
    assert [r["prompt"] for r in val] == [f"{q} {SUFFIX}" for q, _, _ in PROBLEMS]


@pytest.mark.parametrize(
    ("template", "bos"), [(QWEN_TEMPLATE, False), (BOS_TEMPLATE, True)], ids=["qwen", "with bos"]
)
def test_truncation_and_the_overflow_policy_count_the_rendered_tokens(
    tmp_path: Path, template: str, bos: bool
) -> None:
    save_chat_model(tmp_path, template, bos=bos)
    tokenizer = load_tokenizer(str(tmp_path))
    longest = max(
        len(template_ids(tokenizer, [{"role": "user", "content": q}])) for q, _, _ in PROBLEMS
    )
    cfg = gsm8k_config(tmp_path, "data.chat_template=true", f"data.max_prompt_length={longest}")
    assert build_datasets(cfg, tokenizer)[0].num_truncated == 0
    short = f"data.max_prompt_length={longest - 1}"
    with pytest.raises(DataError, match=f"longer than data.max_prompt_length={longest - 1};"):
        build_datasets(gsm8k_config(tmp_path, "data.chat_template=true", short), tokenizer)
    cfg = gsm8k_config(tmp_path, "data.chat_template=true", short, "data.prompt_overflow=truncate")
    train, _ = build_datasets(cfg, tokenizer)
    assert train.num_truncated >= 1
    rows = drawn_step(cfg, tokenizer, train).prompts["input_ids"]
    assert rows.shape[1] == longest - 1


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (None, "data.chat_template=true, but the tokenizer of model.path="),
        ("{{ '  \n' }}", "row 1: the chat template of model.path="),
        (
            "{{ raise_exception('System role not supported') }}",
            "row 1: the chat template of model.path=",
        ),
        # No prompt's fault (it blamed row 1): the template's line and the error.
        (
            "{% for m in messages %}\n{{ m['content'] }",
            "the chat template of model.path={path!r} cannot be parsed (line 2: unexpected '}}'); "
            "fix it in the folder's tokenizer, or set data.chat_template=false",
        ),
    ],
    ids=["no template", "whitespace only", "template raises", "syntax error"],
)
def test_a_template_that_cannot_render_prompts_is_one_line(
    tmp_path: Path, template: str | None, message: str
) -> None:
    save_chat_model(tmp_path, template)
    cfg = gsm8k_config(tmp_path, "data.chat_template=true")
    with pytest.raises(DataError, match=re.escape(message.format(path=str(tmp_path)))) as exc:
        build_datasets(cfg, load_tokenizer(cfg.model.path))
    assert "\n" not in str(exc.value)


# Gemma's and Mistral's way: a system turn raises.
NO_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- raise_exception('System role not supported') }}{%- endif %}" + QWEN_TEMPLATE
)


def test_a_template_that_refuses_a_system_turn_names_the_system_prompt(tmp_path: Path) -> None:
    # The error blamed the first row's prompt ("row 1: ... fails on this prompt").
    save_chat_model(tmp_path, NO_SYSTEM_TEMPLATE)
    cfg = gsm8k_config(tmp_path, "data.chat_template=true", f"data.system_prompt={SYSTEM}")
    with pytest.raises(DataError) as exc:
        build_datasets(cfg, load_tokenizer(cfg.model.path))
    message = str(exc.value)
    assert message.startswith(f"the chat template of model.path={str(tmp_path)!r} fails on ")
    assert f"the system turn data.system_prompt={SYSTEM!r}; unset data.system_prompt" in message
    assert "System role not supported" in message and "row 1" not in message
    cfg = gsm8k_config(tmp_path, "data.chat_template=true")  # without one it renders
    assert build_datasets(cfg, load_tokenizer(cfg.model.path))[1][0]["prompt"].startswith(
        "<|im_start|>user\n"
    )


# Phi-3-mini's first template's way: only user and assistant turns are written.
DROPS_SYSTEM_TEMPLATE = QWEN_TEMPLATE.replace(
    "for message in messages", "for message in messages if message.role != 'system'"
)


def test_a_template_that_leaves_the_system_turn_out_names_the_system_prompt(
    tmp_path: Path,
) -> None:
    # The system prompt was lost without a word.
    save_chat_model(tmp_path, DROPS_SYSTEM_TEMPLATE)
    cfg = gsm8k_config(tmp_path, "data.chat_template=true", f"data.system_prompt={SYSTEM}")
    with pytest.raises(DataError) as exc:
        build_datasets(cfg, load_tokenizer(cfg.model.path))
    assert f"leaves the system turn data.system_prompt={SYSTEM!r} out: it renders " in str(
        exc.value
    )


@pytest.mark.parametrize(
    ("system", "where"),
    [("assistant", "the template's own text"), ("step by step", "the user's turn")],
)
def test_a_left_out_system_turn_is_found_when_its_text_is_elsewhere_too(
    tmp_path: Path, system: str, where: str
) -> None:
    # The system text was looked for anywhere in the rendering: a template that drops the
    # turn passed when its generation prompt ('<|im_start|>assistant') or the user's turn
    # (verl's 'Let's think step by step ...') held the same text.
    save_chat_model(tmp_path, DROPS_SYSTEM_TEMPLATE)
    path = write_verl_gsm8k_parquet(tmp_path / "verl.parquet", system=system)
    message = refusal(verl_config(path, tmp_path, "data.chat_template=true"))
    assert f"leaves the prompt's system turn {system!r} out" in message, where
    cfg = gsm8k_config(tmp_path, "data.chat_template=true", f"data.system_prompt={system}")
    assert f"leaves the system turn data.system_prompt={system!r} out" in refusal(cfg), where
    save_chat_model(tmp_path, QWEN_TEMPLATE)  # a template that writes it: both render
    _, val = build_datasets(cfg, load_tokenizer(cfg.model.path))
    assert val[0]["prompt"].startswith(f"<|im_start|>system\n{system}<|im_end|>")
    cfg = verl_config(path, tmp_path, "data.chat_template=true")
    _, val = build_datasets(cfg, load_tokenizer(cfg.model.path))
    assert val[0]["prompt"].startswith(f"<|im_start|>system\n{system}<|im_end|>")


def test_a_blank_system_turn_of_a_file_is_rendered_as_the_template_writes_it(
    tmp_path: Path,
) -> None:
    # Nothing is lost whether a template writes a blank turn or not: no refusal either way.
    for template, head in [
        (QWEN_TEMPLATE, "<|im_start|>system\n <|im_end|>"),
        (DROPS_SYSTEM_TEMPLATE, "<|im_start|>user"),
    ]:
        save_chat_model(tmp_path, template)
        path = write_verl_gsm8k_parquet(tmp_path / "verl.parquet", system=" ")
        cfg = verl_config(path, tmp_path, "data.chat_template=true")
        _, val = build_datasets(cfg, load_tokenizer(cfg.model.path))
        assert val[0]["prompt"].startswith(head)


# The main job's prompts as the code before data fields and chat templates drew them.
MAIN_JOB_TRAIN = "b4ddd1237c831434cabb9cfbed8ab96b80dfd02075e102bf050c911d539f0c36"
MAIN_JOB_VALIDATION = "d8567c4dfea9311255cf033ef8fec58e4348d45d4d13fa21406fb49228722966"
MAIN_JOB_FIRST_STEP = "28b8112af040aa127eb445a8de5f56ae7fca8108332ecdb9350088cd5f52a143"


def test_the_main_job_draws_the_prompts_it_always_drew() -> None:
    cfg = load_config("configs/ppo_tiny.yaml")
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    train, val = build_datasets(cfg, tokenizer)
    assert train.fingerprint == {"records": 1024, "sha256": MAIN_JOB_TRAIN}
    assert val.fingerprint == {"records": 64, "sha256": MAIN_JOB_VALIDATION}
    drawn = drawn_step(cfg, tokenizer, train)
    td = drawn.prompts
    assert td["input_ids"].dtype == torch.long
    tokens = td["input_ids"].numpy().tobytes() + td["attention_mask"].numpy().tobytes()
    assert hashlib.sha256(tokens).hexdigest() == MAIN_JOB_FIRST_STEP
    # BOS then the prompt's characters, as before: the same one path, with BOS.
    prompt = drawn.records[0]["prompt"]
    assert real_tokens(td)[0] == [
        tokenizer.bos_token_id,
        *tokenizer(prompt, add_special_tokens=False)["input_ids"],
    ]


@pytest.mark.parametrize("chat_template", [True, False])
def test_settings_are_refused_only_where_they_leave_no_room_for_a_prompt(
    tmp_path: Path, chat_template: bool
) -> None:
    """The template, system prompt and suffix around an empty prompt, measured as a batch
    measures a prompt (the BOS a plain prompt gets included): one token short of
    data.max_prompt_length runs, truncating; all of it is refused."""
    save_chat_model(tmp_path, BOS_TEMPLATE, bos=True)
    tokenizer = load_tokenizer(str(tmp_path))
    if chat_template:
        settings = ["data.chat_template=true", f"data.system_prompt={SYSTEM}"]
        system = [{"role": "system", "content": SYSTEM}]
        fixed = len(template_ids(tokenizer, [*system, {"role": "user", "content": f" {SUFFIX}"}]))
    else:
        settings = []
        fixed = 1 + len(tokenizer.encode(f" {SUFFIX}", add_special_tokens=False))
    settings += [f"data.prompt_suffix={SUFFIX}", "data.prompt_overflow=truncate"]
    cfg = gsm8k_config(tmp_path, *settings, f"data.max_prompt_length={fixed + 1}")
    assert build_datasets(cfg, tokenizer)[0].num_truncated == len(PROBLEMS)
    cfg = gsm8k_config(tmp_path, *settings, f"data.max_prompt_length={fixed}")
    with pytest.raises(
        DataError,
        match=re.escape(
            f"{fixed} tokens around an empty prompt, leaving none of "
            f"data.max_prompt_length={fixed} for a prompt's own"
        ),
    ):
        build_datasets(cfg, tokenizer)


def test_a_template_that_refuses_an_empty_prompt_is_not_measured_on_one(tmp_path: Path) -> None:
    """The room the settings leave is measured around an empty prompt; a template that
    refuses empty content renders every row of the file, and the run goes on."""
    refuses_empty = (
        "{%- if messages[-1].content == '' %}{{ raise_exception('empty content') }}{%- endif %}"
        + QWEN_TEMPLATE
    )
    save_chat_model(tmp_path, refuses_empty)
    cfg = gsm8k_config(tmp_path, "data.chat_template=true")
    train, _ = build_datasets(cfg, load_tokenizer(cfg.model.path))
    assert len(train) == len(PROBLEMS)


def verl_config(path: Path, folder: Path, *overrides: str) -> Config:
    """:func:`file_config` over a verl-format parquet, the answer inside reward_model."""
    return file_config(
        folder,
        path,
        "data.answer_key=reward_model.ground_truth",
        "data.max_prompt_length=256",
        *overrides,
    )


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["user turn", "with a system turn"])
def test_a_verl_conversation_is_rendered_as_its_messages(
    tmp_path: Path, system: str | None
) -> None:
    """verl's files store the prompt as a conversation: it is the template's messages as the
    file has them, data.prompt_suffix after the last turn's content, the answer read inside
    reward_model."""
    save_chat_model(tmp_path)
    path = write_verl_gsm8k_parquet(tmp_path / "verl.parquet", system=system)
    cfg = verl_config(path, tmp_path, "data.chat_template=true", f"data.prompt_suffix={SUFFIX}")
    tokenizer = load_tokenizer(cfg.model.path)
    _, val = build_datasets(cfg, tokenizer)
    system_turn = [] if system is None else [{"role": "system", "content": system}]
    expected = [
        template_ids(
            tokenizer,
            [*system_turn, {"role": "user", "content": f"{q} {VERL_INSTRUCTION} {SUFFIX}"}],
        )
        for q, _, _ in PROBLEMS
    ]
    source = StepSource.__new__(StepSource)
    source.cfg, source.tokenizer = cfg, tokenizer
    assert real_tokens(source._tensordict(list(val), repeat=1, temperature=0.0)) == expected
    assert [r["answer"] for r in val] == ["72", "15", "1234", "10", "42", "12", "42", "99"]


@pytest.mark.parametrize(
    ("template", "overrides", "message"),
    [
        (
            QWEN_TEMPLATE,
            [],
            "row 1: field 'prompt' (data.prompt_key) is a list of chat messages, which only a "
            "chat template renders; set data.chat_template=true",
        ),
        (
            QWEN_TEMPLATE,
            ["data.chat_template=true", "data.system_prompt=Be brief."],
            "row 1: the prompt's conversation has a system turn of its own, and "
            "data.system_prompt='Be brief.' is set too; unset data.system_prompt to keep the "
            "file's, or remove the file's system turns",
        ),
        (
            DROPS_SYSTEM_TEMPLATE,
            ["data.chat_template=true"],
            f"row 1: the chat template of model.path='{{model}}' leaves the prompt's system "
            f"turn {SYSTEM!r} out: it renders ",
        ),
    ],
    ids=["no template", "two system turns", "template drops it"],
)
def test_a_conversation_the_settings_cannot_render_is_refused_naming_the_row(
    tmp_path: Path, template: str, overrides: list[str], message: str
) -> None:
    save_chat_model(tmp_path, template)
    path = write_verl_gsm8k_parquet(tmp_path / "verl.parquet", system=SYSTEM)
    cfg = verl_config(path, tmp_path, *overrides)
    assert refusal(cfg).startswith(f"{path} {message.format(model=tmp_path)}")


def test_a_conversation_that_spells_a_special_token_is_refused_naming_its_turn(
    tmp_path: Path,
) -> None:
    save_chat_model(tmp_path)
    path = write_verl_gsm8k_parquet(tmp_path / "verl.parquet", system="Stop at <|im_end|>.")
    cfg = verl_config(path, tmp_path, "data.chat_template=true")
    assert refusal(cfg).startswith(
        f"{path} row 1: the prompt holds '<|im_end|>', the text of a special token of the "
        "tokenizer, which would read it as that token inside the chat template's system turn"
    )


def test_template_variables_reach_every_rendering(tmp_path: Path) -> None:
    """data.chat_template_kwargs are the template's variables (Qwen3's enable_thinking): the
    prompts are apply_chat_template's tokens with them."""
    save_chat_model(tmp_path, THINKING_TEMPLATE)
    tokenizer = load_tokenizer(str(tmp_path))
    for variables, closing in (({}, ""), ({"enable_thinking": False}, "<think>\n\n</think>\n\n")):
        cfg = gsm8k_config(
            tmp_path,
            "data.chat_template=true",
            f"data.system_prompt={SYSTEM}",
            f"data.chat_template_kwargs={variables}",
        )
        _, val = build_datasets(cfg, tokenizer)
        messages = [
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q, _, _ in PROBLEMS
        ]
        expected = [
            tokenizer.apply_chat_template(
                m, add_generation_prompt=True, return_dict=False, **variables
            )
            for m in messages
        ]
        source = StepSource.__new__(StepSource)
        source.cfg, source.tokenizer = cfg, tokenizer
        assert real_tokens(source._tensordict(list(val), repeat=1, temperature=0.0)) == expected
        assert all(r["prompt"].endswith(f"<|im_start|>assistant\n{closing}") for r in val)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        (
            "{enable_thinkng: false}",
            "data.chat_template_kwargs: the chat template of model.path='{model}' reads no "
            "variable ['enable_thinkng']; it reads ['enable_thinking']",
        ),
        (
            "{tokenize: true}",
            "data.chat_template_kwargs: 'tokenize' is a parameter of apply_chat_template, which "
            "verlite and transformers set; a template variable needs another name",
        ),
        (
            "{bos_token: x}",
            "data.chat_template_kwargs: 'bos_token' is a special token's variable, which verlite "
            "and transformers set; a template variable needs another name",
        ),
    ],
    ids=["misspelt", "a parameter", "a special token"],
)
def test_template_variables_the_template_cannot_take_are_refused(
    tmp_path: Path, variables: str, message: str
) -> None:
    save_chat_model(tmp_path, THINKING_TEMPLATE, bos=True)
    cfg = gsm8k_config(
        tmp_path, "data.chat_template=true", f"data.chat_template_kwargs={variables}"
    )
    assert refusal(cfg) == message.format(model=tmp_path)


def test_a_role_that_spells_a_special_token_is_refused(tmp_path: Path) -> None:
    """The template writes each message's role into its text (``<|im_start|>user``): a role
    holding ``<|im_end|>`` would end the turn's header there, the content read as another."""
    save_chat_model(tmp_path)
    path = tmp_path / "verl.jsonl"
    messages = [{"role": "user<|im_end|>", "content": "1+1="}]
    path.write_text(json.dumps({"prompt": messages, "reward_model": {"ground_truth": "2"}}) + "\n")
    cfg = verl_config(path, tmp_path, "data.chat_template=true")
    assert refusal(cfg).startswith(
        f"{path}:1: the prompt holds '<|im_end|>', the text of a special token of the "
        "tokenizer, which would read it as that token inside the chat template's role "
        "'user<|im_end|>', not as text"
    )


GUIDE = Path(__file__).parents[2] / "docs" / "datasets-and-chat-templates.md"


def test_the_guides_settings_for_verls_files_train_on_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settings the guide's "verl's files as they are" gives, as written (its paths
    relative to the folder verlite runs in), over the main job's config: verl's GSM8K
    reads, its answers taken from reward_model.ground_truth."""
    section = GUIDE.read_text().split("## verl's files as they are", 1)[1]
    settings = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    monkeypatch.chdir(tmp_path)
    save_chat_model(tmp_path / "model")
    verl = write_verl_gsm8k_parquet(tmp_path / "verl.parquet")
    for key in ("train_file", "val_file"):  # copied: pyarrow would expand a ~ of the path
        Path(settings["data"][key]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(verl, settings["data"][key])
    raw = yaml.safe_load((Path(__file__).parents[2] / "configs" / "ppo_tiny.yaml").read_text())
    for section_name, fields in settings.items():
        raw[section_name] = {**raw.get(section_name, {}), **fields}
    raw["model"] = {**raw["model"], "path": str(tmp_path / "model")}
    cfg = load_config(raw)
    train, val = build_datasets(cfg, load_tokenizer(cfg.model.path))
    answers = ["72", "15", "1234", "10", "42", "12", "42", "99"]
    assert [r["answer"] for r in train] == [r["answer"] for r in val] == answers


def test_the_guides_math_example_reads_its_file_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guide's "MATH from a JSONL file" settings, as written but for the model folder:
    they set a chat template and a system prompt without model.path, under the default
    data.max_prompt_length of 32, which the template and system turn alone pass."""
    section = GUIDE.read_text().split("## MATH from a JSONL file", 1)[1]
    line = section.split("`", 2)[1]  # the guide's example row
    settings = yaml.safe_load(section.split("```yaml\n", 1)[1].split("```", 1)[0])
    monkeypatch.chdir(tmp_path)
    save_chat_model(tmp_path / "model")
    row = json.loads(line)
    rows = [{"problem": f"{i}: {row['problem']}", "solution": row["solution"]} for i in range(4)]
    Path(settings["data"]["train_file"]).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert Path(settings["model"]["path"]).is_absolute()  # a folder the reader has
    settings["model"]["path"] = str(tmp_path / "model")
    raw = yaml.safe_load((Path(__file__).parents[2] / "configs" / "ppo_tiny.yaml").read_text())
    for section_name, fields in settings.items():
        raw[section_name] = {**raw.get(section_name, {}), **fields}
    cfg = load_config(raw, ["data.num_val_samples=2"])
    train, val = build_datasets(cfg, load_tokenizer(cfg.model.path))
    assert [r["answer"] for r in [*train, *val]] == ["\\frac{1}{2}"] * 4
    assert cfg.reward.fn == "math"


@pytest.mark.parametrize("template", [False, True], ids=["as text", "in the template"])
def test_a_prompt_that_already_ends_with_the_suffix_is_refused(
    tmp_path: Path, template: bool
) -> None:
    """A file whose prompts hold the instruction data.prompt_suffix appends: refused naming
    the row, with or without the template, rather than the instruction written twice."""
    save_chat_model(tmp_path)
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": f"2+2= {SUFFIX}\n", "answer": "4"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            f"model.path={tmp_path}",
            "data.task=null",
            f"data.train_file={path}",
            f"data.val_file={path}",
            f"data.chat_template={str(template).lower()}",
            f"data.prompt_suffix={SUFFIX}",
        ],
    )
    assert refusal(cfg) == (
        f"{path}:2: the prompt already ends with data.prompt_suffix={SUFFIX!r}, which would be "
        "written twice; set data.prompt_suffix=null for a file whose prompts hold it"
    )


def test_the_variables_of_a_template_written_as_qwen3s_are_read(tmp_path: Path) -> None:
    """A template as Qwen3's is written ({% generation %} blocks, a namespace, tojson and the
    functions transformers gives templates) is read in transformers' own environment: its
    functions were listed among the variables it reads, and a keyword of one's name
    (raise_exception) passed, replacing the function the template calls."""
    save_chat_model(tmp_path, QWEN3_TEMPLATE)
    tokenizer = load_tokenizer(str(tmp_path))
    thinking_off = "data.chat_template_kwargs={enable_thinking: false, show_date: false}"
    _, val = build_datasets(
        gsm8k_config(tmp_path, "data.chat_template=true", thinking_off), tokenizer
    )
    assert all(r["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for r in val)
    for variables, message in (
        (
            "{enable_thinkng: false}",
            f"data.chat_template_kwargs: the chat template of model.path='{tmp_path}' reads no "
            "variable ['enable_thinkng']; it reads ['enable_thinking', 'show_date']",
        ),
        (
            "{raise_exception: 1}",
            "data.chat_template_kwargs: 'raise_exception' is a function transformers gives "
            "templates, which verlite and transformers set; a template variable needs another name",
        ),
    ):
        cfg = gsm8k_config(
            tmp_path, "data.chat_template=true", f"data.chat_template_kwargs={variables}"
        )
        with pytest.raises(DataError) as exc:
            build_datasets(cfg, tokenizer)
        assert str(exc.value) == message


def test_the_variables_of_named_templates_are_checked_against_the_default(
    tmp_path: Path,
) -> None:
    """A tokenizer may carry named templates (tokenizer.chat_template a dict: "default",
    "tool_use"); verlite renders without tools, so with the default one, and its variables
    are checked against that one."""
    for name, default, other in (
        ("thinking", THINKING_TEMPLATE, QWEN_TEMPLATE),
        ("plain", QWEN_TEMPLATE, THINKING_TEMPLATE),
    ):
        folder = tmp_path / name
        tokenizer = save_chat_model(folder, default)
        tokenizer.chat_template = {"default": default, "tool_use": other}
        tokenizer.save_pretrained(folder)
        loaded = load_tokenizer(str(folder))
        assert isinstance(loaded.chat_template, dict)
        cfg = gsm8k_config(
            folder, "data.chat_template=true", "data.chat_template_kwargs={enable_thinking: false}"
        )
        if default == THINKING_TEMPLATE:
            _, val = build_datasets(cfg, loaded)
            assert all(r["prompt"].endswith("</think>\n\n") for r in val)
            continue
        with pytest.raises(DataError) as exc:
            build_datasets(cfg, loaded)
        assert str(exc.value) == (
            f"data.chat_template_kwargs: the chat template of model.path='{folder}' reads no "
            "variable ['enable_thinking']; it reads []"
        )
