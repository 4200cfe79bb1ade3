"""model.precision: the config, master weights that take small updates, the models that are
never trained stored in bf16 without changing a result, and the weight sync's casts."""

import copy
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

from tests.model_support import tiny_mla, tiny_moe, tiny_qwen2, tiny_sliding
from verlite.audit.invariance import make_batch
from verlite.cli import main
from verlite.config import Config, ConfigError, load_config
from verlite.config.derived import bf16_lost_update, precision_line, precision_warning
from verlite.driver import preflight
from verlite.driver import run as run_module
from verlite.errors import UserError
from verlite.generation import make_bucket, sync_layout
from verlite.generation.weights import WeightReceiver
from verlite.models import ValueModel, build_policy, build_value_model, worker_device
from verlite.models.logits_chunk import set_logits_chunk_tokens
from verlite.models.precision import (
    autocast,
    cast_weights,
    check_precision_supported,
    float32_norms,
    fp64_throughout,
    generation_dtypes,
    inference_dtypes,
    store_for_generation,
    store_for_inference,
    stored_copy,
)
from verlite.models.support import float32_norms_line
from verlite.workers.forward import response_log_probs
from verlite.workers.objectives import ActorLossSettings, ppo_loss
from verlite.workers.train_engine import TrainEngine

CONFIG = "configs/ppo_tiny.yaml"
CPU = torch.device("cpu")


def config(*overrides: str):
    return load_config(CONFIG, list(overrides))


# ------------------------------------------------------------------------------ config


def test_auto_is_bf16_mixed_on_a_gpu_and_fp32_on_cpu() -> None:
    assert config().precision == "fp32"
    assert config("model.device=cuda", "trainer.gpus_per_worker=1").precision == "bf16-mixed"
    assert config("model.device=auto", "trainer.gpus_per_worker=1").precision == "bf16-mixed"
    assert config("model.device=cpu", "trainer.gpus_per_worker=1").precision == "fp32"
    assert config("model.precision=bf16", "model.device=cuda").precision == "bf16"


@pytest.mark.parametrize(
    ("dtype", "precision"), [("float32", "fp32"), ("float64", "fp64"), ("bfloat16", "bf16")]
)
def test_the_deprecated_dtype_still_sets_the_precision(dtype: str, precision: str) -> None:
    cfg = config(f"model.dtype={dtype}")
    assert (cfg.model.precision, cfg.model.dtype) == (precision, None)
    assert config(f"model.dtype={dtype}", f"model.precision={precision}").precision == precision


def test_a_dtype_that_contradicts_the_precision_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        config("model.dtype=float64", "model.precision=bf16-mixed")
    message = str(info.value)
    assert "model.dtype=float64" in message and "model.precision=bf16-mixed" in message
    assert "\n" not in message


def test_pure_bf16_warns_of_a_learning_rate_its_updates_lose() -> None:
    lost = bf16_lost_update(0.02)
    assert lost == 2.0**-14  # 0.02 lies in [2^-6, 2^-5): spacing 2^-13, half of it 2^-14
    assert torch.tensor(0.02, dtype=torch.bfloat16) + lost * 0.99 == torch.tensor(
        0.02, dtype=torch.bfloat16
    )
    line = precision_warning(config("model.precision=bf16", "actor.optim.lr=1e-6"))
    assert line is not None and line.startswith(
        "warning: model.precision=bf16: actor.optim.lr=1e-06"
    )
    assert "model.precision=bf16-mixed" in line
    assert "critic.optim.lr" not in line  # the critic's 1e-3 moves such weights
    assert "is at most" in line and "its updates round away" in line
    both = precision_warning(
        config("model.precision=bf16", "actor.optim.lr=1e-6", "critic.optim.lr=1e-6")
    )
    assert both is not None and "actor.optim.lr=1e-06, critic.optim.lr=1e-06 are at most" in both
    assert "their updates round away" in both
    assert "\n" not in line
    assert precision_warning(config("model.precision=bf16", "actor.optim.lr=1e-3")) is None
    assert precision_warning(config("model.precision=bf16-mixed", "actor.optim.lr=1e-6")) is None
    assert "warning" not in precision_line(config("model.precision=bf16", "actor.optim.lr=1e-6"))


@pytest.mark.parametrize("setting", ["model.precision=bf16", "model.dtype=bfloat16"])
def test_pure_bf16_at_a_learning_rate_it_loses_is_warned_before_ray_starts(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    setting: str,
) -> None:
    """The warning comes before Ray starts and any worker loads weights (it was printed with
    the precision line once the workers were placed: minutes into a large model's run)."""

    def no_ray(*args: object) -> None:
        raise UserError("Ray would start here")

    # Its own Ray session, or one an earlier test of this process left open.
    monkeypatch.setattr(run_module, "ray_session", no_ray)
    monkeypatch.setattr(run_module, "run", no_ray)
    overrides = [setting, "actor.optim.lr=1e-6", f"trainer.output_dir={tmp_path / 'run'}"]
    assert main(["train", "--config", CONFIG, *overrides]) == 2
    out, err = capsys.readouterr()
    assert err == "verlite: error: Ray would start here\n"
    assert out.count("warning: model.precision=bf16: actor.optim.lr=1e-06 is at most half") == 1


