"""The actor worker in this process: its fused ``generate_with_log_probs`` call returns exactly what
``generate`` followed by ``compute_log_probs`` returns (the same rows, tokens, old and
reference log-probs), a rollout worker given its weights generates exactly its batch (under
bf16-mixed with a bf16 head of its own where the policy's is tied, which the sync fills, also
from an FSDP actor on spawned ranks), and the model it exports computes the trained policy's
log-probs."""

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from chat_model_support import save_chat_model
from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from tests.model_support import LARGE_GENERATION
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


def _reference_and_old_log_probs(
    rank: int, world: int, cfg: Config, ids: dict[str, int], prompts: TensorDict
) -> tuple[torch.Tensor, torch.Tensor]:
    """On each of ``world`` ranks (spawned, or this process alone): an actor of ``cfg`` that
    has not trained yet, its reference and old log-probs of its share of ``prompts``."""
    actor = ActorWorker(rank=rank, world_size=world, torch_threads=1, role="actor", cfg=cfg, **ids)
    actor.init_model()
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)
    batch = actor.generate_with_log_probs(prompts[rank::world], sampling, 7, True)
    assert bool(batch["response_mask"].any())
    return batch["ref_log_prob"], batch["old_log_probs"]


@pytest.mark.parametrize(
    ("precision", "strategy", "workers"),
    [("fp32", "ddp", 1), ("bf16-mixed", "ddp", 1), ("bf16-mixed", "fsdp", 2)],
)
def test_a_packing_actors_reference_gives_the_initial_policys_log_probs(
    precision: str, strategy: str, workers: int, tmp_path: Path
) -> None:
    """The reference (a KL term) is the initial policy stored as models that are never
    trained are: under bf16-mixed, bf16 linear layers, which compute only under autocast.
    Switched to packed attention after it was stored, the forward that proves packed
    sequences stay apart ran them without autocast and the actor failed to start ("expected
    m1 and m2 to have the same dtype"). Before any update its log-probs are the policy's,
    bit for bit, on one worker and on each of two FSDP ranks."""
    from verlite.distributed import run_on_ranks

    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            f"model.precision={precision}",
            "actor.packing=true",
            "actor.use_kl_loss=true",
            f"actor.strategy={strategy}",
            f"trainer.workers_per_node={workers}",
            "actor.micro_batch_size_per_worker=8",
            "critic.micro_batch_size_per_worker=8",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    train_set, _ = build_datasets(cfg, tokenizer)
    prompts = _sampled_prompts(cfg, tokenizer, train_set)
    ids = {k: v for k, v in _one_rank("actor", cfg, tokenizer).items() if k.endswith("_id")}
    ids["vocab_size"] = len(tokenizer)
    if workers == 1:
        ranks = [_reference_and_old_log_probs(0, 1, cfg, ids, prompts)]
    else:
        ranks = run_on_ranks(
            _reference_and_old_log_probs, world_size=workers, args=(cfg, ids, prompts)
        )
    for reference, old in ranks:
        assert torch.equal(reference, old)


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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_exported_model_computes_the_trained_policys_log_probs(
    precision: str, tmp_path: Path
) -> None:
    """Its logits bit for bit in the run's dtype. Under bf16 the built-in model was cast with
    ``Module.to``, which rounded its rotary frequencies (``inv_freq``, a buffer the export does
    not hold) to bf16 while Hugging Face's loading keeps them float32: the export's
    log-probs were up to 0.008 from the trained policy's."""
    from transformers import AutoModelForCausalLM

    from verlite.models.logits_chunk import set_logits_chunk_tokens
    from verlite.workers.forward import response_log_probs

    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [f"trainer.output_dir={tmp_path}", f"model.precision={precision}"],
    )
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
        reloaded, _ = response_log_probs(exported, batch, temperature=1.0, entropy="none")
    mask = batch["response_mask"].bool()
    if precision == "fp32":  # the worker's own forward (chunks, micro-batches) rounds apart
        torch.testing.assert_close(reloaded[mask], trained[mask], rtol=0, atol=1e-6)
    assert exported.dtype == next(worker.engine.model.parameters()).dtype
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected = worker.engine.model(**inputs).logits
        torch.testing.assert_close(exported(**inputs).logits, expected, rtol=0, atol=0)


def _split_run_decoding_on_cuda(*overrides: str) -> tuple[Config, Any, Any]:
    """A split run's config on cuda (which validates), its policy, and how a worker of it
    decodes (``PolicyWorker.decode_settings``, called on CPU: only its decision is tested)."""
    from types import SimpleNamespace

    from verlite.models import build_policy
    from verlite.workers.policy_worker import PolicyWorker

    overrides = ("model.device=cuda", "rollout.placement=split", *overrides)
    cfg = load_config("configs/ppo_tiny.yaml", list(overrides))
    assert cfg.trainer.val_freq > 0
    model = build_policy(cfg.model, vocab_size=40, max_positions=16, seed=0)
    worker = SimpleNamespace(cfg=cfg)

    def settings(*, lockstep: bool, trains_on: bool) -> Any:
        cuda = torch.device("cuda")
        return PolicyWorker.decode_settings(
            worker, model, cuda, lockstep=lockstep, trains_on=trains_on
        )  # type: ignore[arg-type]

    return cfg, model, settings


