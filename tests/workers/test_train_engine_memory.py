"""Memory settings of the training roles (``gradient_checkpointing``, ``offload``): they change
where tensors live and what is recomputed, never the update. Activation checkpointing
recomputes each decoder layer in backward only (never in log-prob or value passes) and gives
the same gradients, in float32, bfloat16 and under bfloat16 autocast; the optimizer state with
``offload=optimizer`` comes to the device for the step only, resumes from a checkpoint exactly,
and FSDP2's CPU offload (``offload=all``) trains at one rank too; the actor's reference waits
on the CPU between its passes. The invariance audit over spawned ranks: the ``checkpointed``
micro layout in tests/workers/test_train_engine_invariance.py, offload below."""

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from test_actor_worker import _actor, _sampled_prompts
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel

from benchmarks.common import peak_tensor_bytes
from verlite.audit.invariance import check_invariance, make_batch
from verlite.config import Config, ConfigError, load_config
from verlite.core.losses import GlobalCounts
from verlite.core.metrics import Stage, reduce_metrics
from verlite.distributed import (
    apply_fsdp,
    destroy_process_group,
    find_decoder_layers,
    full_state_dict,
    is_initialized,
    move_optimizer_state,
    run_on_ranks,
)
from verlite.generation import SamplingParams
from verlite.models import build_policy, build_value_model, enable_gradient_checkpointing
from verlite.models.support import check_gradient_checkpointing_supported
from verlite.step_batch import stamp_counts
from verlite.workers import actor as actor_module
from verlite.workers import objectives, train_engine
from verlite.workers.forward import response_log_probs
from verlite.workers.objectives import (
    ActorLossSettings,
    CriticLossSettings,
    ppo_loss,
    value_loss,
)
from verlite.workers.train_engine import TrainEngine

CONFIG = load_config("configs/ppo_tiny.yaml", ["model.dtype=float64"])
LOSS = partial(ppo_loss, settings=ActorLossSettings.from_config(CONFIG.actor))
TOLERANCE = 1e-9


def policy(cfg: Config = CONFIG, lora_rank: int = 0) -> nn.Module:
    lora = cfg.actor.lora.model_copy(update={"rank": lora_rank})
    return build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0, lora=lora)


def mlp_calls(model: nn.Module) -> list[int]:
    """A counter of the decoder layers' MLP runs: a checkpointed layer's forward runs again in
    backward (where the MLPs' forward hooks did not fire, so each one's ``forward`` is wrapped)."""
    calls = [0]

    def counted(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return forward(*args)

        return run

    for layer in find_decoder_layers(model):
        layer.mlp.forward = counted(layer.mlp.forward)
    return calls


def test_checkpointing_recomputes_in_backward_only() -> None:
    batch = make_batch(CONFIG)
    layers = CONFIG.model.num_layers
    for checkpointed in (False, True):
        model = policy()
        if checkpointed:
            enable_gradient_checkpointing(model)
        calls = mlp_calls(model)
        model.train()
        log_probs, _ = response_log_probs(model, batch, temperature=1.0, entropy="none")
        log_probs.sum().backward()
        assert calls[0] == layers * (2 if checkpointed else 1)
        # The log-prob passes (eval and no_grad, as ``train_engine.infer``; and no_grad in
        # training mode) run each layer once.
        for train_mode in (False, True):
            calls[0] = 0
            model.train(train_mode)
            with torch.no_grad():
                response_log_probs(model, batch, temperature=1.0, entropy="none")
            assert calls[0] == layers


PRECISIONS = {  # model dtype, forward under bfloat16 autocast
    "float32": ("float32", False),
    "bfloat16": ("bfloat16", False),
    "float32 under bfloat16 autocast": ("float32", True),
}


def _grads(role: str, dtype: str, *, autocast: bool, checkpointed: bool, lora: int = 0) -> dict:
    """One engine update (SGD, no clipping) of a fresh actor or critic; its gradients by name."""
    cfg = load_config("configs/ppo_tiny.yaml", [f"model.dtype={dtype}"])
    if role == "actor":
        model = policy(cfg, lora_rank=lora)
        loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg.actor))
    else:
        model = build_value_model(cfg.model, vocab_size=64, max_positions=64, seed=0)
        loss_fn = partial(value_loss, settings=CriticLossSettings.from_config(cfg.critic))
    section = getattr(cfg, role)
    optim = section.optim.model_copy(update={"name": "sgd", "grad_clip": None})
    settings = {"gradient_checkpointing": checkpointed, "optim": optim}
    engine = TrainEngine(
        model, cfg=section.model_copy(update=settings), total_updates=1, metric_prefix=role
    )

    def loss(m: nn.Module, td: TensorDict) -> tuple[torch.Tensor, dict]:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext():
            return loss_fn(m, td)

    engine.train_mini_batch(make_batch(cfg), loss)
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("role", "lora"), [("actor", 0), ("actor", 4), ("critic", 0)])
def test_checkpointing_gives_the_same_gradients(role: str, lora: int, precision: str) -> None:
    """Bit for bit: the recomputed forward is the same computation (autocast included)."""
    dtype, autocast = PRECISIONS[precision]
    plain = _grads(role, dtype, autocast=autocast, checkpointed=False, lora=lora)
    checkpointed = _grads(role, dtype, autocast=autocast, checkpointed=True, lora=lora)
    assert plain.keys() == checkpointed.keys() and plain
    for name, grad in plain.items():
        assert torch.equal(checkpointed[name], grad), name
    if lora:
        assert all(".lora_" in name for name in plain)


