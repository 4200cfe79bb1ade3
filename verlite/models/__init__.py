"""Model building: the built-in tiny decoder, local Hugging Face checkpoints, the value model.

The built-in models are Hugging Face classes built from a config (no download), so every
code path that runs here also runs on a real checkpoint loaded from ``model.path``.
"""

from __future__ import annotations

import copy
import json
import re
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
    AutoModelForSequenceClassification,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)
from transformers.models.auto.auto_factory import _BaseAutoModelClass
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from verlite.config import Config, ConfigError, LoraConfig, ModelConfig
from verlite.config.checks import longest_sequence_fields
from verlite.errors import UserError, one_line, shown
from verlite.models.flops import DecoderShape, attention_width, sliding_window_layers
from verlite.models.hf import ModuleT, config_of, input_embeddings, output_embeddings
from verlite.models.lora import apply_lora, check_peft_installed, check_targets
from verlite.models.precision import (
    cast_weights,
    check_precision_supported,
    float32_norms,
    fp64_throughout,
    param_dtype,
)
from verlite.models.varlen import PackingUnsupported, enable_packing
from verlite.user_files import check_readable, read_text

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


def check_tokenizer_fits(path: str | None, tokenizer_size: int, *, field: str) -> None:
    """A tokenizer whose ids reach past its model's vocabulary would index past the embedding
    (a bare ``IndexError`` deep in the first rollout or scoring): refused at start-up, in one
    line naming ``field``, the config field of the model folder ``path`` (the policy's, the
    reward model's). None: the built-in model, built for its tokenizer's size."""
    if path is None:
        return
    vocab = getattr(model_config(path, field=field), "vocab_size", None)
    if isinstance(vocab, int) and tokenizer_size > vocab:
        raise ConfigError(
            f"{field}={path!r}: its tokenizer has {tokenizer_size} tokens but the model's "
            f"vocabulary holds {vocab} (config.json vocab_size); use the tokenizer the model was "
            "trained with"
        )


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


# Kept on the LM head module itself (the peft layer when adapters wrap it): a plain attribute,
# so a deep copy (the reference) keeps it and state dicts do not see it.
_CHUNK_ATTR = "verlite_logits_chunk_tokens"


def set_logits_chunk_tokens(model: nn.Module, tokens: int) -> None:
    """Have every log-prob pass over the causal LM ``model`` (``workers.forward``) compute
    its LM head's logits ``tokens`` tokens at a time (``model.logits_chunk_tokens``)."""
    setattr(output_embeddings(model), _CHUNK_ATTR, tokens)


def logits_chunk_tokens(head: nn.Module) -> int:
    """The chunk size :func:`set_logits_chunk_tokens` set on the LM head ``head``."""
    tokens = getattr(head, _CHUNK_ATTR, None)
    if not isinstance(tokens, int):
        raise ValueError(
            "this causal LM has no logits chunk size: build it with verlite.models.build_policy "
            "or call verlite.models.set_logits_chunk_tokens on it"
        )
    return tokens


def mark_generation_ends(model: nn.Module, end_token_ids: Sequence[int], pad_token_id: int) -> None:
    """Have the generation config of ``model`` (a causal LM, or a peft model over one), which
    Hugging Face ``generate`` reads from an export's ``generation_config.json``, end a response
    where verlite's sampler ended it: ``end_token_ids`` (the tokenizer's EOS, then
    ``rollout.stop_token_ids``) added to its ``eos_token_id`` after the ids it has (a model
    folder's own, e.g. an instruct model's end of turn), and ``pad_token_id`` when it has none."""
    config = model.generation_config  # a peft model's attribute is its base model's
    assert isinstance(config, GenerationConfig)  # what every causal LM holds
    present = config.eos_token_id
    ids = [] if present is None else [present] if isinstance(present, int) else list(present)
    ids += [i for i in dict.fromkeys(end_token_ids) if i not in ids]
    config.eos_token_id = ids[0] if len(ids) == 1 else ids
    if config.pad_token_id is None:
        config.pad_token_id = pad_token_id