def test_an_fsdp_actor_validating_a_split_run_decodes_static_not_with_graphs() -> None:
    """``rollout.decode=cuda_graphs`` with an FSDP actor passes start-up when a rollout group
    generates (split); the actor still generates the validation batches, in lockstep, and
    its all-gathers cannot be captured: it decodes statically, the rollout group with graphs."""
    _, _, settings = _split_run_decoding_on_cuda(
        "rollout.decode=cuda_graphs",
        "actor.strategy=fsdp",
        "trainer.workers_per_node=2",
        "actor.micro_batch_size_per_worker=8",
        "critic.micro_batch_size_per_worker=8",
    )
    assert settings(lockstep=True, trains_on=False).mode == "static"
    assert settings(lockstep=False, trains_on=True).mode == "cuda_graphs"


@pytest.mark.parametrize("decode", ["cuda_graphs", "auto"])
def test_a_split_runs_actor_validates_without_graphs_or_a_generation_copy(decode: str) -> None:
    """With ``rollout.placement=split`` the rollout group generates the rows trained on; the
    actor generates the validation batches only, every ``trainer.val_freq`` steps. With
    CUDA graphs it held, all run long, their memory pool and, under bf16-mixed, a bf16 copy
    of the policy to capture them from (``generation_copy``: 15 GB for a 7B policy), for a
    few generations. It decodes statically from the trained model instead: autocast's bf16
    casts last as long as a validation's generation (the replayed graphs run the static
    step: ``tests/generation/test_static_decode.py``). The rollout group keeps its graphs."""
    from verlite.workers.actor import generation_copy

    cfg, model, settings = _split_run_decoding_on_cuda(
        f"rollout.decode={decode}", "model.precision=bf16-mixed", "actor.strategy=ddp"
    )
    validating = settings(lockstep=False, trains_on=False)
    assert validating.mode == "static"
    assert generation_copy(model, cfg, validating) is None
    rollout = settings(lockstep=False, trains_on=True)
    assert rollout.mode == "cuda_graphs"
    colocated = ["model.device=cuda", f"rollout.decode={decode}", "model.precision=bf16-mixed"]
    assert generation_copy(model, load_config("configs/ppo_tiny.yaml", colocated), rollout)


def _rollout(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> RolloutWorker:
    """A ready rollout worker of ``cfg`` in this process."""
    worker = RolloutWorker(**_one_rank("rollout", cfg, tokenizer))
    worker.node_info = lambda: {"node_ip": "127.0.0.1"}  # no Ray in this process
    worker.init_model()
    return worker


def _split_bf16_mixed(tmp_path: Path, *overrides: str) -> Config:
    """A split bf16-mixed run of a ``model.path`` Qwen2 whose LM head is tied to its
    embedding (as Qwen2.5-0.5B's), synced in buckets of 10 KB."""
    save_chat_model(tmp_path / "model")
    return load_config(
        "configs/ppo_tiny.yaml",
        [
            "rollout.placement=split",
            "model.precision=bf16-mixed",
            "rollout.sync_bucket_mb=0.01",
            f"model.path={tmp_path / 'model'}",
            f"trainer.output_dir={tmp_path / 'run'}",
            *overrides,
        ],
    )


def _own_bf16_head(worker: RolloutWorker) -> torch.Tensor:
    """The rollout model's LM head weight, checked to be its own bf16 tensor beside the
    fp32 embedding."""
    model = worker.generation_engine.receiver.model
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is not embedding and head.data_ptr() != embedding.data_ptr()
    assert (head.dtype, embedding.dtype) == (torch.bfloat16, torch.float32)
    return head


def test_a_bf16_mixed_rollout_worker_holds_its_own_bf16_head_which_the_sync_fills(
    tmp_path: Path,
) -> None:
    """Under bf16-mixed the rollout model's LM head, tied to the embedding in the policy, is
    a bf16 parameter of its own: tied, it would stay fp32 (the embedding's dtype) and be cast
    to bf16 at every decode step a CUDA graph replays. A sync sends it under its own name,
    cast once on the actor, its check covering it: after the sync the head is the bf16 cast
    of the actor's trained embedding, bit for bit, and the worker generates the actor's batch."""
    cfg = _split_bf16_mixed(tmp_path)
    actor, tokenizer, train_set = _actor(cfg)
    with torch.no_grad():  # weights no fresh model has
        for param in actor.engine.model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    rollout = _rollout(cfg, tokenizer)
    head = _own_bf16_head(rollout)
    layout = actor.weight_layout()
    sent = {spec.name: spec.dtype for bucket in layout.buckets for spec in bucket}
    assert sent["lm_head.weight"] == "bfloat16" and sent["model.embed_tokens.weight"] == "float32"
    assert layout.buckets[-1][-1].name == "lm_head.weight"
    buckets = []
    for index in range(len(layout.buckets)):
        bucket = actor.publish_bucket(5, index)
        buckets.append(dataclasses.replace(bucket, parts=[part.copy() for part in bucket.parts]))

    # A sync that leaves the head out (the tied layout, the embedding sent once) is refused.
    engine = rollout.generation_engine
    with pytest.raises(WeightSyncError, match=r"did not send 1 of .* \(e\.g\. 'lm_head\.weight'\)"):
        for bucket in buckets[:-1]:
            engine.load_bucket(dataclasses.replace(bucket, count=len(buckets) - 1))
    for bucket in buckets:
        engine.load_bucket(bucket)
    assert engine.version == 5
    trained = actor.engine.model.get_input_embeddings().weight
    assert torch.equal(head, trained.to(torch.bfloat16)) and not torch.equal(
        head, _own_bf16_head(_rollout(cfg, tokenizer))
    )
    assert torch.equal(engine.receiver.model.get_input_embeddings().weight, trained)

    prompts = _sampled_prompts(cfg, tokenizer, train_set)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)
    generated = rollout.generate(prompts, sampling, 7, 5)
    pop_peak(generated)
    expected = actor.generate(prompts, sampling, 7)
    for key in sorted(expected.keys()):
        assert torch.equal(torch.as_tensor(generated[key]), torch.as_tensor(expected[key])), key


