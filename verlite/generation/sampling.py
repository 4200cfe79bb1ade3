"""What both decode paths share: the sampling settings, drawing one token per row with its
log-probability, the end of a response, and the step batch a generation returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from verlite.distributed import all_reduce_max
from verlite.errors import RunFailure
from verlite.models.varlen import Padding


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a response besides EOS (a turn's end)
    ignore_eos: bool = False  # every row runs to max_new_tokens unless a stop token ends it

    def end_tokens(self, eos_token_id: int) -> list[int]:
        """The tokens that end a response: EOS (unless ``ignore_eos``) and the stop tokens."""
        return [*([] if self.ignore_eos else [eos_token_id]), *self.stop_token_ids]


# A prompts column, (B,) int64: the most tokens each row may generate, below the batch's
# ``max_new_tokens`` (a multi-turn trajectory's room left; ``generation.multi_turn``).
BUDGET_KEY = "token_budget"


def row_budgets(prompts: TensorDict, params: SamplingParams) -> torch.Tensor:
    """(B,) int64 on the prompts' device: the most tokens each row generates, its
    ``BUDGET_KEY`` entry if the prompts carry one, at most ``params.max_new_tokens``. A row
    that reached its budget is finished as one that drew an end token is: it is no longer
    sampled, so a row's tokens never depend on the budgets of the rows beside it."""
    device = prompts["input_ids"].device
    budgets = torch.full((len(prompts),), params.max_new_tokens, dtype=torch.long, device=device)
    if BUDGET_KEY in set(prompts.keys()):
        budgets = torch.minimum(prompts[BUDGET_KEY].to(device=device, dtype=torch.long), budgets)
    return budgets


# A prompts entry (non-tensor, bool): whether a prompt is padded, read where the prompts are
# on the CPU (``mark_prompt_padding``), so that a generation on a GPU knows it without reading the
# device (``prompt_padding``).
PROMPTS_PADDED_KEY = "prompts_padded"


def mark_prompt_padding(prompts: TensorDict, padded: bool | None = None) -> TensorDict:
    """``prompts`` (a shallow copy: the caller's are left as they are) marked with whether
    one of them is ``padded`` (``PROMPTS_PADDED_KEY``); None: read from their attention mask, on the
    CPU."""
    if padded is None:
        mask = prompts["attention_mask"]
        if mask.device.type != "cpu":
            raise ValueError(f"prompts on {mask.device}: mark their padding on the CPU")
        padded = not bool(mask.all())
    marked = prompts.clone(recurse=False)
    marked.set_non_tensor(PROMPTS_PADDED_KEY, padded)
    return marked


def prompt_padding(prompts: TensorDict) -> Padding:
    """The padding of a generation's passes, the prompts' (their mask only grows by ones): as
    :func:`mark_prompt_padding` marked it, else read from the mask (on a GPU, one wait for the device
    a generation). The passes then build their attention masks knowing it
    (``models.varlen.known_padding``), where Hugging Face's check would read the device's
    mask at every decode step."""
    if PROMPTS_PADDED_KEY in set(prompts.keys()):
        padded = bool(prompts.get_non_tensor(PROMPTS_PADDED_KEY))
    else:
        padded = not bool(prompts["attention_mask"].all())
    return Padding.SOME if padded else Padding.NONE


def ended(token: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """(B,) whether each row's ``token`` is one of ``ends`` (1-D; -1 for an unused slot): a
    comparison with each, where ``torch.isin`` sorts past a few rows, through
    ``torch.unique``, whose size the host reads (on a GPU, a wait for the device a step)."""
    return (token[:, None] == ends).any(-1)


class GenerationDiverged(RunFailure):
    """The policy gave non-finite next-token logits: sampling from them would draw garbage."""

    def __init__(self, step: int, rows: int, batch: int) -> None:
        super().__init__(
            f"rollout: non-finite next-token logits at decode step {step} "
            f"({rows} of {batch} rows on this rank); the policy diverged: lower the learning rate"
        )


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


def take_token(
    logits: torch.Tensor,
    params: SamplingParams,
    uniforms: torch.Tensor | None,
    finished: torch.Tensor,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode position of a batch: each row's token and log-probability (a finished
    row's: the pad token, 0), and which unfinished rows' logits are not finite (a policy
    that diverged: sampling from them would draw garbage)."""
    # A row holding a NaN or +inf sums to NaN or +inf (a masked -inf alone, to -inf): one
    # pass, 20x cheaper than isfinite over the vocabulary.
    row_sums = logits.sum(-1)
    nonfinite = (row_sums.isnan() | row_sums.isposinf()) & ~finished
    token, log_prob = sample_next_token(logits, params, uniforms)
    token = torch.where(finished, torch.full_like(token, pad_token_id), token)
    return token, log_prob.masked_fill(finished, 0.0), nonfinite


def agree(flags: torch.Tensor, *, lockstep: bool) -> list[int]:
    """``flags`` (int64 on the sampling device) read on the host, first made their maximum
    over the ranks when in ``lockstep`` (FSDP: every rank must run the same number of decode
    steps, so ranks agree on whether any row still runs, and raise together)."""
    if lockstep:
        all_reduce_max(flags)
    return flags.tolist()


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
        if key in td or key in (BUDGET_KEY, PROMPTS_PADDED_KEY):
            continue
        if isinstance(value, torch.Tensor):
            td.set(key, value)
        else:
            td.set_non_tensor(key, prompts.get_non_tensor(key))
    return td
