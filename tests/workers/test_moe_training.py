"""Mixture-of-Experts models (real Hugging Face classes, tiny configs) through verlite's paths:
every parameter's optimizer state survives a checkpoint, including a parameter that has not
had a gradient yet, and the resume is the uninterrupted run bit for bit (float32); fp64
trains; the router's load-balancing loss stays out of the objective; the invariance audit
holds (and on a sliding-window model); static decoding is eager decoding's."""

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import pytest
import torch
from model_support import tiny_moe
from torch import nn

from tests.generation.test_static_decode import (
    SETTINGS,
    assert_same,
    noise,
    prompts,
    ragged_eos,
    sampler,
)
from verlite.audit.invariance import check_invariance, make_batch, tolerance_for
from verlite.config import load_config
from verlite.distributed import full_state_dict, run_on_ranks, unwrap
from verlite.generation import DecodeSettings
from verlite.models import build_policy, build_value_model
from verlite.models.logits_chunk import set_logits_chunk_tokens
from verlite.step_batch import stamp_counts
from verlite.workers.objectives import ActorLossSettings, ppo_loss
from verlite.workers.train_engine import TrainEngine, global_counts

CONFIG = load_config(
    "configs/ppo_tiny.yaml",
    ["model.dtype=float32", "actor.optim.warmup_steps=3", "actor.optim.schedule=cosine"],
)
LOSS = partial(ppo_loss, settings=ActorLossSettings.from_config(CONFIG.actor))


def engine(strategy: str) -> TrainEngine:
    cfg = CONFIG.actor.model_copy(update={"strategy": strategy})
    model = tiny_moe()
    set_logits_chunk_tokens(model, CONFIG.model.logits_chunk_tokens)
    return TrainEngine(model, cfg=cfg, total_updates=10, metric_prefix="actor")


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral", "qwen3_moe"])
def test_an_expert_no_token_reaches_still_has_a_gradient(kind: str) -> None:
    """Transformers 5 keeps a layer's experts in one 3-D parameter (``experts.gate_up_proj``,
    ``experts.down_proj``): an expert no token was routed to is a zero slice of a gradient
    every layer has, so every parameter steps from the first update (and DDP, which needs a
    gradient for every parameter, trains these models)."""
    model = tiny_moe(kind)
    ids = torch.tensor([[5, 5, 5, 5]])  # one token, one routing: at most 1 expert of 4 used
    model(ids).logits.sum().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    experts = model.model.layers[0].mlp.experts.gate_up_proj.grad
    unused = [e for e in range(experts.shape[0]) if not experts[e].any()]
    assert len(unused) >= 3


@contextmanager
def _no_gradient_for(module: nn.Linear) -> Iterator[None]:
    """``module`` computed with its weight detached: it gets no gradient (as an expert of
    its own module, the layout of Hugging Face's MoE classes before transformers 5 and of
    remote-code ones, gets none when no token reaches it)."""
    module.forward = lambda x: nn.functional.linear(x, module.weight.detach())
    try:
        yield
    finally:
        del module.forward


def _gate(eng: TrainEngine) -> nn.Linear:
    return unwrap(eng.model).model.layers[1].mlp.shared_expert_gate


def _run(
    eng: TrainEngine, batch, *, starve: bool, save: Path | None = None, load: Path | None = None
) -> list:
    """Four updates, with ``starve`` the first two without a gradient for layer 1's
    shared-expert gate (AdamW creates it no state); or the first two and a save; or a load
    and the last two."""
    gate = _gate(eng)
    metrics = []
    if load is None:
        with _no_gradient_for(gate) if starve else nullcontext():
            metrics += [eng.train_mini_batch(batch.clone(), LOSS) for _ in range(2)]
        assert any(p is gate.weight for p in eng.optimizer.state) != starve
        if save is not None:
            eng.save(save)
            return metrics
    else:
        eng.load(load)
    return metrics + [eng.train_mini_batch(batch.clone(), LOSS) for _ in range(2)]