# ------------------------------------------------------------------------ master weights


def _changed_share(precision: str, lr: float) -> float:
    """The share of the policy's weights one AdamW step of ``lr`` changes."""
    cfg = config(
        f"model.precision={precision}", f"actor.optim.lr={lr}", "actor.optim.warmup_steps=0"
    )
    model = build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0)
    engine = TrainEngine(
        model, cfg=cfg.actor, total_updates=1, metric_prefix="actor", precision=cfg.precision
    )
    before = [p.detach().clone() for p in engine.model.parameters()]
    batch = make_batch(cfg)
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg.actor))
    metrics = engine.train_mini_batch(batch, loss_fn)
    assert metrics["actor/skipped_updates"].value == 0.0
    changed = sum(
        int((p != b).sum()) for p, b in zip(engine.model.parameters(), before, strict=True)
    )
    return changed / sum(b.numel() for b in before)


def test_an_adamw_step_at_lr_1e_6_moves_bf16_mixed_master_weights_but_not_pure_bf16() -> None:
    mixed = _changed_share("bf16-mixed", 1e-6)
    pure = _changed_share("bf16", 1e-6)
    assert mixed > 0.9, mixed  # every weight with a gradient (fp32 masters take 1e-6)
    # The step rounds away but for the weights below 2^9 x 1e-6 = 5e-4 in magnitude: 2% of
    # weights drawn with standard deviation 0.02.
    assert pure < 0.03, pure


def test_bf16_mixed_keeps_fp32_parameters_gradients_and_optimizer_state() -> None:
    cfg = config("model.precision=bf16-mixed")
    model = build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0)
    engine = TrainEngine(
        model, cfg=cfg.actor, total_updates=1, metric_prefix="actor", precision=cfg.precision
    )
    loss_fn = partial(ppo_loss, settings=ActorLossSettings.from_config(cfg.actor))
    seen = []

    def recording(model, td):
        logits = model(input_ids=td["input_ids"]).logits
        log_probs, _ = response_log_probs(model, td, temperature=1.0, entropy="none")
        loss, metrics = loss_fn(model, td)
        seen.append((logits.dtype, log_probs.dtype, loss.dtype))
        return loss, metrics

    engine.train_mini_batch(make_batch(cfg), recording)
    # The products run in bf16; what verlite computes from the logits does not.
    assert set(seen) == {(torch.bfloat16, torch.float32, torch.float32)}
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in engine.model.parameters()} == {torch.float32}
    states = list(engine.optimizer.state.values())
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)


def test_values_are_fp32_under_bf16_autocast() -> None:
    cfg = config("model.precision=bf16-mixed")
    critic = build_value_model(cfg.model, vocab_size=64, max_positions=64, seed=0)
    assert isinstance(critic, ValueModel)
    ids = torch.randint(1, 64, (2, 7))
    positions = torch.arange(7).expand(2, -1)
    with autocast(cfg.precision, CPU):
        values = critic(input_ids=ids, position_ids=positions)
    assert values.dtype == torch.float32


# --------------------------------------------------------- models that are never trained


