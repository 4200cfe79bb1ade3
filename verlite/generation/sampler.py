"""Batched KV-cached sampling on a Hugging Face causal LM: temperature, top-k, top-p, EOS."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from verlite.distributed import all_reduce_max
from verlite.errors import RunFailure
from verlite.generation.noise import Noise


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a response besides EOS (a turn's end)


class GenerationDiverged(RunFailure):
    """The policy gave non-finite next-token logits: sampling from them would draw garbage."""


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from (B, vocab) logits, drawn with the row's uniform in [0, 1)
    (``uniforms``, (B,) float64; None when greedy), and the float32 log-probability the
    token was drawn with: under the temperature, renormalized over what top-k and top-p
    kept (0 when greedy: the choice was certain)."""
    if params.temperature == 0:
        token = logits.argmax(dim=-1)
        return token, torch.zeros(token.shape, dtype=torch.float32, device=token.device)
    if uniforms is None:
        raise ValueError(f"sampling at temperature {params.temperature} needs uniforms")
    logits = logits.float() / params.temperature
    # Top-k and top-p only ever keep the most likely tokens: work on those candidates,
    # sorted descending, instead of masking and sorting the whole vocabulary.
    candidates: torch.Tensor | None = None
    if 0 < params.top_k < logits.shape[-1]:
        logits, candidates = torch.topk(logits, params.top_k, dim=-1)
    elif params.top_p < 1.0:
        logits, candidates = torch.sort(logits, dim=-1, descending=True)
    if params.top_p < 1.0:
        probs = logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        logits = logits.masked_fill(probs.cumsum(dim=-1) - probs >= params.top_p, float("-inf"))
    probs = logits.softmax(dim=-1)
    choice = _draw(probs, uniforms)[:, None]
    log_prob = probs.gather(-1, choice).squeeze(-1).log()
    token = choice if candidates is None else candidates.gather(-1, choice)
    return token.squeeze(-1), log_prob


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row, drawn with probability ``probs``, by inverting the CDF at the
    row's uniform: ``torch.multinomial`` costs ~30x more per decode step on CPU (2 ms
    against 70 us for 64 rows of 2048 tokens), and could not take keyed noise.

    The uniform is scaled to each row's total and kept strictly below it, so the first
    CDF entry above it always belongs to a token of positive probability: a token that
    top-k or top-p removed (a flat step of the CDF) is never drawn.
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(
        uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # A row of NaN probabilities (a diverged policy, which generate stops at once) finds no
    # entry: keep its index in range until then.
    return index.clamp_(max=probs.shape[-1] - 1)


class Sampler:
    """Samples with the given model; ``lockstep`` keeps FSDP ranks in the same number of steps.

    Under FSDP every forward all-gathers parameters, so all ranks must run the same number
    of decode steps: they agree each step on whether any rank still has an unfinished row.
    """

    def __init__(
        self, model: nn.Module, *, eos_token_id: int, pad_token_id: int, lockstep: bool
    ) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.lockstep = lockstep

    @torch.no_grad()
    def generate(
        self, prompts: TensorDict, params: SamplingParams, noise: Noise | None
    ) -> TensorDict:
        """Responses to ``prompts``, sampled with ``noise`` (``verlite.generation.noise``; None
        when greedy)."""
        self.model.eval()
        input_ids = prompts["input_ids"]
        prompt_mask = prompts["attention_mask"]
        batch, device = input_ids.shape[0], input_ids.device
        responses = torch.full(
            (batch, params.max_new_tokens), self.pad_token_id, dtype=input_ids.dtype, device=device
        )
        sampled_log_probs = torch.zeros(
            (batch, params.max_new_tokens), dtype=torch.float32, device=device
        )
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        ends = torch.tensor([self.eos_token_id, *params.stop_token_ids], device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        width = prompt_mask.shape[1]
        # Room for every response position, so a step passes a view instead of concatenating.
        mask = torch.cat([prompt_mask, prompt_mask.new_ones((batch, params.max_new_tokens))], -1)
        positions = prompts["position_ids"]
        next_positions = prompt_mask.sum(-1, keepdim=True)  # first response position per row
        cache = Cache(
            layer_class_to_replicate=partial(
                PreallocatedCacheLayer, input_ids.shape[1] + params.max_new_tokens
            )
        )
        step_ids = input_ids
        for t in range(params.max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask[:, : width + t],
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1]
            # A row holding a NaN or +inf sums to NaN or +inf (a masked -inf alone, to -inf):
            # one pass, 20x cheaper than isfinite over the vocabulary.
            row_sums = logits.sum(-1)
            nonfinite = (row_sums.isnan() | row_sums.isposinf()) & ~finished
            uniforms = None if noise is None or params.temperature == 0 else noise.uniforms(t)
            token, log_prob = sample_next_token(logits, params, uniforms)
            token = torch.where(finished, torch.full_like(token, self.pad_token_id), token)
            responses[:, t] = token
            sampled_log_probs[:, t] = log_prob.masked_fill(finished, 0.0)
            lengths += (~finished).long()
            finished |= torch.isin(token, ends)
            active, diverged = self._agree(finished, nonfinite)
            if diverged:
                raise GenerationDiverged(
                    f"rollout: non-finite next-token logits at decode step {t} "
                    f"({int(nonfinite.sum())} of {batch} rows on this rank); the policy diverged. "
                    "Lower the learning rate, then resume from the last checkpoint"
                )
            if not active:
                break
            step_ids = token.unsqueeze(-1)
            positions = next_positions + t
        real = torch.arange(params.max_new_tokens, device=device) < lengths[:, None]
        return build_step_batch(prompts, responses, real, sampled_log_probs)

    def _agree(self, finished: torch.Tensor, nonfinite: torch.Tensor) -> tuple[bool, bool]:
        """Whether any row (on any rank, in lockstep) is still active, and whether any row
        sampled from non-finite logits: one host sync a step, and every rank raises together
        rather than leaving the others waiting in a collective."""
        flags = torch.stack([(~finished).any(), nonfinite.any()]).to(torch.int64)
        if self.lockstep:
            all_reduce_max(flags)
        active, diverged = flags.tolist()
        return bool(active), bool(diverged)


class PreallocatedCacheLayer(CacheLayerMixin):
    """One layer's KV cache with room for the whole generation, filled in place.

    Hugging Face's ``DynamicLayer`` concatenates at every decode step, copying the layer's
    whole cache once per generated token (quadratic in the length); here each step writes
    its own positions and attention reads a view of the filled part. With one torch thread
    per worker that is 4-8% of a decode on the benchmark's model (``benchmarks/rollout.py``).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        self.key_buffer = key_states.new_empty((batch, heads, self.capacity, dim))
        self.value_buffer = value_states.new_empty(
            (batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"a KV cache of {self.capacity} positions cannot hold {end}")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys = self.key_buffer[:, :, :end]
        self.values = self.value_buffer[:, :, :end]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity


def build_step_batch(
    prompts: TensorDict,
    responses: torch.Tensor,
    real: torch.Tensor,
    log_probs: torch.Tensor,
    policy: torch.Tensor | None = None,
) -> TensorDict:
    """The step TensorDict of ``verlite.step_batch``: prompt + response, masks and positions,
    and the log-probs the sampler drew each response token with (``rollout_log_probs``).
    ``real``: (B, R) the response tokens (a prefix of each row); ``policy``: those the
    policy sampled, the ``response_mask`` (all of them when None; a multi-turn row's
    observations are not)."""
    width = responses.shape[1]
    dtype = prompts["attention_mask"].dtype
    real = real.to(dtype)
    first = prompts["attention_mask"].sum(-1, keepdim=True)
    response_positions = first + torch.arange(width, device=responses.device)
    td = TensorDict(
        {
            "input_ids": torch.cat([prompts["input_ids"], responses], dim=-1),
            "attention_mask": torch.cat([prompts["attention_mask"], real], dim=-1),
            "position_ids": torch.cat([prompts["position_ids"], response_positions * real], dim=-1),
            "responses": responses,
            "response_mask": real if policy is None else policy.to(dtype),
            "rollout_log_probs": log_probs,
        },
        batch_size=prompts.batch_size,
    )
    for key, value in prompts.items():  # carry uid, answers' index, non-tensor entries
        if key in td:
            continue
        if isinstance(value, torch.Tensor):
            td.set(key, value)
        else:
            td.set_non_tensor(key, prompts.get_non_tensor(key))
    return td