def generation_end_ids(path: str | None) -> tuple[int, ...]:
    """The tokens that end generation in the model folder ``path`` (none for the built-in
    model): its ``generation_config.json``'s ``eos_token_id``, or ``config.json``'s without
    one, as Hugging Face ``generate`` and vLLM read them. An instruct model names its end of
    turn there when its tokenizer's EOS is another token (Gemma 2's ``<end_of_turn>`` beside
    ``<eos>``, Phi-3's ``<|end|>`` beside ``<|endoftext|>``). A generation_config.json that
    does not load, or an ``eos_token_id`` that is no token id nor a list of them, is one
    line naming the file (checked at start-up, before Ray: ``driver.preflight``)."""
    if path is None:
        return ()
    file = Path(path, "generation_config.json")
    if file.is_file():
        config = _generation_config(path, file)
    else:
        config = GenerationConfig.from_model_config(model_config(path))
        file = Path(path, "config.json")
    ids = config.eos_token_id
    listed = [ids] if isinstance(ids, int) else ids
    if ids is not None and not (
        isinstance(listed, list) and all(type(i) is int and i >= 0 for i in listed)
    ):
        raise ConfigError(
            f"model.path={path!r}: its {file.name} has eos_token_id={ids!r}; expected a token "
            "id (an integer >= 0) or a list of them"
        )
    return () if ids is None else tuple(listed)


def _generation_config(path: str, file: Path) -> GenerationConfig:
    """The generation config in ``file``, model.path's generation_config.json: one line where
    it is no JSON object or Hugging Face does not load it."""
    text = read_text(file, what="model.path's generation_config.json", error=ConfigError)
    named = f"model.path={path!r}: its generation_config.json"
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{named} is not valid JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{named} holds {type(fields).__name__}, not a JSON object")
    try:
        return GenerationConfig.from_dict(fields)
    except Exception as exc:  # its checks raise ValueError or TypeError
        raise ConfigError(f"{named} does not load: {shown(one_line(exc), 160)}") from None


def response_stop_ids(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The tokens besides ``tokenizer``'s EOS that end a response: ``model.path``'s own end
    tokens (:func:`generation_end_ids`; with ``rollout.ignore_eos`` none, as the EOS they
    are), less ``rollout.multi_turn.turn_stop``'s token, which ends a turn only (Gemma-2-it's
    <end_of_turn> handing a turn to the environment), then ``rollout.stop_token_ids``."""
    own = () if cfg.rollout.ignore_eos else generation_end_ids(cfg.model.path)
    turn_stop = cfg.rollout.multi_turn.turn_stop
    turn = [] if turn_stop is None else tokenizer.encode(turn_stop, add_special_tokens=False)
    kept = [i for i in own if i != tokenizer.eos_token_id and [i] != turn]
    return tuple(dict.fromkeys([*kept, *cfg.rollout.stop_token_ids]))


class ModelWeightsError(UserError):
    """The weights in ``model.path`` do not fill the model its config.json describes."""


def _pretrained(
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
    """The critic: the policy's trunk (pretrained weights when ``cfg.path`` is set) + a fresh head."""
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
        return _pretrained(auto_class, cfg.path, dtype)
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


def check_attention_supported(cfg: ModelConfig) -> None:
    """``model.path`` at start-up: its class runs scaled-dot-product attention, which every
    model is loaded with (``_pretrained``; eager attention yields NaN on fully padded query
    rows); refused in one line otherwise (checked on a model built on the meta device: no
    memory), where each worker's load would raise once Ray started. The built-in decoders
    (Llama, Qwen2) do."""
    if cfg.path is None:
        return
    check_sdpa(meta_causal_lm(probe_config(cfg)), field="model.path", path=cfg.path)


def check_sdpa(model: PreTrainedModel, *, field: str, path: str) -> None:
    """``model`` (the one in ``path``, the config's ``field``; built on the meta device)
    runs scaled-dot-product attention, which ``_pretrained`` loads every model with; one
    line otherwise."""
    if not model._supports_sdpa:
        raise ConfigError(
            f"{field}={path!r}: {type(model).__name__} does not support scaled-dot-product "
            "attention (SDPA), which verlite loads every model with; use a model whose class "
            "does (Llama, Qwen2, Mistral, ...)"
        )


def checkpointing_unsupported(cfg: ModelConfig, *, role: str) -> str | None:
    """The class name of ``role``'s model of ``cfg`` (the actor's causal LM, the critic's
    trunk) when it does not support activation checkpointing; None when it does. Checked on
    a model built on the meta device: no memory."""
    auto_class: AutoClass = AutoModelForCausalLM if role == "actor" else AutoModel
    with torch.device("meta"):
        model = auto_class.from_config(probe_config(cfg))
    return None if model.supports_gradient_checkpointing else type(model).__name__