class OpNames(TorchDispatchMode):
    """The names of the aten ops run in the block (``aten._log_softmax_backward_data``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **kwargs or {})


def _entropy_update(coeff: float) -> tuple[list[str], dict[str, torch.Tensor], float]:
    """A fresh actor's ``ppo_loss`` backward at ``actor.entropy_coeff=coeff``: the ops it ran,
    the gradients, and the entropy metric."""
    cfg = load_config("configs/ppo_tiny.yaml", [f"actor.entropy_coeff={coeff}"])
    model, batch = policy(cfg), make_batch(cfg)
    stamp_counts(batch, GlobalCounts.of(batch["response_mask"]))
    loss, metrics = ppo_loss(model, batch, ActorLossSettings.from_config(cfg.actor))
    ops = OpNames()
    with ops:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return ops.names, grads, float(metrics["actor/entropy"].value)


def test_the_entropy_backward_runs_only_when_the_loss_weighs_it(monkeypatch) -> None:
    """The actor's entropy is a metric at every update, over the vocabulary at every response
    token; its backward (a log-softmax's, an exponential's, a product's: vocabulary-wide
    passes) runs only when ``actor.entropy_coeff`` weighs it into the loss. At 0 the gradients
    are those of the entropy differentiated, bit for bit (0 times its gradient), and the
    metric is the same. Mutation: ``entropy`` always ``"loss"`` -> the 0 case runs the
    log-softmax's backward."""
    names, grads, entropy = _entropy_update(0.0)
    assert "_log_softmax_backward_data" not in names  # the log-probs take no log-softmax
    weighed, _, _ = _entropy_update(0.1)
    assert "_log_softmax_backward_data" in weighed
    real = objectives.response_log_probs
    monkeypatch.setattr(
        objectives,
        "response_log_probs",
        lambda *args, **kwargs: real(*args, **{**kwargs, "entropy": "loss"}),
    )
    _, differentiated, same_entropy = _entropy_update(0.0)
    assert grads.keys() == differentiated.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(differentiated[name], grad), name
    assert same_entropy == entropy


def test_a_model_without_checkpointing_is_refused_at_start_up(monkeypatch) -> None:
    check_gradient_checkpointing_supported(CONFIG.model, role="critic")
    monkeypatch.setattr(LlamaPreTrainedModel, "supports_gradient_checkpointing", False)
    for role in ("actor", "critic"):
        with pytest.raises(ConfigError) as info:
            check_gradient_checkpointing_supported(CONFIG.model, role=role)
        message = str(info.value)
        assert message.startswith(f"{role}.gradient_checkpointing=true: Llama")
        assert message.endswith(f"set {role}.gradient_checkpointing=false")
        assert "\n" not in message