def _resume(rank: int, world: int, strategy: str, starve: bool, path: str, batch) -> tuple:
    local = batch[rank::world]
    straight = engine(strategy)
    metrics = _run(straight, local, starve=starve)
    _run(engine(strategy), local, starve=starve, save=Path(path))
    resumed = engine(strategy)
    then = _run(resumed, local, starve=starve, load=Path(path))
    steps = {
        p is _gate(resumed).weight: float(s["step"]) for p, s in resumed.optimizer.state.items()
    }
    return metrics[2:], then, full_state_dict(straight.model), full_state_dict(resumed.model), steps


def _check(results: list, *, starve: bool) -> None:
    for expected, then, straight, resumed, steps in results:
        assert then == expected
        assert straight.keys() == resumed.keys()
        for name, value in straight.items():
            assert torch.equal(resumed[name], value), name
        # with ``starve`` the gate's own count is 2 (its first step was the run's third)
        assert steps == {False: 4.0, True: 2.0 if starve else 4.0}


def test_a_parameter_without_optimizer_state_resumes_exactly(tmp_path: Path) -> None:
    """A checkpoint of an optimizer where a trained parameter had no state yet: DCP saved
    none for it and the resume failed (``cannot load ...: Missing key in checkpoint
    state_dict: optim.state.model.layers.1.mlp.shared_expert_gate.weight.step``); given
    placeholder state, its first real update after the resume would be bias-corrected as
    a second. Now it resumes without state, as the uninterrupted run has it."""
    _check([_resume(0, 1, "none", True, str(tmp_path), make_batch(CONFIG))], starve=True)


@pytest.mark.parametrize(("strategy", "starve"), [("fsdp", True), ("ddp", False)])
def test_a_moe_resumes_exactly_on_two_ranks(strategy: str, starve: bool, tmp_path: Path) -> None:
    """The same over two FSDP2 ranks (gloo); over two DDP ranks with every parameter
    stepped (DDP needs a gradient for every parameter at every update: a module no token
    reaches stops it, ``find_unused_parameters`` being off), the unrouted experts included."""
    batch = make_batch(CONFIG)
    args = (strategy, starve, str(tmp_path), batch)
    _check(run_on_ranks(_resume, world_size=2, args=args), starve=starve)


# ------------------------------------------------------------------ verlite's other paths


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2-MoE (shared expert, top-1 of 4 experts) saved as a model folder."""
    path = tmp_path_factory.mktemp("qwen2_moe")
    tiny_moe().save_pretrained(path)
    return str(path)


def _fp64(moe_path: str, *overrides: str):
    return load_config(
        "configs/ppo_tiny.yaml", [f"model.path={moe_path}", "model.precision=fp64", *overrides]
    )


def test_an_fp64_moe_trains(moe_path: str) -> None:
    """Transformers runs experts through ``grouped_mm``, which has no fp64 kernel: an fp64
    update stopped with "RuntimeError: Expected mat_a to be Float32, BFloat16 or Float16
    matrix, got Double". fp64 models run Hugging Face's eager experts
    (``models.precision.fp64_throughout``), the policy's and the critic's."""
    cfg = _fp64(moe_path)
    policy = build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0)
    critic = build_value_model(cfg.model, vocab_size=64, max_positions=64, seed=0)
    for model in (policy, critic.trunk):
        assert model.config._experts_implementation == "eager"
    engine = TrainEngine(policy, cfg=cfg.actor, total_updates=2, metric_prefix="actor")
    metrics = engine.train_mini_batch(
        make_batch(cfg), partial(ppo_loss, settings=ActorLossSettings.from_config(cfg.actor))
    )
    assert math.isfinite(metrics["actor/grad_norm"].value)


def test_the_router_load_balancing_loss_is_not_added_to_the_objective(moe_path: str) -> None:
    """Hugging Face adds ``router_aux_loss_coef`` x its load-balancing loss to the loss it
    computes from ``labels`` when ``output_router_logits`` is set; verlite passes no labels
    and computes its own objective, so a config with it set trains the same gradient: the
    router learns from the RL objective alone (docs/models.md)."""
    cfg = _fp64(moe_path)
    loss = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg.actor))
    grads = []
    for router_logits in (False, True):
        model = build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0)
        model.config.output_router_logits = router_logits
        model.config.router_aux_loss_coef = 10.0
        engine = TrainEngine(model, cfg=cfg.actor, total_updates=2, metric_prefix="actor")
        td = make_batch(cfg)
        stamp_counts(td, global_counts(td, device=torch.device("cpu")))
        loss(engine.model, td)[0].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.equal(grads[1][name], grad), name


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_moe_gradients_are_invariant_to_micro_batches_and_ranks(
    moe_path: str, strategy: str
) -> None:
    """The invariance audit on the MoE (fp64, both roles): routing is per token, so the
    gradient of every layout (2 ranks; fixed, token-budget, packed and checkpointed micro-
    batches) is the single-process full batch's."""
    reports = check_invariance(
        _fp64(moe_path),
        dps=[2],
        strategies=[strategy],
        micros=["1", "dynamic", "packed-dynamic", "checkpointed"],
    )
    assert len(reports) == 2 * 4
    failures = [r for r in reports if r.worst() > tolerance_for(_fp64(moe_path))]
    assert not failures, failures