def check_gradient_checkpointing_supported(cfg: ModelConfig, *, role: str) -> None:
    """``<role>.gradient_checkpointing=true`` at start-up: the model class of ``cfg`` must
    support it; refused in one line otherwise."""
    unsupported = checkpointing_unsupported(cfg, role=role)
    if unsupported is not None:
        raise ConfigError(
            f"{role}.gradient_checkpointing=true: {unsupported} does not support "
            f"activation checkpointing; set {role}.gradient_checkpointing=false"
        )


def check_training_features(cfg: Config) -> None:
    """``<role>.packing`` and ``<role>.gradient_checkpointing`` where set, the actor's and
    the critic's: the model of ``cfg`` supports them (:func:`check_packing_supported` on the
    run's longest sequence, :func:`check_gradient_checkpointing_supported`); refused at
    start-up in one line naming the setting, where each worker's first build or packed pass
    would stop it."""
    for role in ("actor", "critic"):
        section = getattr(cfg, role)
        if section.packing:
            check_packing_supported(
                cfg.model,
                role=role,
                max_sequence_length=cfg.max_sequence_length,
                fields=longest_sequence_fields(cfg),
            )
        if section.gradient_checkpointing:
            check_gradient_checkpointing_supported(cfg.model, role=role)


def float32_norms_line(cfg: Config) -> str | None:
    """``model.precision=fp64`` at start-up: the line that names the normalization layers that
    keep float32 in the run's fp64 models (``precision.float32_norms``: of a form
    :func:`fp64_throughout` does not recompute in fp64, whose own forward rounds to float32),
    the policy's (its critic's trunk holds the same) and the reward model's; None when there
    are none, or under another precision."""
    if cfg.model.precision != "fp64":
        return None
    found = [("policy and critic", _float32_norms(AutoModelForCausalLM, probe_config(cfg.model)))]
    if cfg.reward.model.path is not None:
        config = model_config(cfg.reward.model.path, field="reward.model.path")
        found.append(("reward model", _float32_norms(AutoModelForSequenceClassification, config)))
    parts = [f"{', '.join(names)} ({models})" for models, names in found if names]
    if not parts:
        return None
    return (
        f"model.precision=fp64: {'; '.join(parts)} normalize in a form verlite does not "
        "recompute in fp64 and keep their own forward, which rounds their activations and "
        "gradients to float32: results there are float32-exact, not fp64-exact (layouts agree "
        "to about 1e-7, not 1e-9; docs/precision-and-memory.md)"
    )


def _float32_norms(auto_class: AutoClass, config: PretrainedConfig) -> list[str]:
    """:func:`precision.float32_norms` of the fp64 model of ``config``, checked on the model
    built on the meta device, each of its norms made real alone (no memory)."""
    with torch.device("meta"):
        model = auto_class.from_config(config)
    return float32_norms(
        nn.ModuleList(
            cast_weights(copy.deepcopy(module).to_empty(device="cpu"), torch.float64)
            for module in model.modules()
            if type(module).__name__.endswith("Norm")
        )
    )


def window_passed(config: PretrainedConfig, *, max_sequence_length: int, fields: str) -> str | None:
    """Why packed attention, which applies no window, cannot run a model of ``config`` on
    sequences of up to ``fields`` = ``max_sequence_length`` tokens: a sliding window of its
    (``flops.sliding_window_layers``) such a sequence could pass; None when none can
    (Hugging Face's window lets query i attend key j iff 0 <= i - j < window: full causal
    attention on a sequence no longer than the window)."""
    sliding, window = sliding_window_layers(config)
    if window is None or max_sequence_length <= window:
        return None
    return (
        f"{sliding} of the model's {config.num_hidden_layers} layers attend through a sliding "
        f"window of {window} tokens (sliding_window), and a sequence can be {fields} = "
        f"{max_sequence_length} tokens; packed attention applies no window, which is the "
        f"model's attention only for sequences of at most {window} tokens"
    )