def _tied_qwen2() -> torch.nn.Module:
    model = tiny_qwen2(tied=True, vocab_size=64)
    set_logits_chunk_tokens(model, 1024)
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_a_copy_stored_for_inference_computes_bit_for_bit_what_the_policy_does(
    tied: bool,
) -> None:
    cfg = config("model.precision=bf16-mixed")
    policy = (
        _tied_qwen2() if tied else build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0)
    )
    reference = store_for_inference(copy.deepcopy(policy), "bf16-mixed").requires_grad_(False)
    dtypes = {name: p.dtype for name, p in reference.named_parameters()}
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.norm.weight"] == torch.float32
    # A tied LM head is the embedding: it stays fp32 with it.
    assert ("lm_head.weight" not in dtypes) if tied else dtypes["lm_head.weight"] == torch.bfloat16
    batch = make_batch(cfg)
    with torch.no_grad(), autocast("bf16-mixed", CPU):
        ours, _ = response_log_probs(policy, batch, temperature=1.0, entropy="none")
        theirs, _ = response_log_probs(reference, batch, temperature=1.0, entropy="none")
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("tied", [False, True])
def test_a_copy_stored_for_generation_holds_a_bf16_head_of_its_own(tied: bool) -> None:
    """A model that only samples (a rollout worker's) holds its LM head in bf16 also where
    the policy ties it to the fp32 embedding: the bf16 cast autocast makes of the tied weight
    at every forward, so the copy computes what the policy does bit for bit; its dtypes are
    the ones ``generation_dtypes`` names for the policy's state (what a sync sends)."""
    cfg = config("model.precision=bf16-mixed")
    policy = (
        _tied_qwen2() if tied else build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0)
    )
    generating = store_for_generation(copy.deepcopy(policy), "bf16-mixed")
    head, embedding = generating.lm_head.weight, generating.model.embed_tokens.weight
    assert head is not embedding and not generating.config.tie_word_embeddings
    assert (head.dtype, embedding.dtype) == (torch.bfloat16, torch.float32)
    assert torch.equal(head, policy.lm_head.weight.to(torch.bfloat16))
    held = {name: value.dtype for name, value in generating.state_dict().items()}
    assert held == generation_dtypes(policy, "bf16-mixed")
    assert held.keys() == policy.state_dict().keys()
    batch = make_batch(cfg)
    with torch.no_grad(), autocast("bf16-mixed", CPU):
        ours, _ = response_log_probs(policy, batch, temperature=1.0, entropy="none")
        theirs, _ = response_log_probs(generating, batch, temperature=1.0, entropy="none")
    assert torch.equal(ours, theirs)
    # In other precisions nothing is cast: a tied head stays tied.
    kept = store_for_generation(copy.deepcopy(policy), "fp32")
    assert (kept.lm_head.weight is kept.model.embed_tokens.weight) is tied


def test_other_precisions_store_every_model_as_it_is() -> None:
    policy = build_policy(config().model, vocab_size=64, max_positions=64, seed=0)
    for precision in ("fp32", "fp64", "bf16"):
        stored = store_for_inference(copy.deepcopy(policy), precision)
        pairs = zip(stored.parameters(), policy.parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)


