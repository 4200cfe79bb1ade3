"""The actor worker in this process: its fused ``generate_with_log_probs`` call returns exactly what
``generate`` followed by ``compute_log_probs`` returns (the same rows, tokens, old and
reference log-probs), a rollout worker given its weights generates exactly its batch, and
the model it exports computes the trained policy's log-probs."""

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from chat_model_support import save_chat_model
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from verlite.config import Config, load_config
from verlite.data import build_datasets, load_tokenizer, prompt_tensordict
from verlite.data.dataset import PromptDataset
from verlite.generation import SamplingParams, WeightSyncError, sample_keys
from verlite.workers.actor import ActorWorker
from verlite.workers.peak_memory import PEAK_COLUMN, pop_peak
from verlite.workers.rollout import RolloutWorker


def _one_rank(role: str, cfg: Config, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The arguments of a policy worker that is its group's only rank."""
    return {
        "rank": 0,
        "world_size": 1,
        "torch_threads": 1,
        "role": role,
        "cfg": cfg,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _sampled_prompts(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, train_set: PromptDataset, samples: int = 2
) -> TensorDict:
    """The first 8 training prompts, ``samples`` each, with their sampling keys of step 1."""
    prompts = prompt_tensordict(
        train_set[:8],
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        repeat=samples,
        temperature=1.0,
    )
    prompts["sample_key"] = sample_keys(cfg.trainer.seed, 1, 8, samples)
    return prompts


def _actor(cfg: Config) -> tuple[ActorWorker, PreTrainedTokenizerBase, PromptDataset]:
    """A ready actor worker of ``cfg`` in this process, its tokenizer and training prompts."""
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    train_set, _ = build_datasets(cfg, tokenizer)
    worker = ActorWorker(**_one_rank("actor", cfg, tokenizer))
    worker.init_model()
    return worker, tokenizer, train_set


@pytest.mark.parametrize("kl_in_reward", ["false", "true"])
def test_generate_with_log_probs_equals_generate_then_log_probs(
    kl_in_reward: str, tmp_path: object
) -> None:
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            f"algorithm.use_kl_in_reward={kl_in_reward}",
            "actor.use_kl_loss=false",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    worker, tokenizer, train_set = _actor(cfg)
    prompts = _sampled_prompts(cfg, tokenizer, train_set)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)

    fused = worker.generate_with_log_probs(prompts, sampling, 7, True)
    separate = worker.generate(prompts, sampling, 7)
    separate.update(worker.compute_log_probs(separate, True))

    keys = sorted(separate.keys())  # iterating a TensorDict itself walks its rows
    assert sorted(fused.keys()) == keys
    assert ("ref_log_prob" in keys) == (kl_in_reward == "true")
    for key in keys:
        assert torch.equal(torch.as_tensor(fused[key]), torch.as_tensor(separate[key])), key
    assert bool(fused["response_mask"].any()) and bool((fused["old_log_probs"] < 0).any())


@pytest.mark.parametrize("tied", [False, True])
def test_a_rollout_worker_with_the_actors_weights_generates_the_actors_batch(
    tmp_path: Path, tied: bool
) -> None:
    """What ``rollout.placement=split`` relies on: the weights published by the actor's sync,
    bucket by bucket, loaded by a rollout worker, give bit for bit the batch the actor generates itself; the
    worker refuses to generate before the sync and with another version. A tied head (a
    ``model.path`` Qwen2's) travels once, as the embedding."""
    overrides = [
        "rollout.placement=split",
        "rollout.sync_bucket_mb=0.01",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    if tied:
        save_chat_model(tmp_path / "model")
        overrides.append(f"model.path={tmp_path / 'model'}")
    cfg = load_config("configs/ppo_tiny.yaml", overrides)
    actor, tokenizer, train_set = _actor(cfg)
    with torch.no_grad():  # weights no fresh model has
        for param in actor.engine.model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    rollout = RolloutWorker(**_one_rank("rollout", cfg, tokenizer))
    rollout.node_info = lambda: {"node_ip": "127.0.0.1"}  # no Ray in this process
    rollout.init_model()
    prompts = _sampled_prompts(cfg, tokenizer, train_set)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)
    with pytest.raises(WeightSyncError, match="holds none \\(no weights were synced yet\\)"):
        rollout.generate(prompts, sampling, 7, 0)

    layout = actor.weight_layout()
    assert len(layout.buckets) > 1
    sent = [spec.name for bucket in layout.buckets for spec in bucket]
    assert ("lm_head.weight" in sent) is not tied and "model.embed_tokens.weight" in sent
    for index in range(len(layout.buckets)):
        bucket = actor.publish_bucket(5, index)
        copied = [part.copy() for part in bucket.parts]  # as the object store's put copies
        seconds = rollout.generation_engine.load_bucket(dataclasses.replace(bucket, parts=copied))
        assert (seconds is None) == (index < len(layout.buckets) - 1)
    assert rollout.generation_engine.version == 5
    generated = rollout.generate(prompts, sampling, 7, 5)
    expected = actor.generate(prompts, sampling, 7)
    # The rollout rank's peak memory rides on its rows, for the driver to take out.
    assert pop_peak(generated) > 0 and PEAK_COLUMN not in set(generated.keys())
    keys = sorted(expected.keys())  # iterating a TensorDict itself walks its rows
    assert sorted(generated.keys()) == keys
    for key in keys:
        assert torch.equal(torch.as_tensor(generated[key]), torch.as_tensor(expected[key])), key
    with pytest.raises(WeightSyncError, match="version 6, but holds version 5"):
        rollout.generate(prompts, sampling, 7, 6)
    # nothing to compute when the sampler's log-probs serve and no reference is kept
    assert not actor.compute_log_probs(expected, False).keys()


def test_the_exported_model_computes_the_trained_policys_log_probs(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from verlite.models import set_logits_chunk_tokens
    from verlite.workers.forward import response_log_probs

    cfg = load_config("configs/ppo_tiny.yaml", [f"trainer.output_dir={tmp_path}"])
    worker, tokenizer, train_set = _actor(cfg)
    with torch.no_grad():  # weights away from the seed-0 initialization an export rebuilds
        for param in worker.engine.model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    prompts = _sampled_prompts(cfg, tokenizer, train_set, samples=1)
    batch = worker.generate(prompts, SamplingParams(max_new_tokens=6), 3)
    trained = worker.compute_log_probs(batch, True)["old_log_probs"]

    worker.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    set_logits_chunk_tokens(exported, cfg.model.logits_chunk_tokens)
    with torch.no_grad():
        reloaded, _ = response_log_probs(exported, batch, temperature=1.0, with_entropy=False)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(reloaded[mask], trained[mask], rtol=0, atol=1e-6)


def test_an_fsdp_actor_validating_a_split_run_decodes_static_not_with_graphs() -> None:
    """``rollout.decode=cuda_graphs`` with an FSDP actor passes start-up when a rollout group
    generates (split); the actor still generates the validation batches, in lockstep, and
    its all-gathers cannot be captured: it decodes statically, the rollout group with graphs."""
    from types import SimpleNamespace

    from verlite.models import build_policy
    from verlite.workers.policy_worker import PolicyWorker

    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            "rollout.decode=cuda_graphs",
            "model.device=cuda",
            "actor.strategy=fsdp",
            "rollout.placement=split",
            "trainer.workers_per_node=2",
            "actor.micro_batch_size_per_worker=8",
            "critic.micro_batch_size_per_worker=8",
        ],
    )
    assert cfg.trainer.val_freq > 0
    model = build_policy(cfg.model, vocab_size=40, max_positions=16, seed=0)
    worker = SimpleNamespace(cfg=cfg)
    cuda = torch.device("cuda")
    settings = PolicyWorker.decode_settings(worker, model, cuda, lockstep=True, trains_on=False)  # type: ignore[arg-type]
    assert settings.mode == "static"
    settings = PolicyWorker.decode_settings(worker, model, cuda, lockstep=False, trains_on=True)  # type: ignore[arg-type]
    assert settings.mode == "cuda_graphs"