# ------------------------------------------------------------------------------ offload


def test_moving_the_optimizer_state_moves_the_moments_not_the_step() -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    before = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    move_optimizer_state(optimizer, torch.device("meta"))
    for state in optimizer.state.values():
        assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
        assert state["step"].device.type == "cpu"
    for param, state in before.items():  # the CPU again: exact copies
        optimizer.state[param] = {k: v.clone() for k, v in state.items()}
    move_optimizer_state(optimizer, torch.device("cpu"))
    for param, state in before.items():
        for key, value in state.items():
            assert torch.equal(optimizer.state[param][key], value), key


def _engine(offload: str, strategy: str = "none", run: Config | None = None) -> TrainEngine:
    run = run or ADAMW
    cfg = run.actor.model_copy(update={"offload": offload, "strategy": strategy})
    return TrainEngine(policy(run), cfg=cfg, total_updates=10, metric_prefix="actor")


@pytest.mark.parametrize("strategy", ["none", "ddp"])
def test_offload_all_without_fsdp_is_refused(strategy: str) -> None:
    """``offload=all`` is FSDP2's CPU offload: under another strategy it offloaded nothing,
    silently (the audit's ddp layouts and reference kept it); the config refuses it for a
    run, and the engine for anyone else."""
    with pytest.raises(
        ValueError, match=f"^offload 'all' is FSDP2's CPU offload; strategy '{strategy}'"
    ):
        _engine("all", strategy)


ADAMW_SETTINGS = ["actor.optim.warmup_steps=3", "actor.optim.schedule=cosine"]
ADAMW = load_config("configs/ppo_tiny.yaml", ["model.dtype=float64", *ADAMW_SETTINGS])
# float32, as a run trains: a resume exact in float64 could still round differently there
ADAMW_FP32 = load_config("configs/ppo_tiny.yaml", ["model.dtype=float32", *ADAMW_SETTINGS])


def test_offloaded_optimizer_state_visits_the_device_one_parameter_at_a_time(monkeypatch) -> None:
    """Each parameter's state comes to the device (the CPU here) for its own step and goes
    back before the next one's comes: the device never holds more than one parameter's
    state (moved at once, the whole model's was there for the step). The steps apart are
    the joint step bit for bit."""
    moves: list[tuple[str, tuple[int, ...]]] = []
    stepped: list[tuple[torch.optim.Optimizer, int]] = []  # each step's optimizer, parameters

    def record(optimizer: torch.optim.Optimizer, device: torch.device, params=None) -> None:
        moves.append((device.type, tuple(map(id, params if params is not None else []))))
        move_optimizer_state(optimizer, device, params)

    real_step = torch.optim.AdamW.step

    def step(optimizer: torch.optim.Optimizer, *args, **kwargs):
        updated = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        stepped.append((optimizer, len(updated)))
        return real_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)  # before the engines wrap it
    monkeypatch.setattr(train_engine, "move_optimizer_state", record)
    batch = make_batch(ADAMW)
    plain, offloaded = _engine("none"), _engine("optimizer")
    for _ in range(2):
        assert offloaded.train_mini_batch(batch, LOSS) == plain.train_mini_batch(batch, LOSS)
    params = list(offloaded.model.parameters())
    assert [n for opt, n in stepped if opt is plain.optimizer] == [len(params)] * 2
    assert [n for opt, n in stepped if opt is offloaded.optimizer] == [1] * (2 * len(params))
    # each parameter's state: to the device, its step, back to the CPU
    expected = [(d, (id(p),)) for p in params for d in ("cpu", "cpu")] * 2
    assert moves == expected
    for name, value in full_state_dict(plain.model).items():
        assert torch.equal(full_state_dict(offloaded.model)[name], value), name
    for ours, theirs in zip(plain.model.parameters(), params, strict=True):
        state = offloaded.optimizer.state[theirs]
        for key, value in plain.optimizer.state[ours].items():
            assert torch.equal(state[key], value), key
    moves.clear()
    plain.train_mini_batch(batch, LOSS)
    assert not moves