class _Allocations(TorchDispatchMode):
    """The storages the operators run under it create: the dtype and shape of the last
    tensor each storage backed when an operator returned it (a deep-copied buffer's storage
    is cloned as bytes, then set into a tensor of its dtype), each storage kept alive so that
    no later one reuses its address."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._kept: list[torch.UntypedStorage] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storage = tensor.untyped_storage()
                self.made[storage.data_ptr()] = (tensor.dtype, tuple(tensor.shape))
                self._kept.append(storage)
        return out


def _storages(model: nn.Module) -> dict[int, torch.Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    return {tensor.untyped_storage().data_ptr(): tensor for tensor in tensors}


def _structure(model: nn.Module) -> dict[str, object]:
    """What a stored copy is made of besides its values: its modules, each state entry's
    dtype and shape, each parameter's requires_grad, which names share one tensor (a tied
    head), and whether its config ties the head."""
    params = list(model.named_parameters(remove_duplicate=False))
    first = {}
    for name, param in params:
        first.setdefault(id(param), name)
    return {
        "modules": [(name, type(module).__name__) for name, module in model.named_modules()],
        "state": [(n, v.dtype, tuple(v.shape)) for n, v in model.state_dict().items()],
        "requires_grad": [(name, param.requires_grad) for name, param in params],
        "tied": [(name, first[id(param)]) for name, param in params],
        "tie_word_embeddings": model.config.tie_word_embeddings,
    }


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32"])
@pytest.mark.parametrize("generation", [False, True])
@pytest.mark.parametrize("kind", ["untied", "tied", "lora"])
def test_a_stored_copy_is_cast_as_it_is_copied_into_the_copy_a_deep_copy_cast_after_makes(
    precision: str, generation: bool, kind: str
) -> None:
    """``stored_copy`` (an actor's reference; with ``generation``, its generation copy)
    allocates the tensors the copy holds and nothing else of their shapes: no full-precision
    duplicate of a parameter stored in bf16 (a deep copy cast afterwards held the whole
    fp32 model a second time first). The copy is what that made, bit for bit and in
    structure (modules, dtypes, requires_grad, a LoRA policy's frozen base and trained
    adapters, a tied head kept tied or made its own), and the policy is left as it was."""
    cfg = config(f"model.precision={precision}", *(["actor.lora.rank=4"] * (kind == "lora")))
    if kind == "tied":
        policy = _tied_qwen2()
    else:
        policy = build_policy(
            cfg.model, vocab_size=64, max_positions=64, seed=0, lora=cfg.actor.lora
        )
    store = store_for_generation if generation else store_for_inference
    before = {name: (param, param.dtype) for name, param in policy.named_parameters()}
    with _Allocations() as allocations:
        ours = stored_copy(policy, precision, generation=generation)
    theirs = store(copy.deepcopy(policy), precision)
    assert _structure(ours) == _structure(theirs)
    trained = {param.requires_grad for param in ours.parameters()}
    assert trained == ({False, True} if kind == "lora" else {True})  # a LoRA base is frozen
    held = theirs.state_dict()
    for name, value in ours.state_dict().items():
        assert torch.equal(value, held[name]), name
    assert {n: (p, p.dtype) for n, p in policy.named_parameters()} == before
    # Every new tensor of a parameter's shape is one the copy holds.
    shapes = {tuple(param.shape) for param in policy.parameters()}
    source = _storages(policy)
    made = Counter(
        made
        for where, made in allocations.made.items()
        if where not in source and made[1] in shapes
    )
    kept = Counter(
        (tensor.dtype, tuple(tensor.shape))
        for tensor in _storages(ours).values()
        if tuple(tensor.shape) in shapes
    )
    assert made == kept
    if precision == "bf16-mixed":
        assert torch.bfloat16 in {dtype for dtype, _ in kept}


def test_a_bf16_mixed_weight_sync_sends_what_the_rollout_model_holds() -> None:
    """The actor casts once to the rollout model's dtypes; what lands passes the check, and
    the rollout model then computes what the actor's policy does."""
    cfg = config("model.precision=bf16-mixed")
    actor = build_policy(cfg.model, vocab_size=64, max_positions=64, seed=0)
    rollout = store_for_inference(
        build_policy(cfg.model, vocab_size=64, max_positions=64, seed=1), "bf16-mixed"
    )
    dtypes = inference_dtypes(actor, "bf16-mixed")
    state = actor.state_dict()
    layout = sync_layout(state, 2**12, dtypes)
    assert any(spec.dtype == "bfloat16" for bucket in layout.buckets for spec in bucket)
    assert layout.nbytes < sum(t.nbytes for t in state.values())  # half for the linears
    receiver = WeightReceiver(rollout, who="rollout rank 0")
    staging = torch.empty(layout.staging_bytes, dtype=torch.uint8)
    for index, specs in enumerate(layout.buckets):
        tensors = [state[spec.name].to(dtypes[spec.name]) for spec in specs]
        bucket = make_bucket(1, index, layout, tensors, staging=staging, started=0.0)
        receiver.load(copy.deepcopy(bucket))
    receiver.require(1)
    batch = make_batch(cfg)
    with torch.no_grad(), autocast("bf16-mixed", CPU):
        ours, _ = response_log_probs(actor, batch, temperature=1.0, entropy="none")
        theirs, _ = response_log_probs(rollout, batch, temperature=1.0, entropy="none")
    assert torch.equal(ours, theirs)


def test_bf16_on_a_gpu_without_it_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A V100 holds bf16 tensors (emulated): only native bf16 arithmetic counts.
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla V100-SXM2-32GB")
    for precision in ("bf16-mixed", "bf16"):
        cfg = config(f"model.precision={precision}")
        with pytest.raises(ConfigError, match=f"model.precision={precision}: .*V100.*fp32"):
            check_precision_supported(cfg, on_gpu=True)
        check_precision_supported(cfg, on_gpu=False)  # the workers run on CPU
    check_precision_supported(config("model.precision=fp32"), on_gpu=True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    check_precision_supported(config("model.precision=bf16-mixed"), on_gpu=True)


def test_the_default_precision_on_a_gpu_without_bf16_is_refused_naming_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``model.precision=auto`` (the default) is bf16-mixed on cuda: the line names the
    setting the user has (auto) and what it became, not a bf16-mixed they never wrote."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla T4")
    monkeypatch.setattr(preflight, "check_fits_machine", lambda cfg, cpus=None: None)
    cfg = config("model.device=cuda")
    assert cfg.model.precision == "auto" and cfg.precision == "bf16-mixed"
    with pytest.raises(ConfigError) as info:
        preflight.check_placement(cfg, in_session=False)
    assert str(info.value) == (
        "model.precision=auto (which is bf16-mixed on cuda): the workers' GPU (Tesla T4) has "
        "no bf16 arithmetic; set model.precision=fp32"
    )
    explicit = config("model.device=cuda", "model.precision=bf16-mixed")
    with pytest.raises(ConfigError, match=r"^model.precision=bf16-mixed: the workers"):
        preflight.check_placement(explicit, in_session=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    preflight.check_placement(cfg, in_session=False)


def test_a_worker_on_a_gpu_without_bf16_refuses_before_it_builds_a_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a cluster the driver does not know the workers' GPUs: each worker checks its own
    as it picks its device, the first thing its ``init_model`` does (before that, such a
    worker went on in a bf16 its GPU only emulates)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla T4")
    cluster = ("trainer.ray_address=10.0.0.1:6379", "trainer.gpus_per_worker=1")
    with pytest.raises(ConfigError) as info:
        worker_device(config(*cluster))
    assert str(info.value) == (
        "model.precision=auto (which is bf16-mixed on cuda): the workers' GPU (Tesla T4) has "
        "no bf16 arithmetic; set model.precision=fp32"
    )
    assert worker_device(config(*cluster, "model.precision=fp32")) == torch.device("cuda", 0)
    assert worker_device(config(*cluster, "model.device=cpu")) == CPU  # auto: fp32 on CPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert worker_device(config(*cluster)) == torch.device("cuda", 0)


def test_a_kept_head_stays_fp32_in_a_copy_stored_for_inference() -> None:
    """A reward model's score head is kept: its output is the score, read as a number."""
    model = tiny_qwen2(tied=False)
    stored = store_for_inference(model, "bf16-mixed", keep=[model.lm_head])
    dtypes = {name: p.dtype for name, p in stored.named_parameters()}
    assert dtypes["lm_head.weight"] == torch.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16


# ------------------------------------------------------------------------- fp64 norms


def _norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.mark.parametrize("source", ["built-in", "model.path"])
@pytest.mark.parametrize("role", ["policy", "critic"])
def test_fp64_models_normalize_in_fp64(role: str, source: str, tmp_path: Path) -> None:
    """Hugging Face's RMSNorm casts to float32: fp64 activations and gradients came out of it
    rounded to float32 (models.precision.fp64_throughout). Also in training and again in
    eval mode, as the engine switches them: a model loaded from ``model.path`` came with
    transformers' hub kernels on, whose ``train()``/``eval()`` re-kernelized its norms on
    every switch and dropped their fp64 forward, so its training passes normalized in
    float32 (the log-probs of an fp64 run's first update were 6e-8 off its old log-probs)."""
    overrides = ["model.precision=fp64"]
    if source == "model.path":
        tiny_qwen2(tied=False, vocab_size=64).save_pretrained(tmp_path)
        overrides.append(f"model.path={tmp_path}")
    cfg = config(*overrides).model
    build = build_policy if role == "policy" else build_value_model
    model = build(cfg, vocab_size=64, max_positions=32, seed=0)
    model.train()
    model.eval()
    reference = copy.deepcopy(model)
    norms = _norms(model)
    assert norms
    hidden = torch.randn(3, norms[0].weight.shape[0], dtype=torch.float64, requires_grad=True)
    for norm in [*norms, *_norms(reference)]:
        out = norm(hidden)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        exact = norm.weight * hidden * torch.rsqrt(variance + norm.variance_epsilon)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, exact, rtol=1e-15, atol=0)
        # The copy's norms compute with the copy's own weights.
        assert norm.forward.__self__ is norm


def _gemma_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # Gemma's RMSNorm: zero-centred weights, 1 + weight scales (its epsilon is `eps`).
    return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)