def check_packing_supported(
    cfg: ModelConfig, *, role: str, max_sequence_length: int, fields: str
) -> None:
    """``<role>.packing=true`` at start-up: :func:`packing_unsupported` finds nothing;
    refused in one line otherwise, before any worker trains with attention across
    sequences or past a window."""
    why = packing_unsupported(cfg, max_sequence_length=max_sequence_length, fields=fields)
    if why is not None:
        raise ConfigError(f"{role}.packing=true: {why}; set {role}.packing=false")


def packing_unsupported(cfg: ModelConfig, *, max_sequence_length: int, fields: str) -> str | None:
    """Why packed attention cannot run the model of ``cfg`` on sequences of up to ``fields``
    = ``max_sequence_length`` tokens; None when it can. A sliding window of the model must
    not bind on such a sequence (:func:`window_passed`), and a one-layer-per-kind model of
    ``cfg``'s architecture, narrowed to a few heads, must keep packed sequences apart
    (``varlen.enable_packing``)."""
    config = copy.deepcopy(probe_config(cfg))
    passed = window_passed(config, max_sequence_length=max_sequence_length, fields=fields)
    if passed is not None:
        return passed
    narrow = {
        "vocab_size": 64,
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    }
    for key, value in narrow.items():
        if hasattr(config, key):
            setattr(config, key, value)
    kinds = getattr(config, "layer_types", None)
    if kinds:  # one layer of each kind (Qwen2's first layers attend in full, later ones slide)
        config.layer_types = sorted(set(kinds))
        config.num_hidden_layers = len(config.layer_types)
    try:
        enable_packing(AutoModelForCausalLM.from_config(config))
    except PackingUnsupported as exc:
        return str(exc)
    except Exception as exc:  # the probe itself could not be built or run
        return (
            f"could not check that {config.model_type} models keep packed sequences apart "
            f"({type(exc).__name__}: {exc})"
        )
    return None