@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_a_training_step_leaves_no_gradient_behind(offload: str) -> None:
    """The next step's generation and log-prob passes run beside the weights alone: the
    step's last gradients (as large as the weights in fp32) are dropped once it is done,
    and the step updates as before."""
    batch = make_batch(ADAMW)
    engine, updates = _engine(offload), _engine(offload)
    metrics = engine.train_step(torch.stack([batch, batch]), LOSS)
    assert all(p.grad is None for p in engine.model.parameters())
    assert metrics == reduce_metrics(
        [updates.train_mini_batch(batch, LOSS) for _ in range(2)], Stage.MINI_BATCHES
    )
    for name, value in full_state_dict(updates.model).items():
        assert torch.equal(full_state_dict(engine.model)[name], value), name


def test_resume_with_the_optimizer_state_offloaded_continues_exactly(tmp_path: Path) -> None:
    """The state is read into the tensors the engine created for it on the CPU
    (``test_a_resume_with_the_optimizer_state_offloaded_creates_it_a_parameter_at_a_time``),
    and the resumed updates are the uninterrupted run's, bit for bit."""
    batch = make_batch(ADAMW)
    straight = _engine("optimizer")
    first = [straight.train_mini_batch(batch.clone(), LOSS) for _ in range(2)]
    then = [straight.train_mini_batch(batch.clone(), LOSS) for _ in range(2)]
    saved = _engine("optimizer")
    assert [saved.train_mini_batch(batch.clone(), LOSS) for _ in range(2)] == first
    saved.save(tmp_path)
    resumed = _engine("optimizer")
    resumed.load(tmp_path)
    assert [resumed.train_mini_batch(batch.clone(), LOSS) for _ in range(2)] == then
    for name, value in full_state_dict(straight.model).items():
        assert torch.equal(full_state_dict(resumed.model)[name], value), name


def test_a_load_into_copies_of_the_optimizer_state_is_refused(tmp_path: Path, monkeypatch) -> None:
    """The state is read in place into the tensors ``get_state_dict`` hands back: were they
    copies (another torch, or CPU-offload options), the load would change nothing and the
    run would resume from placeholder moments. It stops instead."""
    from verlite.distributed import sharded_state

    batch = make_batch(ADAMW)
    saved = _engine("optimizer")
    saved.train_mini_batch(batch.clone(), LOSS)
    saved.save(tmp_path)
    real = sharded_state.get_state_dict

    def copying(model, optimizer, options):
        model_state, optim_state = real(model, optimizer, options=options)
        optim_state["state"] = {
            name: {key: value.clone() for key, value in entry.items()}
            for name, entry in optim_state["state"].items()
        }
        return model_state, optim_state

    monkeypatch.setattr(sharded_state, "get_state_dict", copying)
    with pytest.raises(
        RuntimeError, match=r"optimizer state .* is a copy, not the optimizer's own"
    ):
        _engine("optimizer").load(tmp_path)