def test_an_fp64_gemma3_normalizes_in_fp64(tmp_path) -> None:
    """Gemma3RMSNorm has `eps`, not `variance_epsilon`, and scales by 1 + weight: it stayed
    float32 under model.precision=fp64 (its outputs float32-rounded: 1e-7 off the fp64
    function), the q/k norms of every layer too."""
    tiny_sliding("gemma3", 16).save_pretrained(tmp_path)
    cfg = config("model.precision=fp64", f"model.path={tmp_path}").model
    model = build_policy(cfg, vocab_size=64, max_positions=32, seed=0)
    norms = [m for m in model.modules() if type(m).__name__ == "Gemma3RMSNorm"]
    assert len(norms) == 2 * 6 + 1  # per layer: 4 around attention and MLP, q and k; the last
    with torch.no_grad():  # trained weights, not the zeros it starts from
        for norm in norms:
            norm.weight.copy_(torch.randn(norm.weight.shape, dtype=torch.float64))
    for norm in norms:
        hidden = torch.randn(3, *norm.weight.shape, dtype=torch.float64)
        torch.testing.assert_close(norm(hidden), _gemma_norm(norm, hidden), rtol=1e-15, atol=0)


def _layer_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    centred = hidden - hidden.mean(-1, keepdim=True)
    scaled = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * scaled


def _unscaled_rms_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


def _llama_norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return norm.weight * _unscaled_rms_norm(norm, hidden)


def _norm_cases() -> list[tuple[torch.nn.Module, object]]:
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return [
        (LlamaRMSNorm(8), _llama_norm),
        (GemmaRMSNorm(8), _gemma_norm),
        (CohereLayerNorm((2, 8)), _layer_norm),  # Cohere's q/k norm: a weight per head
        (Gemma3nRMSNorm(8, with_scale=False), _unscaled_rms_norm),
    ]


