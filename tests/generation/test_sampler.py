"""The native sampler: matches Hugging Face greedy decoding, stops at EOS, samples correctly;
every test runs on both decode paths, eager and static (``verlite.generation.decode``)."""

from functools import partial

import pytest
import torch
from tensordict import TensorDict

from verlite.config import ModelConfig
from verlite.data import position_ids
from verlite.distributed import run_on_ranks
from verlite.generation import (
    DecodeSettings,
    KeyedNoise,
    Sampler,
    SamplingParams,
    sample_keys,
    sample_next_token,
)
from verlite.generation.sampler import Sampler as RealSampler
from verlite.generation.sampling import GenerationDiverged
from verlite.models import build_policy
from verlite.workers.forward import response_log_probs

EOS, PAD, VOCAB = 2, 0, 40
MODES = ["eager", "static"]


@pytest.fixture(autouse=True, params=MODES)
def decode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every ``Sampler`` a test of this module builds decodes this way."""
    monkeypatch.setattr(
        f"{__name__}.Sampler", partial(RealSampler, decode=DecodeSettings(request.param))
    )
    return request.param


def model() -> torch.nn.Module:
    return build_policy(ModelConfig(precision="fp64"), vocab_size=VOCAB, max_positions=64, seed=0)


def keyed(td: TensorDict, seed: int) -> KeyedNoise:
    """The noise of one step's rows, one sample per prompt."""
    return KeyedNoise(sample_keys(seed, 1, len(td), 1), horizon=16)


def prompts(batch: int = 12, width: int = 9, seed: int = 0) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = (torch.arange(width) >= width - lengths[:, None]).long()
    ids = torch.randint(3, VOCAB, (batch, width), generator=gen) * mask
    positions = position_ids(mask)
    td = TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": positions,
            "uid": torch.arange(batch),
        },
        batch_size=[batch],
    )
    td.set_non_tensor("temperature", 1.0)
    return td


def test_greedy_matches_hugging_face_generate() -> None:
    m, td = model(), prompts()
    out = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False).generate(
        td, SamplingParams(12, temperature=0), keyed(td, 0)
    )
    hf = m.generate(
        input_ids=td["input_ids"],
        attention_mask=td["attention_mask"],
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    expected = torch.nn.functional.pad(hf[:, td["input_ids"].shape[1] :], (0, 12), value=PAD)[
        :, :12
    ]
    assert torch.equal(out["responses"], expected)


def test_eos_ends_a_response_and_the_layout_is_consistent() -> None:
    m = model()
    with torch.no_grad():  # make EOS likely so some rows stop early
        m.lm_head.bias = None
        m.lm_head.weight[EOS] += 0.4 * m.lm_head.weight.norm(dim=-1).mean()
    td = prompts(batch=16)
    out = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False).generate(
        td, SamplingParams(10), keyed(td, 3)
    )
    responses, mask = out["responses"], out["response_mask"]
    lengths = mask.sum(-1)
    assert 0 < int((lengths < 10).sum()) < 16, "expected some rows to stop early"
    for row, n in zip(responses, lengths.tolist(), strict=True):
        if n < 10:
            assert row[n - 1] == EOS and (row[: n - 1] != EOS).all()
        assert (row[n:] == PAD).all()
    assert torch.equal(out["input_ids"][:, -10:], responses)
    assert torch.equal(out["attention_mask"][:, -10:], mask)
    assert torch.equal(out["uid"], td["uid"]) and out.get_non_tensor("temperature") == 1.0
    # the positions of the full sequence continue the prompt's
    full = out["attention_mask"]
    assert torch.equal(out["position_ids"], position_ids(full))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_sampled_tokens_have_the_probabilities_the_trainer_computes(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log-probs the trainer recomputes (one padded forward over prompt + response) are
    those of the distributions the sampler drew each token from (KV-cached, step by step):
    in float64 from the sampler's logits, and in float32 as ``rollout_log_probs`` reports."""
    drawn: list[torch.Tensor] = []

    def recording(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor):
        token, log_prob = sample_next_token(logits, params, uniforms)
        scaled = logits.double() / params.temperature
        drawn.append(scaled.log_softmax(-1).gather(-1, token[:, None]).squeeze(-1))
        return token, log_prob

    monkeypatch.setattr("verlite.generation.sampling.sample_next_token", recording)
    m, td = model(), prompts()
    td.set_non_tensor("temperature", temperature)
    out = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False).generate(
        td, SamplingParams(6, temperature=temperature), keyed(td, 1)
    )
    with torch.no_grad():
        log_probs, _ = response_log_probs(m, out, temperature=temperature, entropy="none")
    sampler = torch.stack(drawn, dim=1)[:, : log_probs.shape[1]]
    mask = out["response_mask"].bool()
    assert mask.sum() > 30 and sampler.shape == log_probs.shape
    torch.testing.assert_close(log_probs[mask], sampler[mask], rtol=0, atol=1e-9)
    reported = out["rollout_log_probs"]
    assert reported.dtype == torch.float32 and (reported[~mask] == 0).all()
    torch.testing.assert_close(reported[mask].double(), log_probs[mask], rtol=0, atol=2e-6)


