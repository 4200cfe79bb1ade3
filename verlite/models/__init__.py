"""Model building: the built-in tiny decoder, local Hugging Face checkpoints, the value model.

The built-in models are Hugging Face classes built from a config (no download), so every
code path that runs here also runs on a real checkpoint loaded from ``model.path``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import transformers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)
from transformers.models.auto.auto_factory import _BaseAutoModelClass
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from verlite.config import Config, ConfigError, LoraConfig, ModelConfig
from verlite.errors import UserError, one_line, shown
from verlite.models.hf import ModuleT, config_of
from verlite.models.logits_chunk import set_logits_chunk_tokens
from verlite.models.lora import apply_lora
from verlite.models.precision import (
    cast_weights,
    check_precision_supported,
    fp64_throughout,
    param_dtype,
)
from verlite.user_files import check_readable

# The Hugging Face auto class a model is built or loaded as (their common base): the policy's
# causal LM, the critic's trunk, the reward model's classifier.
AutoClass = type[_BaseAutoModelClass]


def model_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype of a model's parameters (``verlite.models.precision``); ``auto`` resolves to
    fp32 or bf16-mixed, whose parameters are both fp32."""
    return param_dtype("fp32" if cfg.precision == "auto" else cfg.precision)


def resolve_device(cfg: ModelConfig) -> torch.device:
    """``auto``: the worker's GPU when Ray gave it one (it then sees it as cuda:0), else CPU."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")


def worker_device(cfg: Config) -> torch.device:
    """The device a worker runs its models on (:func:`resolve_device`), once it can do the
    run's precision: a cluster's GPUs are not known before Ray starts, so bf16 on a GPU
    without bf16 arithmetic is refused here, in one line, before the worker builds a model
    (the driver reports it as bad input: ``controller.failures.WorkerInputError``)."""
    device = resolve_device(cfg.model)
    check_precision_supported(cfg, on_gpu=device.type == "cuda")
    return device


def model_config(path: str, *, field: str = "model.path") -> PretrainedConfig:
    """The Hugging Face config of the model folder ``path``, the config field ``field``
    (``model.path``, ``reward.model.path``; local files only). A config.json that does not
    load is one line naming the field and the reason, before Ray: a ``model_type`` this
    transformers does not know, a field of the wrong type or out of range (Hugging Face's
    strict checks); an I/O error reading it is the machine's (``user_files.check_readable``)."""
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(path, local_files_only=True)
        return config
    except OSError as exc:
        check_readable(exc, Path(path) / "config.json", what=f"{field}'s config.json")
        reason = shown(one_line(exc), 160)
    except Exception as exc:  # ValueError, TypeError, huggingface_hub's validation errors
        reason = shown(one_line(exc), 160)
    model_type = _json_field(Path(path) / "config.json", "model_type")
    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        reason = (
            f"model_type={model_type!r} is no model type of the installed transformers "
            f"{transformers.__version__}"
        )
    raise ConfigError(f"{field}={path!r}: no model config loads from it: {reason}")


def _json_field(path: Path, key: str) -> object:
    """``key``'s value in the JSON object of the file ``path``; None where it has none."""
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return fields.get(key) if isinstance(fields, dict) else None


def builtin_vocab_size(cfg: ModelConfig, tokenizer_size: int) -> int:
    """The rows of the built-in model's embedding and LM head for a tokenizer of
    ``tokenizer_size`` tokens: ``model.vocab_size``, or that size when unset; a
    ``model.vocab_size`` below it is refused (:class:`ConfigError`)."""
    if cfg.vocab_size is None:
        return tokenizer_size
    if cfg.vocab_size < tokenizer_size:
        raise ConfigError(
            f"model.vocab_size={cfg.vocab_size} is below the tokenizer's {tokenizer_size} tokens; "
            f"use at least {tokenizer_size}, or leave it unset"
        )
    return cfg.vocab_size


