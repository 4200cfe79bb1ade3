"""The GSM8K recipes (configs/recipes, docs/recipes.md) load and validate as written once the
user's two paths are given, their prompts fit as rendered by the model's chat template, and
without the paths they are refused in one line naming what to set. Their run is
tests/e2e/test_e2e_recipes.py."""

from pathlib import Path

import pytest
import torch
from chat_model_support import save_chat_model, write_gsm8k_parquet, write_verl_gsm8k_parquet

from verlite.config import ConfigError, load_config
from verlite.data import DataError
from verlite.data.dataset import build_datasets
from verlite.data.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))


def test_both_recipes_are_shipped() -> None:
    assert [p.name for p in RECIPES] == ["gsm8k_grpo.yaml", "gsm8k_ppo.yaml"]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_recipe_loads_as_written_with_the_two_paths(
    recipe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_chat_model(tmp_path / "model")
    data = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    paths = [f"model.path={tmp_path / 'model'}", f"data.train_file={data}", f"data.val_file={data}"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(recipe, paths)
    assert (cfg.data.prompt_key, cfg.data.answer_key) == ("question", "answer")
    assert cfg.data.answer_rule == "gsm8k" and cfg.data.chat_template
    assert cfg.reward.fn == "math" and "####" in (cfg.data.prompt_suffix or "")
    assert cfg.sequences_per_step % cfg.actor.ppo_mini_batch_size == 0
    assert cfg.use_critic == (recipe.stem == "gsm8k_ppo")
    # As written: CPU workers in fp32 on a machine without a GPU; a GPU each, in bf16-mixed,
    # on a machine with one (trainer.gpus_per_worker: auto).
    assert cfg.trainer.gpus_per_worker == 0 and not cfg.on_gpu and cfg.precision == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu = load_config(recipe, paths)
    assert on_gpu.trainer.gpus_per_worker == 1 and on_gpu.precision == "bf16-mixed"
    # The prompts, rendered by the model's template with the suffix, fit as written.
    train, val = build_datasets(cfg, load_tokenizer(cfg.model.path, task=None))
    assert len(train) == len(val) == 8
    assert train[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert train[0]["answer"] == "72"  # after the ####


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_without_the_paths_a_recipe_says_what_to_set(recipe: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data.task or data.train_file: set exactly one"):
        load_config(recipe)
    data = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    with pytest.raises(ConfigError, match=r"^data.chat_template=true .* model.path is unset"):
        load_config(recipe, [f"data.train_file={data}"])


# docs/recipes.md: the recipe's data settings for files verl's preprocessing wrote.
VERL_OVERRIDES = (
    "data.prompt_key=prompt data.answer_key=reward_model.ground_truth data.answer_rule=as_is "
    "data.prompt_suffix=null"
)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_a_verl_format_file_gives_a_recipe_the_prompts_of_gsm8ks_own(
    recipe: Path, tmp_path: Path
) -> None:
    """verl's GSM8K (the question and verl's instruction as a user turn, the answer in
    reward_model.ground_truth) with the overrides docs/recipes.md gives: the records the
    recipe draws from GSM8K's own parquet, rendered prompts and answers alike."""
    assert VERL_OVERRIDES in " ".join((ROOT / "docs" / "recipes.md").read_text().split())
    save_chat_model(tmp_path / "model")
    tokenizer = load_tokenizer(str(tmp_path / "model"), task=None)
    datasets = []
    for data, overrides in (
        (write_gsm8k_parquet(tmp_path / "gsm8k.parquet"), []),
        (write_verl_gsm8k_parquet(tmp_path / "verl.parquet"), VERL_OVERRIDES.split()),
    ):
        paths = [
            f"model.path={tmp_path / 'model'}",
            f"data.train_file={data}",
            f"data.val_file={data}",
        ]
        datasets.append(build_datasets(load_config(recipe, [*paths, *overrides]), tokenizer))
    (train, val), (verl_train, verl_val) = datasets
    assert verl_train.records == train.records and verl_val.records == val.records


def test_a_verl_format_file_with_the_recipes_suffix_left_set_is_refused(tmp_path: Path) -> None:
    """verl's prompts already end with the instruction the recipe appends: without
    data.prompt_suffix=null each would hold it twice, which is refused naming the row."""
    save_chat_model(tmp_path / "model")
    data = write_verl_gsm8k_parquet(tmp_path / "verl.parquet")
    overrides = [o for o in VERL_OVERRIDES.split() if o != "data.prompt_suffix=null"]
    paths = [f"model.path={tmp_path / 'model'}", f"data.train_file={data}", f"data.val_file={data}"]
    cfg = load_config(ROOT / "configs" / "recipes" / "gsm8k_ppo.yaml", [*paths, *overrides])
    with pytest.raises(DataError) as exc:
        build_datasets(cfg, load_tokenizer(str(tmp_path / "model"), task=None))
    assert str(exc.value) == (
        f"{data} row 1: the prompt already ends with data.prompt_suffix='Let\\'s think step by "
        'step [...]final answer after "####".\', which would be written twice; set '
        "data.prompt_suffix=null for a file whose prompts hold it"
    )