@pytest.mark.parametrize("case", range(4), ids=["llama", "gemma", "cohere", "gemma3n-unscaled"])
def test_fp64_norms_of_any_class_normalize_in_fp64(case: int) -> None:
    """Each class's norm, as an fp64 model holds it (with other fp64 weights), computes its
    own function in fp64: told by what it computes, not by an attribute's name."""
    norm, function = _norm_cases()[case]
    model = torch.nn.Sequential(norm, torch.nn.Linear(8, 8)).double()
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(torch.randn(param.shape, dtype=torch.float64))
    fp64_throughout(model)
    shape = (3, *getattr(norm, "weight", torch.empty(8)).shape)
    hidden = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    out = norm(hidden)
    torch.testing.assert_close(out, function(norm, hidden), rtol=1e-15, atol=0)
    (grad,) = torch.autograd.grad(out.sum(), hidden)
    assert not torch.equal(grad, grad.float().double()), "its gradient is fp64 too"


class _OtherNorm(torch.nn.Module):
    """A norm computing none of the known forms (in float32): left as its class computes it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))
        self.eps = 1e-6

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(hidden.float()) * self.weight.float()).type_as(hidden)


def test_a_norm_that_computes_another_function_keeps_its_own_forward() -> None:
    model = fp64_throughout(torch.nn.Sequential(_OtherNorm(), torch.nn.LayerNorm(8)).double())
    assert all("forward" not in vars(m) for m in model)


class _Fp64OtherNorm(_OtherNorm):
    """A norm of no known form that computes in its input's dtype: fp64 in an fp64 model."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(hidden) * self.weight


def test_the_norms_an_fp64_model_keeps_in_float32_are_named() -> None:
    """A norm of a form verlite does not recompute in fp64 and whose forward rounds to
    float32 is named (once per class); one of no known form that computes in fp64, one it
    recomputes (Llama's RMSNorm) and nn.LayerNorm (fp64 already) are not."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    layers = [_OtherNorm(), _OtherNorm(), _Fp64OtherNorm(), LlamaRMSNorm(8), torch.nn.LayerNorm(8)]
    model = fp64_throughout(torch.nn.Sequential(*layers).double())
    assert float32_norms(model) == ["_OtherNorm"]


def test_a_weightless_norm_is_probed_at_the_width_it_normalizes() -> None:
    """A norm without weights is probed at its ``normalized_shape`` (another width makes its
    forward raise, and it went unnamed): OLMo's LayerNorm (no epsilon attribute, no weight)
    rounds to float32 and is named; a weightless nn.LayerNorm (fp64 already) is not."""
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    layers = [OlmoLayerNorm(24), torch.nn.LayerNorm(24, elementwise_affine=False)]
    model = fp64_throughout(torch.nn.Sequential(*layers).double())
    assert float32_norms(model) == ["OlmoLayerNorm"]


class TanhNorm(torch.nn.Module):
    """A custom norm a model class may hold in place of Llama's RMSNorm: float32 inside."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scaled = (
            torch.tanh(hidden.float()) * torch.rsqrt(hidden.float().pow(2).mean(-1) + 1)[..., None]
        )
        return self.weight * scaled.to(hidden.dtype)


