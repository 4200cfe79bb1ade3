"""The GSM8K recipes (configs/recipes, docs/recipes.md) through ``verlite train``, each with
the user's two paths pointing at a tiny local instruct model and a GSM8K parquet, and sizes
that run two steps on CPU in seconds (on a GPU where there is one): the recipe's code path
(the file's own fields, its chat template, the math verifier, PPO's critic or GRPO's groups). Then its export (issue 37 item 5):
the folder loads with the Auto classes, its tokenizer renders the prompts the run trained on,
and ``generate`` runs on them and ends where the rollouts did; a LoRA policy's ``--merge``
output carries the same tokenizer and generation config."""

from pathlib import Path

import torch
from chat_model_support import PROBLEMS, save_chat_model, write_gsm8k_parquet
from transformers import AutoModelForCausalLM, AutoTokenizer

from verlite.config import load_config
from verlite.data.dataset import build_datasets
from verlite.data.tokenizer import encode_prompts, load_tokenizer

RECIPES = Path("configs/recipes")
# The recipe's code path at a size that runs in seconds here (its own sizes are a GPU's).
# As written otherwise: trainer.gpus_per_worker auto makes them CPU workers on a machine
# without a GPU (CI's; on one with a GPU, these runs are on cuda in bf16-mixed).
TINY = (
    "data.max_prompt_length=128",
    "data.train_batch_size=4",
    "rollout.max_response_length=16",
    "actor.micro_batch_size_per_worker=4",
    "trainer.total_steps=2",
    "trainer.val_freq=2",
    "trainer.save_freq=0",
)
SIZES = {
    "ppo": (
        "actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "critic.micro_batch_size_per_worker=4",
    ),
    "grpo": ("actor.ppo_mini_batch_size=20",),  # 4 prompts x rollout.n=5
}


def _train(verlite_main, tmp_path: Path, recipe: str, *extra: str) -> tuple[Path, list[str]]:
    """``verlite train`` of the recipe with the user's two paths; its output folder and the
    overrides it ran with."""
    model = tmp_path / "model"
    save_chat_model(model)
    data = write_gsm8k_parquet(tmp_path / "gsm8k.parquet")
    out = tmp_path / "run"
    overrides = [
        f"model.path={model}",
        f"data.train_file={data}",
        f"data.val_file={data}",
        *TINY,
        *SIZES[recipe],
        f"trainer.output_dir={out}",
        *extra,
    ]
    result = verlite_main("train", "--config", RECIPES / f"gsm8k_{recipe}.yaml", *overrides)
    assert result.returncode == 0, result.stderr
    return out, overrides


def _check_metrics(out: Path, metrics) -> None:
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 <= r["critic/score/mean"] <= 1 for r in records)
    assert "actor/pg_loss" in records[-1]
    # The math verifier's count of abandoned verifications, for training and validation.
    assert [r["reward/math/abandoned"] for r in records] == [0, 0]
    assert records[-1]["val/reward/math/abandoned"] == 0


def _check_folder(folder: Path, recipe: str, overrides: list[str]) -> None:
    """``folder`` loads with the Auto classes; its tokenizer's chat template gives the ids of
    the prompt the run trained on, as the run's tokenizer does; generate runs on them and
    ends at the run's end of sequence."""
    cfg = load_config(RECIPES / f"gsm8k_{recipe}.yaml", overrides)
    run_tokenizer = load_tokenizer(cfg.model.path, task=None)
    train_set, _ = build_datasets(cfg, run_tokenizer)
    question = PROBLEMS[0][0]  # the file's first row
    assert question in train_set[0]["prompt"]  # rendered: the template around it
    trained = encode_prompts(run_tokenizer, [train_set[0]["prompt"]], bos=False)[0]
    messages = [{"role": "user", "content": f"{question} {cfg.data.prompt_suffix}"}]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == trained
    assert ids == run_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id  # <|im_end|>
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    generated = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > len(ids) and generated[0, : len(ids)].tolist() == ids


def test_the_ppo_recipe_trains_and_exports_a_model_that_generates_with_its_template(
    tmp_path: Path, local_ray, verlite_main, metrics
) -> None:
    out, overrides = _train(verlite_main, tmp_path, "ppo")
    _check_metrics(out, metrics)
    _check_folder(out / "hf_actor", "ppo", overrides)
    described = verlite_main("export", out)
    assert described.returncode == 0, described.stderr
    assert described.stdout.splitlines() == [
        f"{out / 'hf_actor'}: full weights (Hugging Face format)",
        f"{out / 'hf_actor'}: its tokenizer has a chat template; generate from "
        "tokenizer.apply_chat_template(messages, add_generation_prompt=True), the prompts a run "
        "with data.chat_template=true trained on",
    ]


def test_the_grpo_recipe_with_lora_merges_to_a_model_that_generates_with_its_template(
    tmp_path: Path, local_ray, verlite_main, metrics
) -> None:
    out, overrides = _train(verlite_main, tmp_path, "grpo", "actor.lora.rank=4")
    _check_metrics(out, metrics)
    merged = verlite_main("export", out, "--merge")
    assert merged.returncode == 0, merged.stderr
    assert merged.stdout.splitlines()[-1].startswith(
        f"{out / 'hf_actor_merged'}: its tokenizer has a chat template"
    )
    _check_folder(out / "hf_actor_merged", "grpo", overrides)
