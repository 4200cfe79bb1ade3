"""A colocated FSDP actor generates from a whole copy of its policy on its own device
(``workers.actor.generation_copy``), gathered once per generation, not through its sharded
model in lockstep: on spawned gloo ranks, after a training step, the copy holds the
actor's gathered weights and samples the tokens and rollout log-probs that today's path,
the sharded model decoding in lockstep, samples, bit for bit."""

from pathlib import Path
from typing import Any

import pytest
import torch

from verlite.config import Config, load_config
from verlite.data import build_datasets, load_tokenizer, prompt_tensordict
from verlite.distributed import full_state_dict, inference_module, run_on_ranks, sharded
from verlite.generation import Sampler, SamplingParams, sample_keys
from verlite.workers.actor import ActorWorker


def _config(tmp_path: Path, *overrides: str) -> Config:
    return load_config(
        "configs/ppo_tiny.yaml",
        [
            "actor.strategy=fsdp",
            "trainer.workers_per_node=2",
            "actor.micro_batch_size_per_worker=8",
            "critic.micro_batch_size_per_worker=8",
            f"trainer.output_dir={tmp_path}",
            *overrides,
        ],
    )


def _train_then_generate(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """On each rank: a colocated FSDP actor of ``cfg`` trains a step on its own rollout, then
    generates its half of 8 prompts from its copy and, as today's path did, through its
    sharded model in lockstep; returns both, the copy's state and the gathered policy."""
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    ids = {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    actor = ActorWorker(rank=rank, world_size=world, torch_threads=1, role="actor", cfg=cfg, **ids)
    actor.init_model()
    copy = actor._generation_copy
    assert copy is not None and not sharded(copy) and sharded(actor.engine.model)
    assert actor.sampler.model is copy and not actor.sampler.lockstep
    train_set, _ = build_datasets(cfg, tokenizer)
    prompts = prompt_tensordict(
        train_set[4 * rank : 4 * rank + 4],
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        repeat=2,
        temperature=1.0,
    )
    prompts["sample_key"] = sample_keys(cfg.trainer.seed, 1, 8, 2)[8 * rank : 8 * rank + 8]
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)
    before = full_state_dict(actor.engine.model)
    batch = actor.generate_with_log_probs(prompts, sampling, 7, True)
    batch["advantages"] = torch.randn(batch["response_mask"].shape) * batch["response_mask"]
    actor.engine.train_mini_batch(batch, actor.loss_fn)
    ours = actor.generate(prompts, sampling, 8)
    lockstep = Sampler(
        inference_module(actor.engine.model),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        lockstep=True,
        decode=actor.decode_settings(copy, actor.engine.device, lockstep=True, trains_on=True),
    )
    theirs = actor.sample(
        lockstep.generate, prompts, sampling, 8, None, device=actor.engine.device, cache_casts=False
    ).cpu()
    return {
        "ours": ours,
        "theirs": theirs,
        "copy": {name: value.clone() for name, value in copy.state_dict().items()},
        "before": before,
        "after": full_state_dict(actor.engine.model),
    }


@pytest.mark.parametrize(
    "overrides",
    [
        ("rollout.decode=eager",),
        ("rollout.decode=static", "actor.offload=all"),
        ("rollout.decode=static", "actor.lora.rank=4"),
    ],
)
def test_a_colocated_fsdp_actor_generates_from_its_gathered_copy_what_its_shards_would(
    overrides: tuple[str, ...], tmp_path: Path
) -> None:
    cfg = _config(tmp_path, *overrides)
    assert cfg.precision == "fp32" and not cfg.actor_lockstep
    ranks = run_on_ranks(_train_then_generate, world_size=2, args=(cfg,), timeout_s=300)
    for out in ranks:
        ours, theirs = out["ours"], out["theirs"]
        assert sorted(ours.keys()) == sorted(theirs.keys())
        assert bool(ours["response_mask"].any())
        for key in sorted(theirs.keys()):
            assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(theirs[key])), key
        # The step moved the policy, and the copy the rank generated from holds it, whole.
        assert any(not torch.equal(out["before"][n], v) for n, v in out["after"].items())
        assert out["copy"].keys() == out["after"].keys()
        for name, value in out["copy"].items():
            assert torch.equal(value, out["after"][name]), name


def test_a_colocated_fsdp_actor_captures_graphs_and_takes_turns_a_split_runs_validates_in_lockstep(
    tmp_path: Path,
) -> None:
    """Through its shards, in lockstep, a colocated FSDP actor could not decode with CUDA
    graphs (FSDP's all-gathers cannot be captured; ``auto`` picked static, ``cuda_graphs``
    was refused at start-up) nor take turns with an environment (its ranks would take
    different numbers of turns in lockstep collectives; refused). From its copy it does both,
    as a DDP actor does. A split run's FSDP actor still validates through its shards in
    lockstep, without a copy: multi-turn validation stays refused there."""
    from types import SimpleNamespace

    from verlite.models import build_policy
    from verlite.workers.policy_worker import PolicyWorker

    graphs = _config(tmp_path, "model.device=cuda", "rollout.decode=cuda_graphs")
    assert graphs.generation_copied("cuda_graphs") and not graphs.actor_lockstep
    auto = _config(tmp_path, "model.device=cuda")
    model = build_policy(auto.model, vocab_size=40, max_positions=16, seed=0)
    worker = SimpleNamespace(cfg=auto)
    decode = PolicyWorker.decode_settings(  # type: ignore[arg-type]
        worker, model, torch.device("cuda"), lockstep=auto.actor_lockstep, trains_on=True
    )
    assert decode.mode == "cuda_graphs"
    turns = ["rollout.multi_turn.env=lookup", "rollout.multi_turn.max_total_length=24"]
    assert not _config(tmp_path, *turns).actor_lockstep
    split = _config(tmp_path, "rollout.placement=split", "trainer.val_freq=0", *turns)
    assert split.actor_lockstep and not split.generation_copied("static")
    with pytest.raises(ValueError, match="FSDP actor that validates a split run"):
        _config(tmp_path, "rollout.placement=split", *turns)


def test_a_one_rank_fsdp_actor_that_fsdp_leaves_whole_generates_from_its_model(
    tmp_path: Path,
) -> None:
    """FSDP2 leaves one rank's model whole unless it offloads (``distributed.apply_fsdp``):
    such an actor generates from its trained model, as a DDP one does, with no second copy
    of its policy (on a GPU in fp32: 4 bytes a parameter, counted by the fit check too);
    offloaded, its model is sharded over a group of one and it generates from a copy."""
    whole = _config(tmp_path, "trainer.workers_per_node=1", "rollout.decode=eager")
    assert not whole.generation_copied("eager") and not whole.generation_copied("static")
    offloaded = _config(tmp_path, "trainer.workers_per_node=1", "actor.offload=all")
    assert offloaded.generation_copied("eager")
    assert _config(tmp_path).generation_copied("eager")  # 2 ranks: sharded
    tokenizer = load_tokenizer(whole.model.path, task=whole.data.task)
    actor = ActorWorker(
        rank=0,
        world_size=1,
        torch_threads=1,
        role="actor",
        cfg=whole,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    actor.init_model()
    assert not sharded(actor.engine.model) and actor._generation_copy is None
    assert actor.sampler.model is inference_module(actor.engine.model)