def _one_parameter_at_a_time(monkeypatch) -> list[int]:
    """The number of parameters with a gradient at each AdamW step from now on; loading an
    optimizer's state with ``Optimizer.load_state_dict`` (which casts every loaded moment
    to its parameter's device, all at once) fails the test."""
    stepped: list[int] = []
    real_step = torch.optim.AdamW.step

    def step(optimizer: torch.optim.Optimizer, *args, **kwargs):
        stepped.append(sum(p.grad is not None for g in optimizer.param_groups for p in g["params"]))
        return real_step(optimizer, *args, **kwargs)

    def load_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
        raise AssertionError("every moment cast to its parameter's device at once")

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", load_state_dict)
    return stepped


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_a_resume_with_the_optimizer_state_offloaded_creates_it_a_parameter_at_a_time(
    tmp_path: Path, monkeypatch
) -> None:
    """A fresh engine has no optimizer state to load into: DCP's ``get_state_dict`` and
    ``set_state_dict`` gave it some by one AdamW step of the whole model with zero
    gradients, every gradient and moment on the device at once (for a 7B policy 91 GB
    beside its 30 GB of fp32 weights: what ``offload=optimizer`` exists to avoid), then
    loaded the checkpoint with ``Optimizer.load_state_dict``, which casts every moment to its
    parameter's device. Now the engine's own step creates it, one parameter at a time,
    where its offload keeps it, and DCP reads the checkpoint into it in place: besides the
    moments (on the CPU) the load holds about one parameter's tensors more. The resume is
    exact: ``test_resume_with_the_optimizer_state_offloaded_continues_exactly``."""
    saved = _engine("optimizer")
    saved.train_mini_batch(make_batch(ADAMW), LOSS)
    saved.save(tmp_path)
    stepped = _one_parameter_at_a_time(monkeypatch)
    resumed = _engine("optimizer")
    params = list(resumed.model.parameters())
    peak = peak_tensor_bytes(lambda: resumed.load(tmp_path))
    assert stepped == [1] * len(params)
    assert all(p.grad is None for p in params)
    moments = [v for s in resumed.optimizer.state.values() for v in s.values() if v.dim()]
    assert len(moments) == 2 * len(params) and all(v.device.type == "cpu" for v in moments)
    largest = max(_nbytes([p]) for p in params)
    # A whole model's gradients (what DCP's step held) are many parameters' worth.
    assert peak <= _nbytes(moments) + 3 * largest < _nbytes(moments) + _nbytes(params)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_a_checkpoint_of_an_optimizer_that_never_stepped_creates_no_state(
    tmp_path: Path, monkeypatch, name: str, offload: str
) -> None:
    """A warm-up checkpoint (the actor's, while the critic warms up) saves an optimizer that
    never stepped. It was given placeholder state to save, a zero-gradient step per
    parameter, dropped after: the save held 1,443,916 bytes of tensors at its peak for
    this 657,920-byte model (every AdamW moment, 2x the parameters, on the device without
    offload). Now it saves no optimizer state, steps nothing and holds no tensor beyond
    the model's; its load (one tensor read at a time) leaves the optimizer fresh, as in the run that saved (the resume
    is exact: ``test_a_save_before_the_first_update_changes_nothing``)."""
    run = load_config("configs/ppo_tiny.yaml", ["model.dtype=float64", f"actor.optim.name={name}"])
    stepped: list[int] = []
    kind = torch.optim.SGD if name == "sgd" else torch.optim.AdamW
    real_step = kind.step

    def step(optimizer: torch.optim.Optimizer, *args, **kwargs):
        stepped.append(sum(p.grad is not None for g in optimizer.param_groups for p in g["params"]))
        return real_step(optimizer, *args, **kwargs)

    monkeypatch.setattr(kind, "step", step)  # before the engines wrap it
    engine = _engine(offload, run=run)
    assert peak_tensor_bytes(lambda: engine.save(tmp_path)) == 0
    resumed = _engine(offload, run=run)
    params = list(resumed.model.parameters())
    largest = max(_nbytes([p]) for p in params)
    # DCP reads a tensor and copies it in: two of the largest parameter at most
    assert peak_tensor_bytes(lambda: resumed.load(tmp_path)) <= 2 * largest < _nbytes(params)
    assert stepped == [] and not engine.optimizer.state and not resumed.optimizer.state
    assert all(p.grad is None for e in (engine, resumed) for p in e.model.parameters())


def _resume_on_ranks(rank: int, world: int, offload: str, path: str, batch) -> tuple:
    """Four updates straight, and two, a save, a fresh engine's load and two more."""
    local = batch[rank::world]
    straight = _engine(offload, "fsdp", ADAMW_FP32)
    metrics = [straight.train_mini_batch(local.clone(), LOSS) for _ in range(4)]
    saved = _engine(offload, "fsdp", ADAMW_FP32)
    for _ in range(2):
        saved.train_mini_batch(local.clone(), LOSS)
    saved.save(Path(path))
    resumed = _engine(offload, "fsdp", ADAMW_FP32)
    resumed.load(Path(path))
    then = [resumed.train_mini_batch(local.clone(), LOSS) for _ in range(2)]
    devices = {
        v.device.type for s in resumed.optimizer.state.values() for v in s.values() if v.dim()
    }
    return (
        metrics[2:],
        then,
        full_state_dict(straight.model),
        full_state_dict(resumed.model),
        devices,
    )