def _fsdp_sync(rank: int, world: int, cfg: Config, ids: dict[str, int]) -> dict[str, Any] | None:
    """On each of ``world`` spawned ranks: an FSDP actor of ``cfg`` whose shards moved off
    the initial weights publishes the sync of version 2; rank 0 returns its buckets and the
    policy's full state, gathered."""
    from verlite.distributed import full_state_dict

    actor = ActorWorker(rank=rank, world_size=world, torch_threads=1, role="actor", cfg=cfg, **ids)
    actor.init_model()
    torch.manual_seed(rank)
    with torch.no_grad():  # a shard of its own on each rank
        for param in actor.engine.model.parameters():
            param.to_local().add_(torch.randn_like(param.to_local()) * 0.05)
    buckets = []
    for index in range(len(actor.weight_layout().buckets)):
        bucket = actor.publish_bucket(2, index)
        if bucket is not None:
            buckets.append(dataclasses.replace(bucket, parts=[p.copy() for p in bucket.parts]))
    state = full_state_dict(actor.engine.model, rank0_only=True)
    return {"buckets": buckets, "state": state} if rank == 0 else None


def test_an_fsdp_actors_sync_fills_the_bf16_head_of_a_rollout_worker(tmp_path: Path) -> None:
    """Sharded, the tied head is one DTensor with the embedding: every rank gathers it for
    the embedding's entry and again for the head's, which rank 0 casts to bf16. What lands in
    a rollout worker is the actor's gathered state in the rollout model's dtypes, bit for bit."""
    from verlite.distributed import run_on_ranks

    cfg = _split_bf16_mixed(
        tmp_path,
        "actor.strategy=fsdp",
        "trainer.workers_per_node=2",
        "actor.micro_batch_size_per_worker=8",
        "critic.micro_batch_size_per_worker=8",
    )
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    ids = {k: v for k, v in _one_rank("actor", cfg, tokenizer).items() if k.endswith("_id")}
    ids["vocab_size"] = len(tokenizer)
    published = run_on_ranks(_fsdp_sync, world_size=2, args=(cfg, ids))[0]
    rollout = _rollout(cfg, tokenizer)
    for bucket in published["buckets"]:
        rollout.generation_engine.load_bucket(bucket)
    assert rollout.generation_engine.version == 2
    trained = published["state"]
    held = rollout.generation_engine.receiver.model.state_dict()
    assert held.keys() == trained.keys()
    for name, value in held.items():
        assert torch.equal(value, trained[name].to(value.dtype)), name
    head = _own_bf16_head(rollout)
    assert torch.equal(head, trained["model.embed_tokens.weight"].to(torch.bfloat16))


