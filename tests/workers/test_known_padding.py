"""A pass over a micro-batch the engine built tells Hugging Face's mask creation the padding
it read on the CPU (``forward.mark_padding``, ``models.varlen.known_padding``) instead of
having it read the device's 2-D mask: every attention layer gets the mask it got from
Hugging Face's own SDPA masks (none where it leaves the mask to ``is_causal``), and the
log-probs, values and gradients are the same bit for bit, fp32 and bf16-mixed, for every
kind of model verlite trains: Llama and Qwen2 (the built-in ones), sliding-window models
(Mistral, a Qwen2 and a Gemma 3 that mix sliding and full layers, their windows shorter
than the rows), Mixture-of-Experts models, a critic and a LoRA policy (peft)."""

import copy

import pytest
import torch
from torch import nn

from tests.model_support import tiny_moe, tiny_sliding
from verlite.audit.invariance import make_batch
from verlite.config import LoraConfig, load_config
from verlite.models import build_policy, build_value_model
from verlite.models.logits_chunk import set_logits_chunk_tokens
from verlite.models.precision import autocast
from verlite.models.varlen import use_verlite_attention
from verlite.step_batch import take_rows, trim_padding
from verlite.workers.forward import response_log_probs, response_values
from verlite.workers.train_engine import micro_batch

MAIN = load_config("configs/ppo_tiny.yaml")
SIZES = {"vocab_size": 64, "max_positions": MAIN.max_sequence_length, "seed": 3}
CPU = torch.device("cpu")


def _policy(kind: str) -> nn.Module:
    if kind in ("llama", "qwen2"):
        return build_policy(MAIN.model.model_copy(update={"arch": kind}), **SIZES)
    if kind == "lora":
        lora = LoraConfig(rank=4, target_modules=("q_proj", "v_proj", "down_proj"))
        return build_policy(MAIN.model, **SIZES, lora=lora)
    if kind in ("qwen2_moe", "mixtral"):
        model = tiny_moe(kind)
    else:  # a window of 3 tokens, shorter than the rows
        model = tiny_sliding(kind.removesuffix("_sliding"), 3)
    set_logits_chunk_tokens(model, MAIN.model.logits_chunk_tokens)
    return model


KINDS = ["llama", "qwen2", "mistral_sliding", "qwen2_sliding", "gemma3_sliding"]
KINDS += ["qwen2_moe", "mixtral", "lora", "critic"]


def _masks_seen(model: nn.Module) -> list[torch.Tensor | None]:
    """The attention mask each attention layer of ``model`` is called with, in call order."""
    seen: list[torch.Tensor | None] = []
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(
                lambda m, args, kwargs: seen.append(kwargs.get("attention_mask")),
                with_kwargs=True,
            )
    return seen


def _run(model: nn.Module, td, precision: str) -> list[torch.Tensor]:
    """The pass's outputs (log-probs and entropies, or values) and its parameters' gradients."""
    model.zero_grad(set_to_none=True)
    with autocast(precision, CPU):
        if isinstance(model, type(_critic())):
            outputs = [response_values(model, td)]
        else:
            outputs = list(response_log_probs(model, td, temperature=0.7, entropy="loss"))
    sum(out.float().sum() for out in outputs).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [out.detach() for out in outputs] + grads


def _critic() -> nn.Module:
    return build_value_model(MAIN.model, **SIZES)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_known_padding_gives_hugging_faces_masks_and_outputs_bit_for_bit(
    kind: str, precision: str
) -> None:
    hf = _critic() if kind == "critic" else _policy(kind)
    ours = copy.deepcopy(hf)
    use_verlite_attention(ours, packing=False)
    seen = {"hf": _masks_seen(hf), "ours": _masks_seen(ours)}
    batch = make_batch(MAIN, seed=1, num_sequences=4)
    # All rows (padded), and one row (no padding once trimmed to its own lengths).
    for rows in ([0, 1, 2, 3], [2]):
        for masks in seen.values():
            masks.clear()
        expected = _run(hf, trim_padding(take_rows(batch, rows)), precision)
        got = _run(ours, micro_batch(batch, rows, device=CPU, packing=False), precision)
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert len(seen["ours"]) == len(seen["hf"]) > 0
        for a, b in zip(seen["ours"], seen["hf"], strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
        # Both of Hugging Face's decisions are met: a mask for padding or a window shorter
        # than the row, none (SDPA's is_causal) for a full layer over a row without padding.
        skipped = [mask is None for mask in seen["hf"]]
        if rows != [2]:
            assert not any(skipped)
        elif kind != "mistral_sliding":  # every layer of Mistral slides
            assert any(skipped)