def test_rollout_log_probs_are_those_of_the_truncated_distribution() -> None:
    """With top-k the sampler draws from the kept tokens renormalized: each token's reported
    log-prob exceeds the policy's by log(1 / kept mass) of its step, exactly."""
    m, td = model(), prompts()
    params = SamplingParams(6, top_k=3)
    td.set_non_tensor("temperature", 1.0)
    out = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False).generate(
        td, params, keyed(td, 2)
    )
    mask = out["response_mask"].bool()
    with torch.no_grad():
        logits = m(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
        ).logits
    width = out["responses"].shape[1]
    step_logits = logits[
        :, -width - 1 : -1
    ].double()  # the logits each response token was drawn from
    policy = step_logits.log_softmax(-1).gather(-1, out["responses"][..., None]).squeeze(-1)
    kept_mass = step_logits.softmax(-1).topk(3, dim=-1).values.sum(-1)
    expected = policy - kept_mass.log()
    reported = out["rollout_log_probs"].double()
    assert (kept_mass[mask] < 1 - 1e-3).all()  # truncation matters at every step
    torch.testing.assert_close(reported[mask], expected[mask], rtol=0, atol=2e-6)


def test_same_seed_same_samples_and_top_k_1_is_greedy() -> None:
    m, td = model(), prompts()
    rollout = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False)
    a = rollout.generate(td, SamplingParams(8), keyed(td, 5))["responses"]
    b = rollout.generate(td, SamplingParams(8), keyed(td, 5))["responses"]
    c = rollout.generate(td, SamplingParams(8), keyed(td, 6))["responses"]
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = rollout.generate(td, SamplingParams(8, temperature=0), keyed(td, 0))["responses"]
    assert torch.equal(
        rollout.generate(td, SamplingParams(8, top_k=1), keyed(td, 9))["responses"], greedy
    )


@pytest.mark.parametrize(
    ("top_k", "top_p", "allowed"),
    [(2, 1.0, {0, 1}), (0, 0.5, {0}), (0, 0.6, {0, 1}), (3, 0.95, {0, 1, 2})],
)
def test_top_k_and_top_p_restrict_the_support(top_k: int, top_p: float, allowed: set[int]) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4)
    uniforms = torch.rand(4000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    drawn, _ = sample_next_token(logits, SamplingParams(1, top_k=top_k, top_p=top_p), uniforms)
    assert set(drawn.tolist()) == allowed


def _lockstep(rank: int, world: int, mode: str) -> list[int]:
    from verlite.distributed import apply_fsdp

    m = apply_fsdp(model())
    td = prompts(batch=4, seed=rank)
    with torch.no_grad():  # rank 0 always emits EOS at once, rank 1 never: lengths differ
        bias = torch.full((VOCAB,), -1e4 if rank else 0.0, dtype=torch.float64)
        bias[EOS] = 1e4 if rank == 0 else -1e4
    m.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    out = RealSampler(
        m, eos_token_id=EOS, pad_token_id=PAD, lockstep=True, decode=DecodeSettings(mode)
    ).generate(td, SamplingParams(5), keyed(td, 0))
    return out["response_mask"].sum(-1).tolist()


def test_fsdp_ranks_stay_in_lockstep_when_lengths_differ(decode: str) -> None:
    lengths = run_on_ranks(_lockstep, world_size=2, args=(decode,), timeout_s=120)
    assert lengths == [[1, 1, 1, 1], [5, 5, 5, 5]]


def _poison(
    m: torch.nn.Module, *, rows: list[int], from_step: int, value: float = float("nan")
) -> None:
    """From decode step ``from_step`` on, one logit of each given row is ``value``."""
    calls = [0]

    def hook(mod: torch.nn.Module, inp: object, out: torch.Tensor) -> torch.Tensor:
        if calls[0] >= from_step:
            out = out.clone()
            out[rows, :, 5] = value
        calls[0] += 1
        return out

    m.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_logits_stop_generation_with_a_named_error(temperature: float, value: float) -> None:
    m = model()
    _poison(m, rows=[3], from_step=2, value=value)
    rollout = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False)
    with pytest.raises(GenerationDiverged, match=r"decode step 2 \(1 of 12 rows on this rank\)"):
        td = prompts()
        rollout.generate(td, SamplingParams(6, temperature=temperature), keyed(td, 0))


def test_a_masked_token_at_minus_inf_is_not_divergence() -> None:
    m = model()
    _poison(m, rows=[0, 3], from_step=0, value=float("-inf"))
    td = prompts()
    out = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False).generate(
        td, SamplingParams(6), keyed(td, 0)
    )
    assert not (out["responses"][[0, 3]] == 5).any()  # the masked token is never drawn


def test_nan_logits_of_a_finished_row_are_ignored() -> None:
    m = model()
    with torch.no_grad():  # every row emits EOS at once; later logits of those rows are unused
        bias = torch.full((VOCAB,), -1e4, dtype=torch.float64)
        bias[EOS] = 1e4
    m.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    _poison(m, rows=[0], from_step=1)
    td = prompts(batch=4)
    out = Sampler(m, eos_token_id=EOS, pad_token_id=PAD, lockstep=False).generate(
        td, SamplingParams(5), keyed(td, 0)
    )
    assert out["response_mask"].sum(-1).tolist() == [1, 1, 1, 1]


def _diverge_on_rank_1(rank: int, world: int, mode: str) -> str:
    from verlite.distributed import apply_fsdp

    m = apply_fsdp(model())
    if rank == 1:
        _poison(m, rows=[0], from_step=1)
    try:
        td = prompts(batch=4, seed=rank)
        RealSampler(
            m, eos_token_id=EOS, pad_token_id=PAD, lockstep=True, decode=DecodeSettings(mode)
        ).generate(td, SamplingParams(5), keyed(td, 0))
    except GenerationDiverged as exc:
        return str(exc)
    return "no error"


def test_nan_logits_on_one_fsdp_rank_stop_every_rank(decode: str) -> None:
    """A rank that raised alone would leave the others waiting in the next all-gather."""
    messages = run_on_ranks(_diverge_on_rank_1, world_size=2, args=(decode,), timeout_s=120)
    assert "decode step 1 (0 of 4 rows on this rank)" in messages[0]
    assert "decode step 1 (1 of 4 rows on this rank)" in messages[1]