def test_a_lora_rollout_worker_holds_its_bf16_head_in_the_base_the_sync_checks(
    tmp_path: Path,
) -> None:
    """With LoRA an adapters-only sync checks the rollout model's base against the actor's:
    the head it holds apart, in bf16, is part of that base, frozen as the embedding is, and
    the actor's checksum casts its tied head alike (mutation: a head made trainable when
    untied leaves the base, and the check refuses the sync)."""
    cfg = _split_bf16_mixed(tmp_path, "actor.lora.rank=4")
    actor, tokenizer, train_set = _actor(cfg)
    with torch.no_grad():  # adapters no fresh model has
        for param in actor.engine.model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    rollout = _rollout(cfg, tokenizer)
    layout = actor.weight_layout()
    assert all(".lora_" in spec.name for bucket in layout.buckets for spec in bucket)
    for index in range(len(layout.buckets)):
        bucket = actor.publish_bucket(3, index)
        copied = [part.copy() for part in bucket.parts]
        rollout.generation_engine.load_bucket(dataclasses.replace(bucket, parts=copied))
    assert not _own_bf16_head(rollout).requires_grad
    prompts = _sampled_prompts(cfg, tokenizer, train_set)
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)
    generated = rollout.generate(prompts, sampling, 7, 3)
    pop_peak(generated)
    expected = actor.generate(prompts, sampling, 7)
    for key in sorted(expected.keys()):
        assert torch.equal(torch.as_tensor(generated[key]), torch.as_tensor(expected[key])), key


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_training_group_joins_the_backend_of_the_device_its_model_runs_on(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker given a GPU whose model runs on the CPU (``model.device=cpu`` with
    ``trainer.gpus_per_worker`` 1 or auto on a GPU machine) joins gloo: NCCL reduces device
    tensors only, and DDP's first broadcast of its CPU parameters would fail. On cuda, NCCL.
    (Run on CPU, torch told a GPU is visible; the group's join is recorded, not made.)"""
    from verlite.controller import worker as worker_module
    from verlite.distributed import default_backend
    from verlite.workers.critic import CriticWorker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    joined: list[str] = []

    def record(**kwargs: Any) -> None:
        joined.append(kwargs.get("backend") or default_backend())

    monkeypatch.setattr(worker_module, "init_process_group", record)
    cfg = load_config("configs/ppo_tiny.yaml", [f"model.device={device}"])
    for kind in (ActorWorker, CriticWorker):
        worker = object.__new__(kind)
        worker.cfg, worker.rank, worker.world_size = cfg, 0, 2
        worker.role = "actor" if kind is ActorWorker else "critic"
        worker.init_distributed("127.0.0.1", 29500)
    assert joined == ["gloo" if device == "cpu" else "nccl"] * 2
    # An actor keeping its FSDP2 shards on the host (offload=all) joins gloo for them too.
    joined.clear()
    offloaded = [f"model.device={device}", "actor.strategy=fsdp", "actor.offload=all"]
    cfg = load_config("configs/ppo_tiny.yaml", offloaded)
    for kind in (ActorWorker, CriticWorker):
        worker = object.__new__(kind)
        worker.cfg, worker.rank, worker.world_size = cfg, 0, 2
        worker.role = "actor" if kind is ActorWorker else "critic"
        worker.init_distributed("127.0.0.1", 29500)
    assert joined == (["gloo"] * 2 if device == "cpu" else ["cuda:nccl,cpu:gloo", "nccl"])


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_a_generating_worker_whose_gpu_cannot_hold_the_generation_refuses_first(
    monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
    """On a cluster the driver cannot see the GPUs: each worker that generates (the actor
    colocated, the rollout worker split) checks that its own GPU holds a generation's KV
    cache and weights before it builds a model (``policy_worker.check_generation_fits``,
    the check the driver makes before an embedded Ray). It was found at the first
    generation, the weights loaded (``GenerationTooLarge``, a run failure), or not at all in
    eager decoding. A 0.5B-shaped policy generating 512 rows of 1088 positions: 6.4 GiB of
    KV cache on a 1 GiB GPU."""
    from types import SimpleNamespace

    from verlite.config import ConfigError
    from verlite.workers import rollout

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=2**30)
    )

    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built")

    monkeypatch.setattr(ActorWorker, "_build_policy", built)
    monkeypatch.setattr(rollout, "build_policy", built)
    on_a_cluster = ["trainer.ray_address=10.0.0.1:6379", f"rollout.placement={placement}"]
    cfg = load_config("configs/ppo_tiny.yaml", [*LARGE_GENERATION, *on_a_cluster])
    tokenizer = load_tokenizer(cfg.model.path, task=cfg.data.task)
    role, worker_class = (
        ("actor", ActorWorker) if placement == "colocated" else ("rollout", RolloutWorker)
    )
    worker = worker_class(**_one_rank(role, cfg, tokenizer))
    with pytest.raises(ConfigError, match=r"^generation cannot fit Fake GPU \(1.0 GiB\): the KV"):
        worker.init_model()
