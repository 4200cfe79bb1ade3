"""A colocated FSDP actor generates from a whole copy of its policy on its own device
(``workers.actor.generation_copy``), gathered once per weight version (an update, a
checkpoint loaded), not through its sharded model in lockstep: on spawned gloo ranks, at
each version the copy holds the actor's gathered weights and samples the tokens and rollout
log-probs that today's path, the sharded model decoding in lockstep, samples, bit for bit."""

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from chat_model_support import save_chat_model
from gather_support import count_gathers
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

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


def _actor(rank: int, world: int, cfg: Config) -> ActorWorker:
    """This rank's colocated FSDP actor of ``cfg``, built."""
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
    return actor


def _prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase, rank: int, draw: int) -> TensorDict:
    """This rank's half of a draw's 8 prompts (a dynamic-sampling refill draws others)."""
    train_set, _ = build_datasets(cfg, tokenizer)
    first = 8 * draw + 4 * rank
    prompts = prompt_tensordict(
        train_set[first : first + 4],
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        repeat=2,
        temperature=1.0,
    )
    prompts["sample_key"] = sample_keys(cfg.trainer.seed, draw, 8, 2)[8 * rank : 8 * rank + 8]
    return prompts


def _in_lockstep(actor: ActorWorker, prompts: TensorDict, seed: int) -> TensorDict:
    """Today's path: ``prompts`` sampled through the sharded model, its ranks in lockstep."""
    sampling = SamplingParams(max_new_tokens=actor.cfg.rollout.max_response_length)
    lockstep = Sampler(
        inference_module(actor.engine.model),
        eos_token_id=actor.eos_token_id,
        pad_token_id=actor.pad_token_id,
        lockstep=True,
        decode=actor.decode_settings(
            actor.sampler.model, actor.engine.device, lockstep=True, trains_on=True
        ),
    )
    return actor.sample(
        lockstep.generate,
        prompts,
        sampling,
        seed,
        None,
        device=actor.engine.device,
        cache_casts=False,
    ).cpu()


def _distinct(model: torch.nn.Module) -> int:
    return len({id(value) for value in model.state_dict(keep_vars=True).values()})


def _train_then_generate(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """On each rank: a colocated FSDP actor of ``cfg`` generates three draws of a step (a
    dynamic-sampling step's first draw and two refills) at each of three weight versions,
    the initial policy's and those of two training steps, from its copy and, as today's
    path did, through its sharded model in lockstep; returns both, the gathers each
    version's draws ran, and the copy's state and the gathered policy after each step."""
    actor, gathers = _actor(rank, world, cfg), count_gathers()
    copy = actor._generation_copy
    assert copy is not None
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    out: dict[str, Any] = {"ours": [], "theirs": [], "gathers": [], "copy": [], "after": []}
    out["distinct"], out["entries"] = _distinct(copy), len(copy.state_dict())
    trained_on: TensorDict | None = None  # the last step's first draw
    for version in range(3):
        if trained_on is not None:
            advantages = torch.randn(trained_on["response_mask"].shape)
            trained_on["advantages"] = advantages * trained_on["response_mask"]
            actor.engine.train_mini_batch(trained_on, actor.loss_fn)
        counted = gathers[0]
        for draw in range(3):
            prompts = _prompts(cfg, tokenizer, rank, 3 * version + draw)
            seed = 10 * version + draw
            ours = actor.generate(prompts, sampling, seed, in_step=True)
            if draw == 0:
                trained_on = ours.clone()
                trained_on.update(actor.compute_log_probs(ours, True))
            out["ours"].append(ours)
            out["theirs"].append(_in_lockstep(actor, prompts, seed))
        out["gathers"].append(gathers[0] - counted)
        out["copy"].append({name: value.clone() for name, value in copy.state_dict().items()})
        out["after"].append(full_state_dict(actor.engine.model))
    return out


@pytest.mark.parametrize(
    ("overrides", "tied"),
    [
        (("rollout.decode=eager",), False),
        (("rollout.decode=static", "actor.offload=all"), False),
        (("rollout.decode=static", "actor.lora.rank=4"), False),
        (("rollout.decode=eager",), True),
        (("rollout.decode=eager", "model.precision=bf16-mixed"), True),
    ],
)
def test_a_colocated_fsdp_actor_generates_from_its_gathered_copy_what_its_shards_would(
    overrides: tuple[str, ...], tied: bool, tmp_path: Path
) -> None:
    """The copy samples what the shards would at every weight version, refreshed once a
    version: its first draw after a step gathers each distinct tensor of the policy once (a
    ``model.path`` Qwen2's head tied to the embedding once, not under both names: in fp32
    the copy keeps it tied; in bf16-mixed the copy holds its own bf16 head, filled from the
    embedding's one gather), a step's refills (``algorithm.dynamic_sampling``) and the
    initial policy's draws (the copy is made from it) gather nothing. Mutation: the tied
    head read under its own name (``name`` for ``sources[name]``): the bf16-mixed case gathers
    once more a version."""
    if tied:
        save_chat_model(tmp_path / "model")
        overrides = (*overrides, f"model.path={tmp_path / 'model'}")
    cfg = _config(tmp_path, *overrides)
    assert cfg.precision in ("fp32", "bf16-mixed") and not cfg.actor_lockstep
    ranks = run_on_ranks(_train_then_generate, world_size=2, args=(cfg,), timeout_s=300)
    for out in ranks:
        for ours, theirs in zip(out["ours"], out["theirs"], strict=True):
            assert sorted(ours.keys()) == sorted(theirs.keys())
            assert bool(ours["response_mask"].any())
            for key in sorted(theirs.keys()):
                assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(theirs[key])), key
        sources = out["entries"] - tied  # the policy's distinct tensors
        assert out["gathers"] == [0, sources, sources]
        assert (out["distinct"] < out["entries"]) is (tied and cfg.precision == "fp32")
        # Each step moved the policy, and the copy the rank generated from holds it, whole
        # (before the first step: the initial policy, which it was copied from).
        for before, after in itertools.pairwise(out["after"]):
            assert any(not torch.equal(before[n], v) for n, v in after.items())
        for copy, after in zip(out["copy"], out["after"], strict=True):
            assert copy.keys() == after.keys()
            for name, value in copy.items():  # in the copy's dtype (bf16-mixed: bf16 linears)
                assert torch.equal(value, after[name].to(value.dtype)), name