def tiny_hf_config(cfg: ModelConfig, *, vocab_size: int, max_positions: int) -> PretrainedConfig:
    """A Hugging Face config for the built-in decoder described by ``cfg``, for a tokenizer
    of ``vocab_size`` tokens (:func:`builtin_vocab_size`)."""
    config_class: type[LlamaConfig] | type[Qwen2Config] = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
    }[cfg.arch]
    return config_class(
        vocab_size=builtin_vocab_size(cfg, vocab_size),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        # eager attention yields NaN on fully padded query rows. A keyword the config's
        # __init__ passes on to __post_init__, which the __init__ mypy derives from its
        # dataclass fields does not list.
        attn_implementation="sdpa",  # type: ignore[call-arg]
    )


def hf_config(cfg: ModelConfig, vocab_size: int, max_positions: int) -> PretrainedConfig:
    """The Hugging Face config of the policy: ``model.path``'s, or the built-in decoder's for
    a tokenizer of ``vocab_size`` tokens."""
    if cfg.path is not None:
        return model_config(cfg.path)
    return tiny_hf_config(cfg, vocab_size=vocab_size, max_positions=max_positions)


def meta_causal_lm(config: PretrainedConfig, **implementations: str) -> PreTrainedModel:
    """The causal LM of ``config`` built on the meta device (no memory): for what its class
    and shape decide, not its values. ``implementations``: Hugging Face's
    ``attn_implementation`` and ``experts_implementation``, for a probe that runs it. Built
    from a copy: Hugging Face sets them on the config it builds from, and a model built from
    ``config`` (a probe of a running model's own) would then run them too."""
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(
            copy.deepcopy(config), **implementations
        )
    return model


# The built-in model's vocabulary where only its shape matters (models built on the meta device
# to probe what its class supports): model.vocab_size when set, else a stand-in tokenizer size.
_PROBE_VOCAB = 64


def probe_config(cfg: ModelConfig, *, max_positions: int = 64) -> PretrainedConfig:
    """The Hugging Face config of ``cfg``'s model for a probe of its class or shape (what it
    supports, its FLOPs, its windows): ``model.path``'s, or the built-in decoder's with its
    own ``model.vocab_size`` (any size is one the probe's answer does not depend on; a stand-in
    tokenizer size larger than ``model.vocab_size`` would be refused as one it cannot hold)."""
    return hf_config(cfg, vocab_size=cfg.vocab_size or _PROBE_VOCAB, max_positions=max_positions)


def build_policy(
    cfg: ModelConfig,
    *,
    vocab_size: int,
    max_positions: int,
    seed: int,
    lora: LoraConfig | None = None,
) -> nn.Module:
    """The actor (and reference): a causal LM, from ``cfg.path`` or built from the config;
    with adapters (a peft model, ``models.lora``) when ``lora`` has a rank."""
    if cfg.path is None:
        torch.manual_seed(seed)
    model: nn.Module = _base_model(AutoModelForCausalLM, cfg, vocab_size, max_positions)
    if lora is not None and lora.rank > 0:
        model = cast_weights(apply_lora(model, lora, seed=seed), model_dtype(cfg))
    set_logits_chunk_tokens(model, cfg.logits_chunk_tokens)
    return fp64_throughout(model)


class ModelWeightsError(UserError):
    """The weights in ``model.path`` do not fill the model its config.json describes."""


