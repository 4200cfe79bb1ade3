"""Numeric precision (``model.precision``, resolved by ``verlite.config.resolved_precision``):
the dtype parameters are stored in, what the forward pass computes in, and how models that
are never trained are stored (docs/design.md, "Precision").

- ``fp32`` / ``fp64``: parameters, gradients, optimizer state and compute in that dtype.
- ``bf16-mixed``: parameters (the master weights), gradients (accumulated over micro-batches
  and reduced over ranks) and optimizer state in fp32; the forward pass under
  ``torch.autocast(bfloat16)``, so matrix products run in bf16 (and their backward, which
  follows the forward's dtypes) while the residual stream, norms, softmaxes and everything
  verlite computes from the logits stay fp32. The same in every strategy (none, ddp, fsdp), so
  every layout computes the same arithmetic and the invariance audit can hold them to one
  tolerance.
- ``bf16``: parameters and compute in bf16 (no master weights): an update smaller than half
  a weight's bf16 spacing rounds away (``verlite.config.derived.precision_warning`` warns of it, before Ray starts).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from verlite.config import Config, ConfigError
from verlite.models.hf import ModuleT, config_of, input_embeddings, output_embeddings

PARAM_DTYPES = {
    "fp32": torch.float32,
    "fp64": torch.float64,
    "bf16-mixed": torch.float32,
    "bf16": torch.bfloat16,
}


def param_dtype(precision: str) -> torch.dtype:
    """The dtype parameters are stored in (a trained model's: its master weights)."""
    return PARAM_DTYPES[precision]


def cache_dtype(precision: str) -> torch.dtype:
    """The dtype a generation's KV cache stores keys and values in: bf16 under
    ``bf16-mixed`` (autocast's, which attention reads them in:
    ``generation.static_cache.autocast_dtype``), else the parameters'."""
    return torch.bfloat16 if precision == "bf16-mixed" else param_dtype(precision)


def score_dtype(precision: str) -> torch.dtype:
    """The dtype of a step's scores, and so of the token rewards, advantages and returns the
    driver computes from them: the parameters' but never below float32 (float64 in an fp64
    run, float32 under every other precision). A score is never rounded to float32 in an
    fp64 run: a score within ~1e-15 of a float32 rounding boundary would round apart under
    another layout."""
    return torch.promote_types(param_dtype(precision), torch.float32)


def autocast(
    precision: str, device: torch.device, *, cache: bool = True
) -> contextlib.AbstractContextManager[None]:
    """The region every forward pass of a model runs in: bf16 autocast under ``bf16-mixed``.

    ``cache``: autocast keeps the bf16 cast of each trained weight it casts until the region
    ends, so that a region of many passes (a generation's decode steps) casts each weight
    once. Over an FSDP2 model (``distributed.sharded``) that is a bf16 copy of every gathered
    layer, the whole model on every rank, which its sharding was to avoid: its forward-only
    regions pass ``cache=False`` and cast each layer as they gather it (the same bf16 values:
    the same results bit for bit)."""
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def inference_dtypes(
    model: nn.Module, precision: str, *, keep: Sequence[nn.Module] = ()
) -> dict[str, torch.dtype]:
    """The dtype of each entry of ``model``'s state (keyed as ``state_dict``) in a copy that
    is never trained (the reference, the rollout model, the reward model): under
    ``bf16-mixed`` the weights and biases of its linear layers are bf16 (what autocast casts
    them to at every forward anyway, so the copy computes bit for bit what the fp32 model
    computes under autocast, at half the memory), every other entry (embeddings, norms, a
    weight a linear layer shares with an embedding, the linear layers in ``keep``: a head whose
    output is read as a number, such as a reward model's score) keeps its dtype. A weight
    sync sends each tensor in this dtype (cast once, on the actor)."""
    state = model.state_dict(keep_vars=True)
    if precision != "bf16-mixed":
        return {name: value.dtype for name, value in state.items()}
    kept = {id(module) for module in keep}
    linear = {
        id(param)
        for module in model.modules()
        if isinstance(module, nn.Linear) and id(module) not in kept
        for param in module.parameters(recurse=False)
    }
    other = {
        id(param)
        for module in model.modules()
        if not isinstance(module, nn.Linear)
        for param in module.parameters(recurse=False)
    }
    return {
        name: torch.bfloat16 if id(value) in linear and id(value) not in other else value.dtype
        for name, value in state.items()
    }


@torch.no_grad()
def store_for_inference(
    model: ModuleT, precision: str, *, keep: Sequence[nn.Module] = ()
) -> ModuleT:
    """``model`` (in place) stored in :func:`inference_dtypes` (``keep``: linear layers left
    as they are); returned."""
    dtypes = inference_dtypes(model, precision, keep=keep)
    for name, param in model.named_parameters():
        if param.dtype != dtypes[name]:
            param.data = param.data.to(dtypes[name])
    return model


def untied_head(model: nn.Module, precision: str) -> str | None:
    """The state name of ``model``'s LM head weight where a copy of it stored for generation
    (:func:`store_for_generation`) holds the head apart from the input embedding it is tied
    to here: under ``bf16-mixed``, for a linear head whose weight is the embedding's (Qwen2.5's
    ``tie_word_embeddings``); None otherwise (an untied head, another precision)."""
    if precision != "bf16-mixed":
        return None
    head = output_embeddings(model)
    if type(head) is not nn.Linear or head.weight is not input_embeddings(model).weight:
        return None
    return next(f"{name}.weight" for name, module in model.named_modules() if module is head)


def generation_dtypes(model: nn.Module, precision: str) -> dict[str, torch.dtype]:
    """The dtype of each entry of ``model``'s state in its copy stored for generation
    (:func:`store_for_generation`): :func:`inference_dtypes`, and bf16 for the head it unties
    (:func:`untied_head`). A weight sync sends each tensor in this dtype (cast once, on the
    actor), a tied head under its own name too."""
    dtypes = inference_dtypes(model, precision)
    head = untied_head(model, precision)
    if head is not None:
        dtypes[head] = torch.bfloat16
    return dtypes


@torch.no_grad()
def store_for_generation(model: ModuleT, precision: str) -> ModuleT:
    """``model`` (in place) stored as a model that only samples (a rollout worker's, a
    colocated actor's generation copy), returned: :func:`store_for_inference`, with an LM
    head tied to the embedding (:func:`untied_head`) made a bf16 parameter of its own. Tied,
    it would stay fp32 (the embedding's dtype: a lookup is not autocast) and autocast would
    cast it at every decode step a CUDA graph replays, its cache not holding across captures:
    for Qwen2.5-0.5B's 152k x 896 head, 0.8 GB of memory traffic a step (545 MB read, 272 MB
    written), nearly the 1 GB the step's bf16 weights, that head's included, are read in. Its own
    bf16 head holds the cast autocast makes of the tied weight: the same results bit for
    bit, for 2 bytes a head parameter."""
    head = untied_head(model, precision)
    if head is not None:
        linear = output_embeddings(model)
        assert isinstance(linear, nn.Linear)  # the linear head untied_head found
        # cast as it is made (no full-precision head first); frozen where the embedding is (a
        # LoRA policy's base: what an adapters-only sync checks)
        tied = linear.weight
        dtype = generation_dtypes(model, precision)[head]
        linear.weight = nn.Parameter(tied.detach().to(dtype), requires_grad=tied.requires_grad)
        config_of(model).tie_word_embeddings = False
    return store_for_inference(model, precision)


@torch.no_grad()
def stored_copy(model: ModuleT, precision: str, *, generation: bool = False) -> ModuleT:
    """A copy of ``model`` stored as :func:`store_for_inference` stores a model that is never
    trained (an actor's reference) or, with ``generation``, as :func:`store_for_generation`
    stores one that only samples (a colocated actor's generation copy); ``model`` is left as
    it is. Each parameter is cast as it is copied (a deep copy
    whose memo already holds it in its stored dtype): making the copy holds ``model`` and
    the copy in its stored dtypes, where a deep copy cast afterwards held a second
    full-precision model first (under bf16-mixed, 28 GB for a 7B policy, on every rank).
    The same copy bit for bit: casting before copying rounds as casting after does."""
    dtypes = inference_dtypes(model, precision)
    memo: dict[int, object] = {}
    for name, param in model.named_parameters():
        if param.dtype != dtypes[name]:
            # as ``Parameter.__deepcopy__`` copies it (its class, its requires_grad), cast
            memo[id(param)] = type(param)(param.detach().to(dtypes[name]), param.requires_grad)
    copied = copy.deepcopy(model, memo)
    if generation:
        return store_for_generation(copied, precision)
    return store_for_inference(copied, precision)


@torch.no_grad()
def refresh_inference_copy(
    copy: nn.Module,
    read: Callable[[str], torch.Tensor],
    sources: Mapping[str, str],
) -> None:
    """Bring ``copy`` (a model's :func:`stored_copy` for generation) up to date with that
    model's current state, in place and cast to the copy's dtypes: its tensors keep their
    addresses, which a captured CUDA graph reads. ``read(name)``: the model's current tensor
    of that name, whole (an actor's sharded one gathered: ``ActorWorker``), called once for
    each tensor of the model the copy holds, in the copy's state order, the same on every
    rank. ``sources``: each entry's name and the model's first name of its tensor
    (``distributed.first_names``): a head the model ties to the embedding is read under the
    embedding's name alone, and copied into the copy's own bf16 head if the copy holds one
    (:func:`store_for_generation`); a tensor the copy holds under two names copied once."""
    seen: set[int] = set()
    targets: dict[str, list[torch.Tensor]] = {}
    for name, target in copy.state_dict(keep_vars=True).items():
        if id(target) not in seen:
            seen.add(id(target))
            targets.setdefault(sources[name], []).append(target)
    for name, group in targets.items():
        value = read(name)
        for target in group:
            target.copy_(value)


def cast_weights(model: ModuleT, dtype: torch.dtype) -> ModuleT:
    """``model`` (in place) with its floating parameters and saved buffers in ``dtype``, as
    Hugging Face loads a checkpoint in ``dtype``; returned. A buffer the model computes itself
    and never saves keeps the dtype it was built in: ``Module.to`` would round the rotary
    frequencies (``inv_freq``), which Hugging Face builds in float32 whatever the model's
    dtype, to bf16, and the policy would compute other logits than its export loaded back.
    Nor are the tensors Hugging Face keeps in float32 when it loads in bf16 (or fp16) cast:
    those its model class names in ``_keep_in_fp32_modules_strict`` (GLM-4-MoE's and
    DeepSeek-V3's router weights and score-correction biases), but for trained parameters
    (a model cast here trains every parameter in ``dtype``; one Hugging Face loaded keeps its
    router in float32, which FSDP2 shards as a group of its own, ``distributed.parallel``):
    a LoRA policy's frozen base computes as its export, loaded back, does."""
    kept = _kept_in_fp32(model) if dtype in (torch.bfloat16, torch.float16) else set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype and id(param) not in kept:
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if (
                buffer.is_floating_point()
                and name not in module._non_persistent_buffers_set
                and buffer.dtype != dtype
                and id(buffer) not in kept
            ):
                setattr(module, name, buffer.to(dtype))
    return model


def _kept_in_fp32(model: nn.Module) -> set[int]:
    """The ids of ``model``'s frozen parameters and buffers that Hugging Face loads in float32
    under bf16 or fp16: of each Hugging Face model in it, those whose names match its class's
    ``_keep_in_fp32_modules_strict`` patterns, matched as its loader matches them (a search,
    ``*`` any text)."""
    kept: set[int] = set()
    for hf in model.modules():
        names = getattr(hf, "_keep_in_fp32_modules_strict", None)
        if not isinstance(hf, PreTrainedModel) or not names:
            continue
        pattern = re.compile("|".join(str(name).replace("*", ".*") for name in names))
        tensors = [*hf.named_parameters(), *hf.named_buffers()]
        kept.update(
            id(tensor)
            for name, tensor in tensors
            if pattern.search(name)
            and not (isinstance(tensor, nn.Parameter) and tensor.requires_grad)
        )
    return kept


def fp64_throughout(model: ModuleT) -> ModuleT:
    """``model`` (in place) computing in fp64 where its weights are fp64; returned.

    Hugging Face's normalization layers cast their input to float32 whatever its dtype
    (Llama's, Qwen2's and Mistral's RMSNorm, Gemma 3's, Cohere's LayerNorm, ...): an upcast
    for bf16, but under fp64 it rounds every normalized activation, and in backward every
    gradient through it, to float32. fp64 is what layouts are audited in: the loss gradient
    is scaled by the data-parallel size (``core.losses.agg_loss``), and a scale that is not a
    power of two rounds differently there, so the gradients of 3 ranks were 1e-7 apart from
    one rank's, not 1e-15. Each such layer (:func:`_fp64_norm_form`: found by what it
    computes, whatever its attributes are called) computes the same function in fp64.

    A Mixture-of-Experts model's experts (Qwen2-MoE, Qwen3-MoE, Mixtral, ...) run by
    default through ``grouped_mm``, which has no fp64 kernel: an fp64 forward stopped with
    "Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double". An fp64 model's
    experts run through Hugging Face's ``eager`` experts (a loop over the experts a batch
    uses), the same function of the weights.

    Other precisions keep Hugging Face's forward (float32 is at least theirs)."""
    fp64 = any(p.dtype == torch.float64 for p in model.parameters())
    if not fp64:
        return model
    for module in model.modules():
        form = _fp64_norm_form(module)
        if form is not None:
            setattr(module, _FP64_NORM_ATTR, form)
            module.forward = _fp64_norm.__get__(module)
    for hf in [m for m in model.modules() if isinstance(m, PreTrainedModel)]:
        if getattr(hf.config, "_experts_implementation", None) == "grouped_mm":
            hf.set_experts_implementation("eager")
    return model


# What a normalization layer may name its epsilon (Llama: variance_epsilon; Gemma 3: eps).
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")
# How a layer may scale its normalized input: by its weight (Llama), by 1 + its weight
# (Gemma's zero-centred weights), or not at all (Gemma 3n's norms without scale).
_SCALES = ("weight", "one_plus_weight", "none")
# A layer's own output against the fp64 function of its form, relative to the largest:
# within float32 rounding (it computes that form in float32), or within fp64 rounding (it
# computes in fp64 already).
_FORM_RTOL = 1e-5
_FP64_RTOL = 1e-12
# Where fp64_throughout keeps a normalization layer's form (_fp64_norm_form) for its fp64
# forward (_fp64_norm): a plain attribute of the layer, which its class does not declare.
_FP64_NORM_ATTR = "verlite_fp64_norm"


def _fp64_norm_form(module: nn.Module) -> tuple[float, bool, str] | None:
    """What the normalization layer ``module`` computes, where it rounds an fp64 input to
    float32: its epsilon, whether it centres (a LayerNorm) or not (an RMSNorm), and its
    scale (:data:`_SCALES`); None for any other module, a layer that computes in fp64
    already (``nn.LayerNorm``), or one that computes none of these forms (left as it is:
    :func:`float32_norms` names those that round to float32).
    Told by its class (a ``...Norm`` with an epsilon and fp64 weights, or none) and then by
    what it computes: a copy with random weights (so that no form hides behind the
    weights' initial ones or zeros) is run on a random fp64 input, and its output compared
    with each form's computed in fp64."""
    if not type(module).__name__.endswith("Norm"):
        return None
    eps: float | None = next(
        (getattr(module, n) for n in _EPS_NAMES if type(getattr(module, n, None)) is float), None
    )
    if eps is None:
        return None
    weight = getattr(module, "weight", None)
    probed = _probe(module)
    if probed is None:
        return None
    probe, hidden, out = probed
    with torch.no_grad():
        for centred in (False, True):
            for scale in _SCALES if weight is not None else ("none",):
                form = (eps, centred, scale)
                exact = _normalized(probe, hidden, form)
                error = float((out - exact).abs().max() / exact.abs().max())
                if error <= _FP64_RTOL:  # computes in fp64 already (nn.LayerNorm)
                    return None
                if error <= _FORM_RTOL:
                    return form
    return None


def _probe(module: nn.Module) -> tuple[nn.Module, torch.Tensor, torch.Tensor] | None:
    """A copy of the ``...Norm`` layer ``module`` with random fp64 weights, a random fp64
    input of its width and the copy's output on it (its class's forward); None where its
    weight or bias is not an fp64 tensor, or it does not map one tensor to an fp64 tensor of
    that shape (a layer of another signature)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    tensors = [t for t in (weight, bias) if t is not None]
    if not all(
        isinstance(t, torch.Tensor) and t.dtype == torch.float64 and not t.is_meta for t in tensors
    ):
        return None
    device = weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")
    # Its width: its weight's, else what it normalizes over (a weightless LayerNorm's
    # ``normalized_shape``: another width makes its forward raise), else any.
    width = getattr(module, "normalized_shape", None)
    if isinstance(weight, torch.Tensor):
        shape = tuple(weight.shape)
    elif isinstance(width, int) or (isinstance(width, tuple | list) and width):
        shape = (width,) if isinstance(width, int) else tuple(width)
    else:
        shape = (16,)
    gen = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(module)
    with torch.no_grad():
        # The copies of weight and bias: tensors or None, as checked above.
        for tensor in (getattr(probe, "weight", None), getattr(probe, "bias", None)):
            if isinstance(tensor, torch.Tensor):
                tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=torch.float64))
        hidden = torch.randn((4, *shape), generator=gen, dtype=torch.float64).to(device)
        out = _run(probe, hidden)
    return None if out is None else (probe, hidden, out)


def _run(module: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """``module``'s class forward on ``hidden`` (no gradients): an fp64 tensor of its
    shape, or None for a layer that raises or returns anything else."""
    with torch.no_grad():
        try:
            out = type(module).forward(module, hidden)
        except Exception:  # a layer of another signature: not one of these
            return None
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float64 or out.shape != hidden.shape:
        return None
    return out


def float32_norms(model: nn.Module) -> list[str]:
    """The class names of the ``...Norm`` layers of the fp64 ``model`` that
    :func:`fp64_throughout` leaves as they are (no form of :func:`_fp64_norm_form`) and
    that round their fp64 input to float32: their output on an input of float32 values
    does not move when each value moves by 2^-40 of itself, far below float32's spacing
    (2^-23), which an fp64 computation sees. Sorted, each once."""
    names = set()
    for module in model.modules():
        if _fp64_norm_form(module) is not None:
            continue
        probed = _probe(module) if type(module).__name__.endswith("Norm") else None
        if probed is None:
            continue
        probe, hidden, _ = probed
        exact = hidden.float().double()
        out, moved = _run(probe, exact), _run(probe, exact * (1 + 2**-40))
        if out is not None and moved is not None and torch.equal(out, moved):
            names.add(type(module).__name__)
    return sorted(names)


def _normalized(
    module: nn.Module, hidden: torch.Tensor, form: tuple[float, bool, str]
) -> torch.Tensor:
    """``module``'s normalization of ``hidden`` in the form ``form`` (:func:`_fp64_norm_form`),
    in ``hidden``'s dtype."""
    eps, centred, scale = form
    if centred:
        hidden = hidden - hidden.mean(-1, keepdim=True)
    out = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    if scale in ("weight", "one_plus_weight"):
        weight = module.weight
        # a form that scales is found on a layer with a weight tensor only (_fp64_norm_form)
        assert isinstance(weight, torch.Tensor)
        out = weight * out if scale == "weight" else out * (1.0 + weight)
    bias = getattr(module, "bias", None)
    return out + bias if isinstance(bias, torch.Tensor) else out


def _fp64_norm(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The normalization layer's own function in fp64 for an fp64 input; the class's own
    forward otherwise (a model cast after this was set, to bf16 say, keeps Hugging Face's
    float32 upcast)."""
    if hidden.dtype != torch.float64:
        out: torch.Tensor = type(self).forward(self, hidden)
        return out
    form: tuple[float, bool, str] = getattr(self, _FP64_NORM_ATTR)
    return _normalized(self, hidden, form)


def check_precision_supported(cfg: Config, *, on_gpu: bool) -> None:
    """The run's precision (``cfg.precision``) in bf16 (mixed or pure) on a GPU without bf16
    arithmetic (before Ampere), ``on_gpu`` telling where the models run: refused at start-up
    in one line naming ``model.precision`` as the user set it (``auto``: the default, which
    ``cfg.precision`` resolves), by the driver where this machine's GPU is the workers' (an
    embedded Ray), else by each worker (a cluster's GPUs are not known before it is reached),
    and by ``verlite check-invariance`` and ``verlite measure-packing``."""
    precision = cfg.precision
    if not on_gpu or "bf16" not in precision or not torch.cuda.is_available():
        return
    # Without ``including_emulation=False`` torch reports bf16 on any GPU that can hold a bf16
    # tensor (a V100 emulates it, slowly).
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        auto = cfg.model.precision == "auto"
        setting = f"auto (which is {precision} on cuda)" if auto else precision
        raise ConfigError(
            f"model.precision={setting}: the workers' GPU ({torch.cuda.get_device_name()}) "
            "has no bf16 arithmetic; set model.precision=fp32"
        )
