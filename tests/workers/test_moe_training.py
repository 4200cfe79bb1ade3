"""Mixture-of-Experts models (real Hugging Face classes, tiny configs) through the training
engine: every parameter's optimizer state survives a checkpoint, including a parameter that
has not had a gradient yet, and the resume is the uninterrupted run bit for bit (float32)."""

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import pytest
import torch
from model_support import tiny_moe
from torch import nn

from verlite.audit.invariance import make_batch
from verlite.config import load_config
from verlite.distributed import full_state_dict, run_on_ranks, unwrap
from verlite.models import set_logits_chunk_tokens
from verlite.workers.objectives import ActorLossSettings, ppo_loss
from verlite.workers.train_engine import TrainEngine

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
