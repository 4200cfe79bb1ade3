"""Batched KV-cached sampling on a Hugging Face causal LM: temperature, top-k, top-p, EOS.

:class:`Sampler` decodes as ``decode`` says (``rollout.decode``): eagerly here, on a cache
that grows a position per step, or on the static cache of ``verlite.generation.decode``
(CUDA graphs on cuda). Both draw the same tokens with the same noise.
"""

from __future__ import annotations

from functools import partial
from typing import Any, cast

import torch
from tensordict import TensorDict
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from verlite.generation.decode import EAGER, DecodeSettings, StaticDecoder
from verlite.generation.noise import Noise
from verlite.generation.sampling import (
    GenerationDiverged,
    SamplingParams,
    agree,
    build_step_batch,
    ended,
    prompt_padding,
    row_budgets,
    take_token,
)
from verlite.generation.static_cache import autocast_dtype
from verlite.models.varlen import known_padding, use_verlite_attention


class Sampler:
    """Samples with the given model; ``lockstep`` keeps FSDP ranks in the same number of steps.

    Under FSDP every forward all-gathers parameters, so all ranks must run the same number
    of decode steps: they agree each step on whether any rank still has an unfinished row.
    The model is switched to verlite's attention (SDPA's, bit for bit): each pass builds its
    mask knowing the prompts' padding (``sampling.prompt_padding``), where Hugging Face's
    check reads the device's mask once per forward, every decode step.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_id: int,
        pad_token_id: int,
        lockstep: bool,
        decode: DecodeSettings = EAGER,
    ) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.lockstep = lockstep
        use_verlite_attention(model, packing=False)
        self.static = (
            None
            if decode.mode == "eager"
            else StaticDecoder(
                model,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                lockstep=lockstep,
                settings=decode,
            )
        )

    @torch.no_grad()
    def generate(
        self, prompts: TensorDict, params: SamplingParams, noise: Noise | None
    ) -> TensorDict:
        """Responses to ``prompts``, sampled with ``noise`` (``verlite.generation.noise``; None
        when greedy)."""
        self.model.eval()
        if self.static is not None:
            return self.static.generate(prompts, params, noise)
        with known_padding(prompt_padding(prompts)):
            return self._generate(prompts, params, noise)

    def _generate(
        self, prompts: TensorDict, params: SamplingParams, noise: Noise | None
    ) -> TensorDict:
        """:meth:`generate` eagerly: the termination read once per step (``agree``, which
        in lockstep agrees over the ranks and which says whether a row diverged). Reading
        it every k steps instead would run up to k - 1 steps past the last row's end (pads,
        the same results) and find a divergence late; the static path reads it a step
        behind, without waiting for the step it just launched."""
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
        ends = torch.tensor(params.end_tokens(self.eos_token_id), dtype=torch.long, device=device)
        budgets = row_budgets(prompts, params)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        width = prompt_mask.shape[1]
        # Room for every response position, so a step passes a view instead of concatenating.
        mask = torch.cat([prompt_mask, prompt_mask.new_ones((batch, params.max_new_tokens))], -1)
        positions = prompts["position_ids"]
        next_positions = prompt_mask.sum(-1, keepdim=True)  # first response position per row
        # Cache calls layer_class_to_replicate with no argument, for each new layer: any
        # factory of layers does, though transformers annotates a layer class.
        layer = partial(PreallocatedCacheLayer, input_ids.shape[1] + params.max_new_tokens)
        cache = Cache(layer_class_to_replicate=cast(type[CacheLayerMixin], layer))
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
            uniforms = None if noise is None or params.temperature == 0 else noise.uniforms(t)
            token, log_prob, nonfinite = take_token(
                out.logits[:, -1], params, uniforms, finished, self.pad_token_id
            )
            responses[:, t] = token
            sampled_log_probs[:, t] = log_prob
            lengths += (~finished).long()
            finished |= ended(token, ends) | (lengths >= budgets)
            flags = torch.stack([(~finished).any(), nonfinite.any()]).to(torch.int64)
            active, diverged = agree(flags, lockstep=self.lockstep)
            if diverged:
                raise GenerationDiverged(t, int(nonfinite.sum()), batch)
            if not active:
                break
            step_ids = token.unsqueeze(-1)
            # An unfinished row reads its next position; a finished one stays at the one it
            # read last, so that no row runs past the positions its own tokens need (a rotary
            # scaling set by the batch's largest position would change every row's logits).
            positions = next_positions + (lengths - 1 - finished.long())[:, None]
        real = torch.arange(params.max_new_tokens, device=device) < lengths[:, None]
        return build_step_batch(prompts, responses, real, sampled_log_probs)


class PreallocatedCacheLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init_subclass__ unannotated
    """One layer's KV cache with room for the whole generation, filled in place.

    Hugging Face's ``DynamicLayer`` concatenates at every decode step, copying the layer's
    whole cache once per generated token (quadratic in the length); here each step writes
    its own positions and attention reads a view of the filled part. With one torch thread
    per worker that is 4-8% of a decode on the benchmark's model (``benchmarks/rollout.py``).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves CacheLayerMixin.__init__ unannotated
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
        # Under autocast in its dtype (a rotated key comes out in float32), as the static
        # cache stores them; without, each in its own (None: the states' dtype).
        dtype = autocast_dtype(self.device)
        self.key_buffer = key_states.new_empty((batch, heads, self.capacity, dim), dtype=dtype)
        self.value_buffer = value_states.new_empty(
            (batch, value_states.shape[1], self.capacity, value_states.shape[-1]), dtype=dtype
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
