"""LoRA (``verlite.models.lora``) on real Hugging Face models in one process: start-up checks
in one line, the reference is the base, and an adapters-only weight sync lands the adapters
bit for bit and refuses a rollout model of another base. (A whole LoRA run with FSDP, a split
rollout group, checkpoint and export: tests/e2e/test_e2e_lora.py; the invariance audit over
spawned ranks: tests/workers/test_train_engine_invariance.py.)"""

import dataclasses
import sys
import warnings

import pytest
import torch
from model_support import tiny_qwen2
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config

from verlite.config import ConfigError, LoraConfig, ModelConfig, load_config
from verlite.errors import MissingExtraError
from verlite.generation import (
    WeightSyncError,
    base_checksum,
    make_bucket,
    split_frozen,
    sync_layout,
)
from verlite.generation.weights import WeightReceiver
from verlite.models import build_policy
from verlite.models.lora import adapters_disabled, merge_adapter, save_adapter
from verlite.models.support import check_lora_supported

MODEL = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, dtype="float64")
LORA = LoraConfig(rank=4, target_modules=("q_proj", "v_proj", "down_proj"))


def policy(seed: int = 0, lora: LoraConfig | None = LORA) -> torch.nn.Module:
    return build_policy(MODEL, vocab_size=40, max_positions=32, seed=seed, lora=lora)


