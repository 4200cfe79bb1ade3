"""A LoRA run end to end on the shared embedded Ray (``actor.lora``, docs/design.md "LoRA"):
an FSDP actor of 2 workers with a KL loss to the reference (the base: adapters off) and a
rollout worker group of its own whose syncs send the adapters alone; the checkpoint holds
the adapters and their optimizer state only; the export is a peft adapter folder that
``PeftModel.from_pretrained`` loads on its base, and ``verlite export --merge`` folds it
into weights that give the same logits."""

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from verlite.config import load_config
from verlite.distributed.sharded_state import _SafeReader
from verlite.driver.preflight import RunInputs
from verlite.driver.run import run
from verlite.models import build_policy
from verlite.package_versions import package_versions

OVERRIDES = (
    "model.precision=fp64",
    "trainer.cpus_per_worker=0.5",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=32",
    "actor.micro_batch_size_per_worker=8",
    "actor.strategy=fsdp",
    "trainer.workers_per_node=2",
    "trainer.val_freq=0",
    "trainer.loggers=[jsonl]",
    "trainer.total_steps=2",
    "trainer.save_freq=2",
    "actor.lora.rank=4",
    "actor.use_kl_loss=true",
    "actor.kl_loss_type=k1",
    "rollout.placement=split",
    "rollout.workers_per_node=1",
)


@pytest.fixture(scope="module")
def lora_run(shared_ray, tmp_path_factory: pytest.TempPathFactory):
    shared_ray.ensure()
    out = tmp_path_factory.mktemp("lora") / "run"
    cfg = load_config("configs/grpo_tiny.yaml", [*OVERRIDES, f"trainer.output_dir={out}"])
    run(cfg, RunInputs.load(cfg))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return cfg, out, records


def test_the_reference_is_the_base_and_syncs_send_only_the_adapters(lora_run) -> None:
    cfg, _, records = lora_run
    kl = [r["actor/kl_loss"] for r in records]
    # B starts at 0: the first step's policy is its reference; after an update it is not
    assert abs(kl[0]) < 1e-12 and abs(kl[1]) > 1e-6, kl
    model = build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0, lora=cfg.actor.lora)
    adapters = [p for name, p in model.named_parameters() if ".lora_" in name]
    adapter_bytes = sum(p.numel() * p.element_size() for p in adapters)
    assert all(r["perf/weight_sync_bytes"] == adapter_bytes for r in records)
    # the rollout worker generated with the actor's adapters: its log-probs are the actor's
    assert all(r["rollout/logprob_max_diff"] < 1e-6 for r in records)


def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state_only(lora_run) -> None:
    _, out, _ = lora_run
    reader = _SafeReader(str(out / "checkpoints/step_2/actor/train_state"))
    keys = reader.read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    assert all(".lora_" in k for k in keys if k.startswith("optim.state."))


def test_the_checkpoint_records_the_version_of_peft_too(lora_run) -> None:
    """The adapters' numbers are peft's. Mutation: write_checkpoint's versions without peft
    whatever actor.lora -> fails."""
    _, out, _ = lora_run
    state = json.loads((out / "checkpoints/step_2/trainer_state.json").read_text())
    assert state["versions"] == package_versions(peft=True)
    assert "peft" in state["versions"]


def test_the_export_loads_with_peft_and_merges_to_the_same_logits(lora_run, verlite_main) -> None:
    _, out, _ = lora_run
    policy = out / "hf_actor"
    base = AutoModelForCausalLM.from_pretrained(policy / "base", dtype=torch.float64)
    adapted = PeftModel.from_pretrained(base, policy)
    described = verlite_main("export", str(out))
    assert described.returncode == 0 and "LoRA adapter (peft, rank 4)" in described.stdout

    merged_run = verlite_main("export", str(out), "--merge")
    assert merged_run.returncode == 0, merged_run.stderr
    merged = AutoModelForCausalLM.from_pretrained(out / "hf_actor_merged", dtype=torch.float64)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    ids = torch.randint(1, base.config.vocab_size, (2, 9))
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected)
        with adapted.disable_adapter():  # the trained adapters change the policy
            assert (adapted(input_ids=ids).logits - expected).abs().max() > 1e-6
    again = verlite_main("export", str(out), "--merge")
    assert again.returncode == 2 and "is not an empty folder" in again.stderr


def test_a_base_whose_weights_changed_is_refused_by_the_merge_and_the_resume(
    tmp_path, local_ray, verlite_main, capsys
) -> None:
    """The run records model.path's weight files (``verlite.base_weights``): once they change,
    ``export --merge`` and a resume refuse in one line naming the file, before loading it."""
    from verlite.data import load_tokenizer

    tokenizer = load_tokenizer(None, task="copy")
    base = tmp_path / "base"
    policy = build_policy(
        load_config("configs/ppo_tiny.yaml").model,
        vocab_size=len(tokenizer),
        max_positions=64,
        seed=3,
    )
    policy.save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "run"
    overrides = [
        f"model.path={base}",
        f"trainer.output_dir={out}",
        "actor.lora.rank=4",
        "critic.warmup_steps=0",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
        "critic.ppo_mini_batch_size=8",
        "actor.micro_batch_size_per_worker=8",
        "critic.micro_batch_size_per_worker=8",
        "trainer.val_freq=0",
        "trainer.loggers=[jsonl]",
        "trainer.save_freq=1",
    ]
    cfg = load_config("configs/ppo_tiny.yaml", [*overrides, "trainer.total_steps=1"])
    run(cfg, RunInputs.load(cfg))
    same = verlite_main("export", out, "--merge", "--out", tmp_path / "merged")
    assert same.returncode == 0, same.stderr
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0)
    policy.save_pretrained(base)
    capsys.readouterr()  # Hugging Face's progress bar of that save
    merge = verlite_main("export", out, "--merge", "--out", tmp_path / "merged_again")
    assert merge.returncode == 2 and merge.stderr.count("\n") == 1, merge.stderr
    assert "no longer holds the weights it was trained over (model.safetensors changed)" in (
        merge.stderr
    )
    assert not (tmp_path / "merged_again").exists()
    config = "configs/ppo_tiny.yaml"
    resume = verlite_main("train", "--config", config, *overrides, "trainer.total_steps=2")
    assert resume.returncode == 2 and resume.stderr.count("\n") == 1, resume.stderr
    assert (
        f"model.path='{base}' no longer holds the base weights it was trained over "
        "(model.safetensors changed)" in resume.stderr
    )