@pytest.mark.parametrize("decode", ["cuda_graphs", "auto"])
def test_a_split_runs_actor_validates_without_graphs_or_a_generation_copy(decode: str) -> None:
    """With ``rollout.placement=split`` the rollout group generates the rows trained on; the
    actor generates the validation batches only, every ``trainer.val_freq`` steps. With
    CUDA graphs it held, all run long, their memory pool and, under bf16-mixed, a bf16 copy
    of the policy to capture them from (``generation_copy``: 15 GB for a 7B policy), for a
    few generations. It decodes statically from the trained model instead: autocast's bf16
    casts last as long as a validation's generation (the replayed graphs run the static
    step: ``tests/generation/test_static_decode.py``). The rollout group keeps its graphs."""
    from types import SimpleNamespace

    from verlite.models import build_policy
    from verlite.workers.actor import generation_copy
    from verlite.workers.policy_worker import PolicyWorker

    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            f"rollout.decode={decode}",
            "model.device=cuda",
            "model.precision=bf16-mixed",
            "actor.strategy=ddp",
            "rollout.placement=split",
        ],
    )
    assert cfg.trainer.val_freq > 0
    model = build_policy(cfg.model, vocab_size=40, max_positions=16, seed=0)
    worker = SimpleNamespace(cfg=cfg)
    cuda = torch.device("cuda")
    validating = PolicyWorker.decode_settings(worker, model, cuda, lockstep=False, trains_on=False)  # type: ignore[arg-type]
    assert validating.mode == "static"
    assert generation_copy(model, cfg.precision, validating) is None
    rollout = PolicyWorker.decode_settings(worker, model, cuda, lockstep=False, trains_on=True)  # type: ignore[arg-type]
    assert rollout.mode == "cuda_graphs"
    assert generation_copy(model, cfg.precision, rollout) is not None