@pytest.mark.parametrize("offload", ["optimizer", "all"])
def test_fsdp_resume_with_offload_continues_exactly(offload: str, tmp_path: Path) -> None:
    """Two spawned ranks, float32: the updates after a save and a fresh engine's load are
    the uninterrupted run's, bit for bit, and the loaded state waits on the CPU."""
    batch = make_batch(ADAMW_FP32)
    results = run_on_ranks(_resume_on_ranks, world_size=2, args=(offload, str(tmp_path), batch))
    for expected, then, straight, resumed, devices in results:
        assert then == expected
        assert straight.keys() == resumed.keys()
        for name, value in straight.items():
            assert torch.equal(resumed[name], value), name
        assert devices == {"cpu"}


def test_fsdp_cpu_offload_shards_over_one_rank_without_a_process_group() -> None:
    assert not is_initialized()
    model = policy()
    try:
        apply_fsdp(model, offload=True)
        assert is_initialized() and isinstance(model, FSDPModule)
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params)
        batch = make_batch(CONFIG)
        log_probs, _ = response_log_probs(model, batch, temperature=1.0, entropy="none")
        log_probs.sum().backward()
        assert all(p.grad is not None and p.grad.device.type == "cpu" for p in params)
    finally:
        destroy_process_group()


OFFLOAD_MICROS = ["1", "dynamic"]


@pytest.mark.parametrize("offload", ["optimizer", "all"])
def test_offloaded_updates_match_the_reference(offload: str) -> None:
    """Three AdamW steps with clipping (the optimizer state moves between them; with ``all``
    FSDP2 shards over one rank too), against the single-process reference (with ``all``,
    strategy none: no offload)."""
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            "model.dtype=float64",
            "actor.optim.grad_clip=0.25",
            "critic.optim.grad_clip=0.25",
            f"actor.offload={offload}",
            f"critic.offload={offload}",
            "actor.strategy=fsdp",
            "critic.strategy=fsdp",
        ],
    )
    reports = check_invariance(
        cfg,
        dps=[1, 2],
        strategies=["fsdp"],
        micros=OFFLOAD_MICROS,
        optimizer="configured",
        steps=3,
    )
    assert len(reports) == 2 * 2 * len(OFFLOAD_MICROS)
    failures = [r for r in reports if r.worst() > TOLERANCE]
    assert not failures, failures


WIDE = [  # layers of 2 MB of bf16 weights, to see them in the peak
    "model.precision=bf16-mixed",
    "model.hidden_size=256",
    "model.intermediate_size=1024",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "actor.strategy=fsdp",
]


def _log_probs_pass(layers: int, world: int = 1) -> tuple[int, torch.Tensor]:
    """A log-prob pass of the whole batch in bf16-mixed (FSDP2 over ``world`` ranks, a
    whole model at one): its peak of live tensor bytes, and its log-probs."""
    cfg = load_config("configs/ppo_tiny.yaml", [*WIDE, f"model.num_layers={layers}"])
    model = build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0)
    engine = TrainEngine(
        model, cfg=cfg.actor, total_updates=1, metric_prefix="actor", precision=cfg.precision
    )
    assert engine.model is model and (world > 1) == isinstance(model, FSDPModule)
    batch = make_batch(cfg)

    def fn(m: nn.Module, td: TensorDict) -> dict[str, torch.Tensor]:
        return {"lp": response_log_probs(m, td, temperature=1.0, entropy="none")[0]}

    engine.infer(batch, fn)  # FSDP2's lazy set-up, outside the measure
    return peak_tensor_bytes(lambda: engine.infer(batch, fn)), engine.infer(batch, fn)["lp"]