def test_the_static_decode_path_generates_what_eager_decoding_does(moe_path: str) -> None:
    """The static KV cache decodes an MoE token for token as the eager path does (fp64,
    sampled with top-k and top-p). Not cuda_graphs: an fp64 model's experts run through
    Hugging Face's eager experts (``models.precision.fp64_throughout``), a loop over the
    experts a batch routes to, read on the host at every step, which a CUDA graph cannot
    capture (the CPU stand-in, which replays the recorded ops, finds that host read)."""
    model = build_policy(_fp64(moe_path).model, vocab_size=64, max_positions=96, seed=0)
    td, params = prompts(batch=10, width=7, seed=3), SETTINGS["top_k_top_p"]
    eos = ragged_eos(model, td, params, 6)
    eager = sampler(model, DecodeSettings("eager"), eos).generate(td, params, noise(td, 6, 14))
    static = sampler(model, DecodeSettings("static"), eos)
    assert_same(static.generate(td, params, noise(td, 6, 14)), eager)


def test_sliding_window_gradients_are_invariant_to_micro_batches_and_ranks(
    tmp_path: Path,
) -> None:
    """A Mistral whose window (4) is shorter than the audit's rows: a micro-batch trimmed to
    its own longest prompt and response keeps each row's real tokens contiguous, so every
    query attends the same keys in any layout (packing refuses a window a sequence can
    pass: tests/workers/test_packing.py)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    cfg = load_config("configs/ppo_tiny.yaml", [f"model.path={tmp_path}", "model.precision=fp64"])
    reports = check_invariance(
        cfg, dps=[2], strategies=["fsdp"], micros=["1", "dynamic", "checkpointed"]
    )
    failures = [r for r in reports if r.worst() > tolerance_for(cfg)]
    assert len(reports) == 2 * 3 and not failures, failures


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_a_window_no_sequence_passes_is_invariant_packed(kind: str, tmp_path: Path) -> None:
    """A sliding window as long as the run's longest sequence (every layer's, Mistral; the
    second layer's, Qwen2 with use_sliding_window): packed micro-batches, fixed and on a
    token budget, give the single-process padded full batch's gradients for both roles."""
    from model_support import tiny_sliding

    cfg = load_config("configs/ppo_tiny.yaml", ["model.precision=fp64"])
    tiny_sliding(kind, cfg.max_sequence_length).save_pretrained(tmp_path)
    cfg = load_config("configs/ppo_tiny.yaml", [f"model.path={tmp_path}", "model.precision=fp64"])
    reports = check_invariance(
        cfg, dps=[2], strategies=["fsdp"], micros=["packed", "packed-dynamic"]
    )
    failures = [r for r in reports if r.worst() > tolerance_for(cfg)]
    assert len(reports) == 2 * 2 and not failures, failures