def trained(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its adapters moved away from their start (B = 0: the identity)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.randint(1, 40, (2, 7), generator=torch.Generator().manual_seed(0))


def test_start_up_errors_are_one_line_naming_the_field_or_the_extra(monkeypatch) -> None:
    bad = LoraConfig(rank=4, target_modules=("q_proj", "query_key_value"))
    with pytest.raises(ConfigError) as info:
        check_lora_supported(MODEL, bad)
    assert str(info.value).startswith("actor.lora.target_modules: query_key_value names no")
    assert "q_proj" in str(info.value) and "\n" not in str(info.value)
    check_lora_supported(MODEL, LoraConfig(rank=0, target_modules=("nothing",)))  # off

    monkeypatch.setitem(sys.modules, "peft", None)  # peft not installed: import fails
    with pytest.raises(
        MissingExtraError, match=r"pip install 'peft>=0\.21' \(verlite's 'lora' extra\)$"
    ):
        check_lora_supported(MODEL, LORA)


def test_lora_on_the_built_in_model_without_its_head_says_so_at_start_up(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/lora.md: on the built-in (random) model the default targets leave its random LM
    head frozen, which holds sampling near uniform; a run said nothing of it. One line names
    the field and the fix; none with lm_head among the targets, none for a model folder."""
    line = check_lora_supported(MODEL, LORA)
    assert line == (
        "actor.lora.target_modules=[q_proj, v_proj, down_proj] leaves out lm_head: the "
        "built-in model's LM head is random and stays frozen, which keeps sampling near "
        "uniform whatever the adapters learn (docs/lora.md, 'What the quick-start learns'); "
        "add lm_head to actor.lora.target_modules"
    )
    with_head = LoraConfig(rank=4, target_modules=("q_proj", "lm_head"))
    assert check_lora_supported(MODEL, with_head) is None
    policy(lora=None).save_pretrained(tmp_path)
    assert check_lora_supported(ModelConfig(path=str(tmp_path), dtype="float64"), LORA) is None
    # the run prints it before Ray starts
    from verlite.driver.preflight import RunInputs

    run = load_config(
        "configs/ppo_tiny.yaml", ["actor.lora.rank=4", f"trainer.output_dir={tmp_path / 'run'}"]
    )
    RunInputs.load(run).folder.release()
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if line.startswith("actor.lora.target_modules=")] == [
        "actor.lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
        "down_proj] leaves out lm_head: the built-in model's LM head is random and stays "
        "frozen, which keeps sampling near uniform whatever the adapters learn (docs/lora.md, "
        "'What the quick-start learns'); add lm_head to actor.lora.target_modules"
    ]


def test_only_the_adapters_train_and_the_reference_is_the_base() -> None:
    model = trained(policy())
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base = policy(lora=None)
    with adapters_disabled(model):
        torch.testing.assert_close(logits(model, IDS), logits(base, IDS), rtol=0, atol=0)
    assert (logits(model, IDS) - logits(base, IDS)).abs().max() > 1e-3


def publish(model: torch.nn.Module, version: int, *, with_base: bool = True) -> list:
    """The buckets an actor of a LoRA policy publishes: its adapters, and the checksum of
    its base on bucket 0 (``ActorWorker.publish_bucket``), one tensor a bucket."""
    adapters, frozen = split_frozen(model, model.state_dict())
    base = base_checksum(frozen.values())
    layout = sync_layout(adapters, bucket_bytes=1)
    staging = torch.empty(layout.staging_bytes, dtype=torch.uint8)
    buckets = []
    for index, specs in enumerate(layout.buckets):
        bucket = make_bucket(
            version,
            index,
            layout,
            [adapters[s.name] for s in specs],
            staging=staging.clone(),
            started=0.0,
            base_checksum=base if index == 0 and with_base else None,
        )
        buckets.append(bucket)
    return buckets


def test_an_adapters_only_sync_lands_the_adapters_and_checks_the_base() -> None:
    actor = trained(policy())
    rollout = policy()
    receiver = WeightReceiver(rollout, who="rollout rank 0", adapters_only=True)
    buckets = publish(actor, version=3)
    sent = {spec.name for bucket in buckets for spec in bucket.tensors}
    adapters = {n for n, p in actor.named_parameters() if ".lora_" in n}
    assert sent == adapters and len(adapters) == 2 * 2 * 3  # A and B, 2 layers, 3 targets
    for bucket in buckets:
        receiver.load(bucket)
    receiver.require(3)
    torch.testing.assert_close(logits(rollout, IDS), logits(actor, IDS), rtol=0, atol=0)

    # a sync that leaves an adapter unset does not complete
    with pytest.raises(WeightSyncError, match="did not send 1 of the model's tensors"):
        for bucket in buckets[:-1]:
            receiver.load(dataclasses.replace(bucket, count=len(buckets) - 1))
    # adapters for another base (a rollout model built from another seed) are refused
    other = WeightReceiver(policy(seed=5), who="rollout rank 1", adapters_only=True)
    with pytest.raises(WeightSyncError, match=r"rollout rank 1: .* for a base model of checksum"):
        other.load(buckets[0])
    with pytest.raises(WeightSyncError, match="refused"):
        other.load(buckets[1])
    # a bucket 0 without the base's checksum (full weights were meant) is refused too
    fresh = WeightReceiver(policy(), who="rollout rank 2", adapters_only=True)
    with pytest.raises(WeightSyncError, match="base model of checksum none"):
        fresh.load(publish(actor, version=4, with_base=False)[0])


def test_an_adapter_over_a_model_path_names_it_and_merges_to_the_same_logits(tmp_path) -> None:
    policy(lora=None).save_pretrained(tmp_path / "pretrained")
    cfg = MODEL.model_copy(update={"path": str(tmp_path / "pretrained")})
    model = trained(build_policy(cfg, vocab_size=40, max_positions=32, seed=0, lora=LORA))
    expected = logits(model, IDS)
    save_adapter(model, tmp_path / "adapter", base_path=cfg.path)
    assert not (tmp_path / "adapter" / "base").exists()  # the base is where model.path says
    with warnings.catch_warnings(record=True) as caught:  # verlite export --merge's only line
        warnings.simplefilter("always")
        merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    assert [str(w.message) for w in caught] == []
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged, IDS), expected)


def test_a_bf16_adapter_folder_loads_with_peft_to_the_trained_policys_logits(tmp_path) -> None:
    """A bf16 LoRA run over ``model.path``: its base loaded by Hugging Face in bf16 with the
    adapter folder on it (peft) computes the trained policy's logits bit for bit. The policy
    was cast with ``Module.to`` after its adapters were added, which rounded the rotary
    frequencies (``inv_freq``, not in any weights file) to bf16 while Hugging Face keeps them
    float32: the loaded adapter's logits were up to 0.002 from the trained policy's (peft
    loads the adapters in their stored dtype here, as they were trained)."""
    from peft import PeftModel

    policy(lora=None).to(torch.bfloat16).save_pretrained(tmp_path / "pretrained")
    cfg = MODEL.model_copy(update={"path": str(tmp_path / "pretrained"), "precision": "bf16"})
    model = trained(build_policy(cfg, vocab_size=40, max_positions=32, seed=0, lora=LORA))
    expected = logits(model, IDS)
    save_adapter(model, tmp_path / "adapter", base_path=cfg.path)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    loaded = PeftModel.from_pretrained(
        base, str(tmp_path / "adapter"), autocast_adapter_dtype=False
    )
    assert base.dtype == torch.bfloat16
    torch.testing.assert_close(logits(loaded, IDS), expected, rtol=0, atol=0)


def test_a_bf16_base_merges_in_the_adapters_precision_without_rounding_their_update(
    tmp_path,
) -> None:
    """A published checkpoint is stored in bf16; a bf16-mixed (or fp32) run trains fp32
    adapters over it. Merged in the base's bf16 (what Hugging Face loads it in), ``W + B A``
    rounded away 32% of what these adapters change in the logits; merged in the adapters'
    fp32 it is the adapted model to fp32 rounding (7e-5 of the change)."""
    policy(lora=None).to(torch.bfloat16).save_pretrained(tmp_path / "pretrained")
    cfg = MODEL.model_copy(update={"path": str(tmp_path / "pretrained"), "precision": "bf16-mixed"})
    model = build_policy(cfg, vocab_size=40, max_positions=32, seed=0, lora=LORA)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a small update, as a run's at a small learning rate
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(1e-4 * torch.randn(param.shape, generator=gen))
    expected = logits(model, IDS)
    with adapters_disabled(model):
        change = expected - logits(model, IDS)
    save_adapter(model, tmp_path / "adapter", base_path=cfg.path)
    merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == torch.float32
    assert float((logits(merged, IDS) - expected).norm() / change.norm()) < 1e-3


def test_an_adapter_on_a_tied_lm_head_merges_to_the_adapted_models_logits(tmp_path) -> None:
    """A base whose LM head is its input embedding (``tie_word_embeddings``, as Qwen2.5-0.5B):
    an adapter on ``lm_head`` changes the head's output only. Merged into the one shared
    weight, ``B A`` changed the embedding too (logits off by 3.5 times the adapters' whole change); the adapter file holds the adapters alone;
    the merge unties the head first, and the input embedding stays the base's."""
    tiny_qwen2(tied=True, vocab_size=40).save_pretrained(tmp_path / "pretrained")
    cfg = ModelConfig(path=str(tmp_path / "pretrained"), dtype="float64")
    lora = LoraConfig(rank=4, target_modules=("q_proj", "lm_head"))
    model = trained(build_policy(cfg, vocab_size=40, max_positions=32, seed=0, lora=lora))
    expected = logits(model, IDS)
    with adapters_disabled(model):
        change = expected - logits(model, IDS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_adapter(model, tmp_path / "adapter", base_path=cfg.path)
        merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    assert [str(w.message) for w in caught] == []
    # the adapters alone, not the embedding peft would add beside a tied head
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    # to the rounding of Hugging Face's fp32 rotary tables: 1e-7 of the change
    assert float((logits(merged, IDS) - expected).norm() / change.norm()) < 1e-5
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "pretrained")
    embedding = merged.get_input_embeddings().weight
    assert torch.equal(embedding, base.get_input_embeddings().weight)
    assert not torch.equal(merged.get_output_embeddings().weight, embedding)


def test_gpt2s_conv1d_projections_take_adapters_and_merge_to_the_same_logits(tmp_path) -> None:
    """GPT-2's projections (``c_attn``, ``c_proj``, ``c_fc``) are ``Conv1D`` layers, linear
    layers with their weight transposed, which peft adapts: they were refused at start-up
    ('c_attn names no linear layer of the model; its linear layers are: lm_head')."""
    config = GPT2Config(
        vocab_size=40,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=32,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.float64).save_pretrained(tmp_path / "gpt2")
    cfg = ModelConfig(path=str(tmp_path / "gpt2"), dtype="float64")
    lora = LoraConfig(rank=4, target_modules=("c_attn", "c_fc"))
    check_lora_supported(cfg, lora)
    model = trained(build_policy(cfg, vocab_size=40, max_positions=32, seed=0, lora=lora))
    expected = logits(model, IDS)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2")
    with adapters_disabled(model):
        torch.testing.assert_close(logits(model, IDS), logits(base, IDS), rtol=0, atol=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_adapter(model, tmp_path / "adapter", base_path=cfg.path)
        merge_adapter(tmp_path / "adapter", tmp_path / "merged")
    assert [str(w.message) for w in caught] == []
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(logits(merged, IDS), expected)
    with pytest.raises(
        ConfigError, match=r": q_proj names no linear .*: c_attn, c_fc, c_proj, lm_head$"
    ):
        check_lora_supported(cfg, LoraConfig(rank=4, target_modules=("c_attn", "q_proj")))
    with pytest.raises(ConfigError, match=r": q_proj, k_proj name no linear layer of the model"):
        check_lora_supported(cfg, LoraConfig(rank=4, target_modules=("q_proj", "k_proj")))


def test_on_a_random_base_only_an_lm_head_adapter_lifts_the_frozen_heads_bound() -> None:
    """docs/lora.md, "What the quick-start learns": with the default targets the built-in
    model's head and final norm stay at their init, so however far the adapters move every
    logit is within sqrt(hidden) times the head's largest row norm (the norm's output has
    norm sqrt(hidden)); an adapter on ``lm_head`` (as the quick-start adds) leaves it."""
    targets = LoraConfig(rank=4)
    model = policy(lora=targets)
    head = model.get_output_embeddings().weight
    bound = MODEL.hidden_size**0.5 * head.norm(dim=1).max()
    with torch.no_grad():
        for param in trained(model).parameters():
            if param.requires_grad:
                param.mul_(30.0)
    assert logits(model, IDS).abs().max() <= bound
    with_head = LoraConfig(rank=4, target_modules=(*targets.target_modules, "lm_head"))
    assert logits(trained(policy(lora=with_head)), IDS).abs().max() > 10 * bound