def _trained_then_resumed(rank: int, world: int, cfg: Config, folder: Path) -> dict[str, Any]:
    """On each rank: a colocated FSDP actor of ``cfg`` trains a step, saves a checkpoint in
    ``folder`` and generates; a fresh actor then loads it and generates the same prompts.
    Returns both generations, the resumed copy's state, the resumed policy gathered and the
    gathers of the resumed actor's generation."""
    trained = _actor(rank, world, cfg)
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)
    batch = trained.generate_with_log_probs(_prompts(cfg, tokenizer, rank, 0), sampling, 7, True)
    batch["advantages"] = torch.randn(batch["response_mask"].shape) * batch["response_mask"]
    trained.engine.train_mini_batch(batch, trained.loss_fn)
    trained.save_checkpoint(str(folder))
    prompts = _prompts(cfg, tokenizer, rank, 1)
    theirs = trained.generate(prompts, sampling, 8)
    resumed = _actor(rank, world, cfg)
    resumed.load_checkpoint(str(folder))
    gathers = count_gathers()
    ours = resumed.generate(prompts, sampling, 8)
    copy = resumed._generation_copy
    assert copy is not None
    return {
        "ours": ours,
        "theirs": theirs,
        "gathers": gathers[0],
        "distinct": _distinct(copy),
        "copy": {name: value.clone() for name, value in copy.state_dict().items()},
        "resumed": full_state_dict(resumed.engine.model),
        "trained": full_state_dict(trained.engine.model),
    }


def test_a_resumed_fsdp_actor_generates_from_the_weights_it_loaded(tmp_path: Path) -> None:
    """A checkpoint loaded moves the weights on without an update: the resumed actor's copy
    (made from the initial policy) is refreshed before it generates, and it samples what the
    actor that saved the checkpoint does, bit for bit."""
    cfg = _config(tmp_path, "rollout.decode=eager")
    args = (cfg, tmp_path / "checkpoint")
    ranks = run_on_ranks(_trained_then_resumed, world_size=2, args=args, timeout_s=300)
    for out in ranks:
        ours, theirs = out["ours"], out["theirs"]
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for key in sorted(theirs.keys()):
            assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(theirs[key])), key
        assert out["gathers"] == out["distinct"]
        assert out["copy"].keys() == out["resumed"].keys() == out["trained"].keys()
        for name, value in out["copy"].items():
            assert torch.equal(value, out["resumed"][name]), name
            assert torch.equal(value, out["trained"][name]), name


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
