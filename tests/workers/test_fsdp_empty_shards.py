"""An FSDP actor whose tied LM head has ranks with no shard of it: FSDP2 shards dim 0 over the
ranks, and a vocabulary of 3 over 4 ranks leaves rank 3 an empty shard of the embedding (and
so of the head, the same tensor). Every rank must still take the head for the embedding
under a second name (``distributed.first_names``), since what it takes for one tensor
decides which tensors it gathers, a collective: on spawned gloo ranks, a weight sync, a
checkpoint resumed and the generation copy refreshed from it, and the export each gather
every distinct tensor once on every rank, and what they hold is the single-process
reference's, bit for bit."""

import dataclasses
from pathlib import Path
from typing import Any

import torch
from gather_support import count_gathers
from tensordict import TensorDict
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tests.model_support import tiny_qwen2
from verlite.config import Config, load_config
from verlite.distributed import distinct_entries, run_on_ranks
from verlite.generation import SamplingParams, WeightBucket, sample_keys
from verlite.generation.weights import WeightReceiver
from verlite.models import build_policy
from verlite.workers.actor import ActorWorker

VOCAB, WORLD = 3, 4  # rank 3 holds no row of the embedding
EOS, PAD = 2, 0


def _policy(cfg: Config, seed: int) -> torch.nn.Module:
    """The policy as an actor of ``cfg`` builds it, in one process."""
    return build_policy(
        cfg.model, vocab_size=VOCAB, max_positions=cfg.max_sequence_length, seed=seed
    )


def _moved(model: torch.nn.Module) -> None:
    """Every weight moved off its initial value, elementwise: a shard moves as the whole
    tensor's rows it holds do."""
    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            local.add_(1.0)


def _actor(rank: int, world: int, cfg: Config) -> ActorWorker:
    actor = ActorWorker(
        rank=rank,
        world_size=world,
        torch_threads=1,
        role="actor",
        cfg=cfg,
        vocab_size=VOCAB,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    actor.init_model()
    return actor


def _sync_resume_export(rank: int, world: int, cfg: Config, folder: Path) -> dict[str, Any]:
    """On each rank: an actor whose weights moved publishes the sync of version 1, saves a
    checkpoint and exports the policy; a fresh actor resumes the checkpoint and generates,
    refreshing its generation copy. Returns the gathers of the sync and of the refresh, the
    copy's state, and on rank 0 the sync's buckets."""
    trained = _actor(rank, world, cfg)
    _moved(trained.engine.model)
    gathers = count_gathers()
    buckets = []
    for index in range(len(trained.weight_layout().buckets)):
        bucket = trained.publish_bucket(1, index)
        if bucket is not None:
            buckets.append(dataclasses.replace(bucket, parts=[p.copy() for p in bucket.parts]))
    synced = gathers[0]
    trained.save_checkpoint(str(folder / "checkpoint"))
    trained.export_hf(str(folder / "export"))
    resumed = _actor(rank, world, cfg)
    resumed.load_checkpoint(str(folder / "checkpoint"))
    gathers[0] = 0
    prompts = TensorDict(
        {
            "input_ids": torch.ones(2, 3, dtype=torch.long),
            "attention_mask": torch.ones(2, 3, dtype=torch.long),
            "position_ids": torch.arange(3).expand(2, 3).clone(),
            "uid": torch.arange(2),
            "sample_key": sample_keys(0, 0, 2, 1),
        },
        batch_size=[2],
    )
    prompts.set_non_tensor("temperature", 1.0)
    resumed.generate(prompts, SamplingParams(max_new_tokens=2), seed=7)
    copy = resumed._generation_copy
    assert copy is not None
    return {
        "synced": synced,
        "refreshed": gathers[0],
        "copy": {name: value.clone() for name, value in copy.state_dict().items()},
        "buckets": buckets,
    }


def test_an_fsdp_actor_with_empty_shards_of_its_tied_head_syncs_resumes_and_exports_alike(
    tmp_path: Path,
) -> None:
    """Mutation: ``first_names`` leaving an entry whose local shard is empty its own name
    (the guard it had): rank 3 takes the head for a tensor of its own, gathers it once more
    than the others in the sync, and the ranks' gathers mismatch (gloo aborts the ranks,
    or they wait to the timeout)."""
    tiny_qwen2(tied=True, vocab_size=VOCAB).save_pretrained(tmp_path / "model")
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            "actor.strategy=fsdp",
            f"trainer.workers_per_node={WORLD}",
            "actor.micro_batch_size_per_worker=4",
            "critic.micro_batch_size_per_worker=4",
            "rollout.decode=eager",
            f"model.path={tmp_path / 'model'}",
            f"trainer.output_dir={tmp_path / 'run'}",
        ],
    )
    reference = _policy(cfg, seed=0)
    _moved(reference)
    expected = reference.state_dict()
    distinct = len(distinct_entries(expected))
    assert distinct == len(expected) - 1  # the head is the embedding
    ranks = run_on_ranks(_sync_resume_export, world_size=WORLD, args=(cfg, tmp_path), timeout_s=120)
    for out in ranks:
        assert out["synced"] == out["refreshed"] == distinct
        assert out["copy"].keys() == expected.keys()
        for name, value in out["copy"].items():
            assert torch.equal(value, expected[name]), name
    buckets: list[WeightBucket] = ranks[0]["buckets"]
    rollout = _policy(cfg, seed=1)
    receiver = WeightReceiver(rollout, who="rollout rank 0")
    for bucket in buckets:
        receiver.load(bucket)
    receiver.require(1)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    for model in (rollout, exported):
        held = model.state_dict()
        assert held.keys() == expected.keys()
        for name, value in held.items():
            assert torch.equal(value, expected[name]), name