def load_pretrained(
    auto_class: AutoClass, path: str, dtype: torch.dtype, *, field: str = "model.path"
) -> PreTrainedModel:
    """The model in ``path`` (the config's ``field``), every parameter loaded from its
    weights. Hugging Face only warns when a parameter is missing from the files or of another
    shape, and trains it from a random start: a config.json that does not match the weights
    would train a random model; and when the files hold a tensor the model does not take
    (:func:`_unused_by_its_modules`), which it drops: another architecture's weights.

    Without Hugging Face's hub kernels, as a model built from its config is: with them on
    (from_pretrained's default where the ``kernels`` package is installed, which
    transformers installs), every ``train()`` and ``eval()`` switch re-kernelizes the
    model, replacing its norms' forward, which dropped :func:`precision.fp64_throughout`'s
    (an fp64 model's training passes normalized in float32), and on a GPU would compute
    the training passes with other kernels than the log-prob passes."""
    # transformers types from_pretrained's result as the model; with output_loading_info=True
    # it is the model and its loading info.
    model, info = cast(
        tuple[PreTrainedModel, dict[str, Any]],
        auto_class.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation="sdpa",
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, with the names, instead of raised
            use_kernels=False,
        ),
    )
    random = "which training would start from random values"
    problems = []
    if missing := info["missing_keys"]:
        problems.append(
            f"{len(missing)} parameters missing (e.g. {sorted(missing)[0]!r}), {random}"
        )
    if mismatched := info["mismatched_keys"]:
        name, stored, wanted = sorted(mismatched)[0]
        problems.append(
            f"{len(mismatched)} of another shape (e.g. {name!r}: {tuple(stored)} stored, "
            f"{tuple(wanted)} in the config), {random}"
        )
    if unused := _unused_by_its_modules(model, info["unexpected_keys"]):
        problems.append(
            f"{len(unused)} stored that its modules do not take (e.g. {unused[0]!r}), which "
            "loading would drop: weights of another architecture"
        )
    if problems:
        raise ModelWeightsError(
            f"{field}={path!r}: its weights do not fit its config.json: {'; '.join(problems)}"
        )
    model = _without_dropout(model)
    _check_no_dropout(model, path, field=field)
    return model


def _unused_by_its_modules(model: PreTrainedModel, unexpected: Sequence[str]) -> list[str]:
    """The stored tensors among ``unexpected`` (Hugging Face's loading info) that belong to a
    module ``model`` has but which takes no such tensor: a qkv bias of Qwen2's weights under a
    Llama config.json, a model that computes another function. Tensors of modules it lacks
    are left to Hugging Face (a causal LM's head under the critic's trunk, a checkpoint's
    extra prediction layers or vision tower); a name is tried with and without the model's
    base prefix (the trunk's modules are named without it), sorted."""
    modules = {name for name, _ in model.named_modules() if name}
    prefix = f"{model.base_model_prefix}."
    return sorted(
        key
        for key in unexpected
        if (owner := key.rpartition(".")[0]) in modules or owner.removeprefix(prefix) in modules
    )