def _sharded_pass(rank: int, world: int, layers: int) -> tuple[int, torch.Tensor]:
    return _log_probs_pass(layers, world)


def test_a_sharded_log_prob_pass_in_bf16_mixed_holds_one_layers_casts_not_the_models() -> None:
    """FSDP2 gathers one layer at a time; autocast's cache kept the bf16 cast of each one it
    gathered until the pass ended, a bf16 copy of the whole model on every rank: 4 more
    layers added their 8 MB of casts to the peak. The log-probs are the single process's
    bit for bit."""
    layer_bytes = 2 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024)
    peaks = {}
    for layers in (4, 8):
        results = run_on_ranks(_sharded_pass, world_size=2, args=(layers,))
        _, whole = _log_probs_pass(layers)
        for _, log_probs in results:
            assert torch.equal(log_probs, whole)
        peaks[layers] = max(peak for peak, _ in results)
    assert peaks[8] - peaks[4] < layer_bytes


# ---------------------------------------------------------------------------- reference


def test_on_device_moves_for_the_block_and_back_after_errors_too() -> None:
    module = nn.Linear(2, 2)
    with actor_module.on_device(module, torch.device("cpu"), home=torch.device("meta")):
        assert module.weight.device.type == "cpu"
        module(torch.ones(1, 2))
    assert module.weight.is_meta
    module = nn.Linear(2, 2)
    with (
        pytest.raises(RuntimeError, match="in the pass"),
        actor_module.on_device(module, torch.device("cpu"), home=torch.device("meta")),
    ):
        raise RuntimeError("in the pass")
    assert module.weight.is_meta


def test_the_reference_waits_on_the_cpu_when_the_actor_offloads() -> None:
    gpu = torch.device("cuda", 0)
    assert actor_module.reference_home("none", gpu) == gpu
    for offload in ("optimizer", "all"):
        assert actor_module.reference_home(offload, gpu) == torch.device("cpu")


@pytest.mark.parametrize("offload", ["none", "optimizer"])
def test_the_reference_moves_for_its_pass_only(offload: str, tmp_path: Path, monkeypatch) -> None:
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [f"actor.offload={offload}", "actor.use_kl_loss=true", f"trainer.output_dir={tmp_path}"],
    )
    worker, tokenizer, train_set = _actor(cfg)
    home = worker._reference_home
    assert home == (torch.device("cpu") if offload == "optimizer" else worker.engine.device)
    assert {p.device for p in worker.reference.parameters()} == {home}
    moves: list[tuple[torch.device, torch.device]] = []
    real = actor_module.on_device

    def record(module: nn.Module, device: torch.device, *, home: torch.device):
        assert module is worker.reference
        moves.append((device, home))
        return real(module, device, home=home)

    monkeypatch.setattr(actor_module, "on_device", record)
    prompts = _sampled_prompts(cfg, tokenizer, train_set)
    batch = worker.generate(prompts, SamplingParams(max_new_tokens=4), 7)
    out = worker.compute_log_probs(batch, True)
    assert moves == [(worker.engine.device, home)]
    assert {p.device for p in worker.reference.parameters()} == {home}
    # the reference is the initial policy: its log-probs are the policy's before any update
    assert torch.equal(out["ref_log_prob"], out["old_log_probs"])


def test_the_start_up_probes_build_the_builtin_model_with_its_own_vocabulary() -> None:
    """model.vocab_size=32 holds the copy task's tokenizer; the probes built the model for a
    stand-in tokenizer of 64 tokens and refused it as 'below the tokenizer's 64 tokens'."""
    from verlite.models.packing_cost import flop_crossover
    from verlite.models.support import check_packing_supported

    small = load_config("configs/ppo_tiny.yaml", ["model.vocab_size=32"]).model
    check_gradient_checkpointing_supported(small, role="actor")
    check_packing_supported(small, role="actor", max_sequence_length=12, fields="12")
    assert flop_crossover(small) == flop_crossover(CONFIG.model)