def test_an_fp64_run_names_the_norms_it_keeps_in_float32_at_start_up(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    """model.precision=fp64 promises fp64 compute; a norm of no form verlite recomputes
    stayed float32 without a word. The start-up line names its class; Llama's RMSNorm, which
    verlite recomputes in fp64, gives no line, nor does another precision."""
    from transformers.models.llama import modeling_llama

    assert float32_norms_line(config("model.precision=fp64")) is None
    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", TanhNorm)
    line = float32_norms_line(config("model.precision=fp64"))
    assert line is not None
    assert line.startswith("model.precision=fp64: TanhNorm (policy and critic) normalize in ")
    assert "\n" not in line and "float32" in line
    assert float32_norms_line(config()) is None
    run = config("model.precision=fp64", f"trainer.output_dir={tmp_path}")
    preflight.RunInputs.load(run).folder.release()  # the run prints it before Ray starts
    assert line in capsys.readouterr().out.splitlines()
    # what the line says: the fp64 policy's TanhNorm keeps its own forward, in float32
    cfg = config("model.precision=fp64").model
    policy = build_policy(cfg, vocab_size=64, max_positions=32, seed=0)
    norm = next(m for m in policy.modules() if isinstance(m, TanhNorm))
    assert "forward" not in vars(norm)
    out = norm(torch.randn(3, norm.weight.shape[0], dtype=torch.float64))
    assert out.dtype == torch.float64 and torch.equal(out, out.float().double())


class RewardTanhNorm(TanhNorm):
    """The custom norm of a reward model's class."""


def test_an_fp64_run_names_the_reward_models_norms_it_keeps_in_float32(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The reward model computes in fp64 too (model.precision): its norms of no known form
    are named apart from the policy's (here a stock Llama: none)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    from transformers.models.qwen2 import modeling_qwen2

    settings = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
    small = Qwen2Config(
        vocab_size=64, num_hidden_layers=1, num_key_value_heads=1, num_labels=1, **settings
    )
    Qwen2ForSequenceClassification(small).save_pretrained(tmp_path)
    fp64 = config("model.precision=fp64", f"reward.model.path={tmp_path}")
    assert float32_norms_line(fp64) is None
    monkeypatch.setattr(modeling_qwen2, "Qwen2RMSNorm", RewardTanhNorm)
    line = float32_norms_line(fp64)
    assert line is not None
    assert line.startswith("model.precision=fp64: RewardTanhNorm (reward model) normalize in ")


def test_other_precisions_keep_hugging_faces_norms() -> None:
    model = build_policy(config().model, vocab_size=64, max_positions=32, seed=0)
    assert all("forward" not in vars(norm) for norm in _norms(model))
    # an fp64 model cast later (to bf16) computes its norms as Hugging Face does again
    fp64 = build_policy(
        config("model.precision=fp64").model, vocab_size=64, max_positions=32, seed=0
    )
    norm = _norms(fp64.to(torch.bfloat16))[0]
    hidden = torch.randn(3, norm.weight.shape[0], dtype=torch.bfloat16)
    assert torch.equal(norm(hidden), type(norm).forward(norm, hidden))


def check_fits_to_the_byte(monkeypatch: pytest.MonkeyPatch, cfg: Config, needed: int) -> None:
    """The start-up check of a GPU's memory (``check_generation_fits``, a tokenizer of 64)
    passes on a GPU of ``needed`` bytes and refuses one of a byte less."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    for total, fits in ((needed, True), (needed - 1, False)):
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda d=None, t=total: SimpleNamespace(total_memory=t),
        )
        if fits:
            preflight.check_generation_fits(cfg, 64)
        else:
            with pytest.raises(ConfigError, match="generation cannot fit Fake GPU"):
                preflight.check_generation_fits(cfg, 64)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_the_generation_memory_check_counts_the_head_a_rollout_model_holds(
    tmp_path, monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    """A split rollout worker of a tied Qwen2 holds, under bf16-mixed, its fp32 embedding
    and a bf16 head of its own (``store_for_generation``): the start-up check of a GPU's
    memory counts both, to the byte (in fp32 the tied head is the embedding, counted once)."""
    from verlite.generation.static_cache import cache_bytes

    tiny_qwen2(tied=True, vocab_size=64).save_pretrained(tmp_path)
    cfg = config(
        f"model.path={tmp_path}",
        f"model.precision={precision}",
        "model.device=cuda",
        "rollout.placement=split",
    )
    policy = tiny_qwen2(tied=True, vocab_size=64)
    linear = {
        f"{n}.{k}"
        for n, m in policy.named_modules()
        if isinstance(m, torch.nn.Linear)
        for k, _ in m.named_parameters()
    }
    half = precision == "bf16-mixed"
    weights = sum(  # the embedding and norms in fp32; the linear layers (the head's too) bf16
        p.numel() * (2 if half and name in linear else 4)
        for name, p in policy.named_parameters(remove_duplicate=not half)
    )
    dtype = torch.bfloat16 if half else torch.float32
    kv = cache_bytes(policy.config, cfg.rows_per_generating_worker, cfg.cache_positions, dtype)
    check_fits_to_the_byte(monkeypatch, cfg, kv + weights)


def test_the_generation_memory_check_counts_what_latent_attention_caches(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DeepSeek-V3 policy's KV cache is counted at start-up as its layers write it: per
    position of a row, 2 layers x (a one-head latent of width 16 + a one-head rotary key of
    width 4) x 4 bytes in fp32, with its fp32 weights, to the byte. Its config's 4 KV heads x
    head dim 4 in every layer counted 32 wide keys and values, not 20: a generation that fit
    was refused (the real DeepSeek-V3's 28 times over)."""
    tiny_mla(vocab_size=64).save_pretrained(tmp_path)
    cfg = config(
        f"model.path={tmp_path}",
        "model.precision=fp32",
        "model.device=cuda",
        "rollout.placement=split",
    )
    weights = sum(p.numel() * 4 for p in tiny_mla(vocab_size=64).parameters())
    kv = cfg.rows_per_generating_worker * cfg.cache_positions * 2 * (16 + 4) * 4
    check_fits_to_the_byte(monkeypatch, cfg, kv + weights)


@pytest.mark.parametrize(
    ("settings", "held"),
    [
        (["actor.strategy=ddp"], 1.0),  # every rank the whole model
        (["actor.strategy=fsdp"], 1.5),  # a shard over the 2 ranks, and the whole copy
        (["actor.strategy=fsdp", "actor.offload=all"], 1.0),  # on the host; the copy on the GPU
    ],
)
def test_the_generation_memory_check_counts_a_colocated_actors_weights_as_a_rank_holds_them(
    tmp_path, monkeypatch: pytest.MonkeyPatch, settings: list[str], held: float
) -> None:
    """A colocated actor of 2 ranks generates from the model it trains: the check of a GPU's
    memory (made by the driver before an embedded Ray, and by each actor worker) counts the
    trained weights a rank holds, to the byte: the whole model under DDP, a half under FSDP2
    (``fully_shard`` over the 2 ranks), none with FSDP2's CPU offload; and an FSDP2 actor's
    whole copy it generates from (``workers.actor.generation_copy``), on the GPU with the
    offload too. It counted the whole model under each: a run that FSDP shards to fit
    (a 14B policy in fp32 over 8 GPUs of 80 GB with a 30 GB KV cache: 56 + 30 GB counted, 7 +
    30 GB held) was refused, on a cluster too, by every actor worker, since the check moved
    there."""
    from verlite.generation.static_cache import cache_bytes

    tiny_qwen2(tied=True, vocab_size=64).save_pretrained(tmp_path)
    cfg = config(
        f"model.path={tmp_path}",
        "model.precision=fp32",
        "model.device=cuda",
        "rollout.decode=static",
        "trainer.workers_per_node=2",
        "actor.micro_batch_size_per_worker=8",
        "critic.micro_batch_size_per_worker=8",
        *settings,
    )
    policy = tiny_qwen2(tied=True, vocab_size=64)
    weights = sum(p.numel() * 4 for p in policy.parameters())
    kv = cache_bytes(
        policy.config, cfg.rows_per_generating_worker, cfg.cache_positions, torch.float32
    )
    check_fits_to_the_byte(monkeypatch, cfg, kv + int(weights * held))


def test_a_bf16_cast_keeps_what_hugging_face_loads_in_fp32(tmp_path) -> None:
    """A LoRA policy's frozen base cast to bf16 holds what Hugging Face loads in bf16 (the
    base its export is loaded onto): the tensors a model class keeps in float32 whatever the
    dtype (``_keep_in_fp32_modules_strict``: GLM-4-MoE's and DeepSeek-V3's router weights and
    score-correction biases) stay float32, so its logits are the loaded model's bit for bit
    (rounded to bf16 they were 0.002 apart). A model cast here trains all its parameters in
    bf16 (one Hugging Face loaded keeps its router in float32: FSDP2 shards it as a group of
    its own, tests/distributed/test_distributed_parallel.py)."""
    model = tiny_moe("glm4_moe", n_routed_experts=4, first_k_dense_replace=1, head_dim=8)
    with torch.no_grad():  # a router that routes: HF initializes its weight to zeros
        model.model.layers[1].mlp.gate.weight.normal_()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    cast = cast_weights(
        AutoModelForCausalLM.from_pretrained(tmp_path).requires_grad_(False), torch.bfloat16
    )
    gate = cast.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert cast.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert torch.equal(cast(tokens).logits, loaded(tokens).logits)
    trained = cast_weights(AutoModelForCausalLM.from_pretrained(tmp_path), torch.bfloat16)
    assert {param.dtype for param in trained.parameters()} == {torch.bfloat16}
    assert trained.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_a_pure_bf16_critic_keeps_in_fp32_what_the_policy_keeps(tmp_path) -> None:
    """The critic built from model.path holds each trunk parameter in the dtype the policy
    holds it in: under pure bf16 the trained router GLM-4-MoE keeps in float32 (its class's
    ``_keep_in_fp32_modules_strict``, as Hugging Face loads it) stays float32 in both. The
    critic's loaded trunk was cast again, the router rounded to bf16, while the policy's
    stayed float32; the value head, built here, is bf16 as before."""
    model = tiny_moe("glm4_moe", n_routed_experts=4, first_k_dense_replace=1, head_dim=8)
    with torch.no_grad():  # a router that routes: HF initializes its weight to zeros
        model.model.layers[1].mlp.gate.weight.normal_()
    model.save_pretrained(tmp_path)
    cfg = config("model.precision=bf16", f"model.path={tmp_path}").model
    policy = build_policy(cfg, vocab_size=64, max_positions=32, seed=0)
    critic = build_value_model(cfg, vocab_size=64, max_positions=32, seed=0)
    policy_dtypes = {n: p.dtype for n, p in policy.model.named_parameters()}
    critic_dtypes = {n: p.dtype for n, p in critic.trunk.named_parameters()}
    assert critic_dtypes == policy_dtypes
    assert critic_dtypes["layers.1.mlp.gate.weight"] == torch.float32
    assert critic.value_head.weight.dtype == critic.value_head.bias.dtype == torch.bfloat16
    assert torch.equal(
        critic.trunk.layers[1].mlp.gate.weight, policy.model.layers[1].mlp.gate.weight
    )