def _without_dropout(model: ModuleT) -> ModuleT:
    """``model`` (in place) with the dropout its config.json sets turned off; returned: its
    dropout modules, and the rates its modules keep as numbers (``attention_dropout``, OPT's
    ``dropout``). A training forward would draw dropout masks: the log-probs of the update
    would not be those the old log-probs were computed with (eval mode), so an on-policy
    ratio would not be 1, and the gradient would depend on how the batch is split and on the
    random stream. The config keeps its values, so an export writes them unchanged. LoRA's
    own dropout (``actor.lora.dropout``) is applied after, and kept."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_dropout_rate(name, value):
                setattr(module, name, 0.0)
    return model


def _is_dropout_rate(name: str, value: object) -> bool:
    return ("dropout" in name or "pdrop" in name or name == "layerdrop") and (
        isinstance(value, float) and value > 0
    )


def _check_no_dropout(model: PreTrainedModel, path: str, *, field: str) -> None:
    """Refuse, in one line, a model whose config sets a dropout rate it applies some other
    way (read from the config at every forward, as Falcon's ``hidden_dropout``): one short
    training forward must equal the evaluation forward. Run only where the config sets a
    rate, with the random state restored after."""
    rates = {k: v for k, v in model.config.to_dict().items() if _is_dropout_rate(k, v)}
    if not rates:
        return
    ids = torch.arange(1, 9).unsqueeze(0) % model.config.vocab_size
    training = model.training
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        outputs = []
        for train in (False, True):
            model.train(train)
            outputs.append(model(input_ids=ids.to(model.device))[0])
    model.train(training)
    if not torch.equal(*outputs):
        named = ", ".join(f"{k}={v}" for k, v in rates.items())
        raise ModelWeightsError(
            f"{field}={path!r}: its config.json sets {named}, which "
            f"{type(model).__name__} applies in training forwards in a way verlite cannot turn "
            "off (a training forward differs from an evaluation forward): the update would "
            "depend on how the batch is split and on the random stream; set these to 0.0 in "
            "its config.json"
        )


class ValueModel(nn.Module):
    """An LM trunk with a scalar head: one value per position."""

    def __init__(self, trunk: PreTrainedModel, hidden_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.value_head = nn.Linear(hidden_size, 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Values at every position, at the last ``logits_to_keep`` positions, or at the
        positions a 1-D tensor ``logits_to_keep`` lists (as a causal LM's logits); other
        keyword arguments go to the trunk (a packed row's attention structure)."""
        hidden = self.trunk(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).last_hidden_state
        if isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        # A fresh (b, t) tensor rather than a squeezed view: FSDP2 warns that in-place ops
        # on a root module's view output would skip its pre-backward hook. Values are fp32
        # under any precision (autocast would run the product in bf16).
        dtype = torch.promote_types(self.value_head.weight.dtype, torch.float32)
        weight, bias = self.value_head.weight[0].to(dtype), self.value_head.bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.matmul(hidden.to(dtype), weight) + bias


def build_value_model(
    cfg: ModelConfig, *, vocab_size: int, max_positions: int, seed: int
) -> ValueModel:
    """The critic: the policy's trunk (pretrained weights when ``cfg.path`` is set) and a
    fresh head."""
    torch.manual_seed(seed)
    trunk = _base_model(AutoModel, cfg, vocab_size, max_positions)
    hidden_size: int = trunk.config.hidden_size
    model = ValueModel(trunk, hidden_size)
    nn.init.normal_(model.value_head.weight, std=1.0 / hidden_size)
    nn.init.zeros_(model.value_head.bias)
    cast_weights(model.value_head, model_dtype(cfg))
    return fp64_throughout(model)


def _base_model(
    auto_class: AutoClass, cfg: ModelConfig, vocab_size: int, max_positions: int
) -> PreTrainedModel:
    """The model of ``cfg`` (an ``auto_class``: the policy's causal LM, the critic's trunk)
    in its precision's parameter dtype, as every role holds it: loaded from ``cfg.path`` as
    Hugging Face loads it in that dtype (what its class keeps in float32, a MoE router,
    stays float32, trained or not), or built from the config (random weights from the
    current seed) and cast (``precision.cast_weights``)."""
    dtype = model_dtype(cfg)
    if cfg.path is not None:
        return load_pretrained(auto_class, cfg.path, dtype)
    config = hf_config(cfg, vocab_size, max_positions)
    model: PreTrainedModel = auto_class.from_config(config)
    return cast_weights(model, dtype)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Activation checkpointing on ``model``'s decoder layers (Hugging Face's, non-reentrant):
    a policy, a peft policy (through to its base model) or a value model's trunk. Layers
    recompute only in a training forward with gradients on: log-prob and value passes (eval
    mode, no grad) run as before."""
    target = model.trunk if isinstance(model, ValueModel) else model
    # A method of every Hugging Face model (a peft model forwards it), not the submodule
    # nn.Module's __getattr__ types it as.
    target.activation_checkpointing_enable(  # type: ignore[operator]
        activation_checkpointing_kwargs={"use_reentrant": False}
    )
    # A training forward keeps no KV cache anyway; Hugging Face would turn it off there with
    # a warning. Generation asks for its cache explicitly (``use_cache=True``).
    config_of(target).use_cache = False