# Rotary scalings whose frequencies follow the longest position of each forward pass (and,
# for dynamic, the passes before it) once that passes the model's original context.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_sets(config: PretrainedConfig) -> list[dict[str, Any]]:
    """A checkpoint's rotary parameters: one set, or one per layer type; none without."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return []
    if "rope_type" in rope or "type" in rope:
        return [rope]
    return [value for value in rope.values() if isinstance(value, dict)]


def _rope_kind(params: dict[str, Any]) -> Any:
    return params.get("rope_type", params.get("type"))


def check_context_fits(cfg: ModelConfig, *, max_sequence_length: int, fields: str) -> str | None:
    """``model.path`` at start-up: the run's longest sequence (``fields`` name what sets it)
    against the model's ``max_position_embeddings``. Past it, a model with learned positions
    (OPT, GPT-2: a position table, :func:`position_tables`, found on a model built on the
    meta device) indexes past its table (an ``IndexError`` inside a
    worker, at the first rollout): refused in one line. A rotary model runs on positions it
    was not trained at, which a user may mean (a long-response run of a short-context
    checkpoint): the warning line returned says so. A rotary scaling other than the default
    extends the context on purpose and is left to :func:`check_rope_supported`."""
    if cfg.path is None:
        return None
    config = model_config(cfg.path)
    positions = getattr(config, "max_position_embeddings", None)
    scaled = any(_rope_kind(params) not in (None, "default") for params in _rope_sets(config))
    if not isinstance(positions, int) or max_sequence_length <= positions or scaled:
        return None
    past = (
        f"model.path={cfg.path}: sequences here reach {max_sequence_length} tokens ({fields}), "
        f"past the model's context of {positions} positions (config.json "
        "max_position_embeddings)"
    )
    model = meta_causal_lm(config)
    if position_tables(model, positions):
        raise ConfigError(
            f"{past}, the rows of its position table; shorten the prompts or responses"
        )
    return (
        f"warning: {past}: its rotary positions past {positions} are ones it was not trained "
        "at; shorten the prompts or responses, or give config.json a rope scaling, unless "
        "that is meant"
    )


# The rows a learned position table holds beyond max_position_embeddings (OPT's and BioGPT's
# offset of 2, from their padding index).
_POSITION_OFFSET_ROWS = 2
_NAMES_POSITIONS = re.compile(r"position", re.IGNORECASE)


def position_tables(model: nn.Module, positions: int) -> list[str]:
    """The names of ``model``'s learned position tables: embeddings besides its token
    embeddings that its class or name says hold positions (OPT's
    ``OPTLearnedPositionalEmbedding``, ``embed_positions``, ``position_embeddings``), or, where
    neither says (GPT-2's ``wpe``), that have a row per position of ``positions``
    (``max_position_embeddings``, up to :data:`_POSITION_OFFSET_ROWS` more). Other embeddings
    are not (Gemma 3n's per-layer token embeddings, ``embed_tokens_per_layer``)."""
    tokens = input_embeddings(model)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        and module is not tokens
        and (
            bool(_NAMES_POSITIONS.search(f"{name} {type(module).__name__}"))
            or 0 <= module.num_embeddings - positions <= _POSITION_OFFSET_ROWS
        )
    ]


def check_rope_supported(cfg: ModelConfig, *, max_sequence_length: int) -> None:
    """``model.path`` at start-up: a rotary scaling of ``LENGTH_DEPENDENT_ROPE`` with
    sequences longer than the model's original context is refused in one line. Its
    frequencies are set by the longest row of each forward pass, so a row's log-probs would
    depend on the rows that share its micro-batch (3e-5 in fp64 for a row beside a longer
    one), and a sampler's cache on its own length: not the same policy in every layout."""
    if cfg.path is None:
        return
    config = model_config(cfg.path)
    for params in _rope_sets(config):
        kind = _rope_kind(params)
        original = params.get("original_max_position_embeddings") or config.max_position_embeddings
        if kind in LENGTH_DEPENDENT_ROPE and max_sequence_length > original:
            raise ConfigError(
                f"model.path={cfg.path}: its rope scaling {kind!r} changes the rotary "
                f"frequencies with the longest sequence of each forward pass beyond {original} "
                f"positions, and sequences here reach {max_sequence_length}: a row's "
                "log-probs would depend on the rows it shares a micro-batch with; keep "
                f"sequences within {original} tokens or use a checkpoint with static rope scaling"
            )


def check_lora_supported(cfg: ModelConfig, lora: LoraConfig) -> str | None:
    """``actor.lora.rank > 0`` at start-up: peft installed, and every target module a linear
    layer of the model (checked on a model built on the meta device: no memory). Returns the
    line a run prints where the targets leave out the built-in model's LM head (random, as
    all its weights: frozen, it holds sampling near uniform whatever the adapters learn,
    docs/lora.md); None otherwise (a ``model.path`` model's head is trained already)."""
    if lora.rank == 0:
        return None
    check_peft_installed(lora)
    model = meta_causal_lm(probe_config(cfg))
    check_targets(model, lora)
    head = model.get_output_embeddings()
    name = next(n for n, m in model.named_modules() if m is head).rsplit(".", 1)[-1]
    if cfg.path is not None or name in lora.target_modules:
        return None
    return (
        f"actor.lora.target_modules=[{', '.join(lora.target_modules)}] leaves out {name}: the "
        "built-in model's LM head is random and stays frozen, which keeps sampling near "
        "uniform whatever the adapters learn (docs/lora.md, 'What the quick-start learns'); "
        f"add {name} to actor.lora.target_modules"
    )


def attention_crossover(cfg: ModelConfig) -> int:
    """The sequence length at which a token's causal attention costs what its weights do in
    a packed row, so that a packed row of sequences L_i costs about sum(L_i + L_i^2 /
    crossover) token-equivalents (``step_batch.row_costs``): ``model.attention_crossover``
    when set (measured by ``verlite measure-packing``, ``models.packing_cost``), else
    :func:`flop_crossover`."""
    if cfg.attention_crossover is not None:
        return cfg.attention_crossover
    return flop_crossover(cfg)


def flop_crossover(cfg: ModelConfig) -> int:
    """The attention crossover counted from FLOPs: one decoder layer's parameters over its
    attention width, heads x head dim (a token's weight FLOPs are 6 x parameters; its share
    of causal attention over a sequence of length L, 6 x heads x head dim x L per layer:
    ``flops.DecoderShape``'s count, of a Mixture-of-Experts layer the experts a token is
    sent to). Counted on models of 1 and 2 layers built on the meta device: no memory, any
    architecture."""
    config = probe_config(cfg)
    counts = []
    for layers in (1, 2):
        config = copy.deepcopy(config)
        config.num_hidden_layers = layers
        model = meta_causal_lm(config)
        counts.append(DecoderShape.of(model).dense_params)
    return max(1, round((counts[1] - counts[0]) / attention_width(config)))
