"""Log-probs and entropy computed inside the LM head, ``model.logits_chunk_tokens`` tokens at
a time (``core.logits_chunks``, ``workers.forward``), on real Hugging Face models in one
process: a micro-batch within one chunk is the unchunked pass bit for bit; more chunks give
the same log-probs, entropies and gradients, padded and packed, with a temperature, LoRA on
the head, tied embeddings, bf16 and autocast (results in fp32); no tensor of more than one
chunk of tokens x vocab exists, forward or backward; the head is intercepted for one call
only. (Across spawned ranks, DDP and FSDP2: the invariance audit at the end.)"""

import copy

import pytest
import torch
from tensordict import TensorDict
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM

from benchmarks.common import peak_tensor_bytes
from tests.model_support import tiny_gemma2_config
from verlite.audit.invariance import check_invariance, make_batch
from verlite.config import LoraConfig, load_config
from verlite.core.losses import entropy_from_logits, log_probs_from_logits
from verlite.errors import UserError
from verlite.models import build_policy, tiny_hf_config
from verlite.models.logits_chunk import set_logits_chunk_tokens
from verlite.models.varlen import enable_packing
from verlite.step_batch import response_width, trim_padding
from verlite.workers.forward import mark_packed, response_log_probs
from verlite.workers.packing import pack_rows

MAIN = load_config("configs/ppo_tiny.yaml")
# Longer rows than the main job's: prompts of 1..12 and responses of 1..16 tokens.
LONG = load_config(
    "configs/ppo_tiny.yaml", ["data.max_prompt_length=12", "rollout.max_response_length=16"]
)
VOCAB = 97  # the main job's task tokenizer has 62 tokens; make_batch draws ids below 64
TEMPERATURE = 0.7


def policy(cfg=LONG, *, chunk, vocab=VOCAB, lora=None, tied=False, dtype=None):
    kwargs = {"vocab_size": vocab, "max_positions": cfg.max_sequence_length, "seed": 3}
    if tied:
        config = tiny_hf_config(cfg.model, vocab_size=vocab, max_positions=kwargs["max_positions"])
        config.tie_word_embeddings = True
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config)
        assert model.lm_head.weight is model.get_input_embeddings().weight
    else:
        model = build_policy(cfg.model, lora=lora, **kwargs)
    set_logits_chunk_tokens(model, chunk)
    return model if dtype is None else model.to(dtype)


def batch(cfg=LONG, *, rows=6, packed=False):
    td = trim_padding(make_batch(cfg, seed=1, num_sequences=rows))
    if packed:
        mark_packed(td)
    return td


def unchunked(model, td: TensorDict, *, temperature: float):
    """The log-prob pass as it was before chunking: the model's logits of the positions
    that predict response tokens, then log-softmax over the whole micro-batch."""
    packed = "packed" in set(td.keys())
    if packed:
        rows = pack_rows(td)
        logits = model(**rows.model_inputs()).logits[0]
        tokens = rows.from_rows(td["responses"])
    else:
        inputs = {k: td[k] for k in ("input_ids", "attention_mask", "position_ids")}
        logits = model(**inputs, logits_to_keep=response_width(td) + 1).logits[:, :-1]
        tokens = td["responses"]
    logits = logits.float() / temperature
    log_probs, entropy = log_probs_from_logits(logits, tokens), entropy_from_logits(logits)
    if packed:
        return rows.to_rows(log_probs), rows.to_rows(entropy)
    return log_probs, entropy


def with_grads(model, fn):
    """``fn()``'s log-probs and entropy, and the gradients of a mix of both."""
    log_probs, entropy = fn()
    objective = log_probs.sum() + 0.5 * entropy.sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return (log_probs, entropy), torch.autograd.grad(objective, params)


# --------------------------------------------------------------- the default: bit for bit


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("rows", [16, 64])
def test_the_main_jobs_micro_batches_are_the_unchunked_pass_bit_for_bit(rows, packed, temperature):
    """ppo_tiny in fp32: micro-batches of 16 rows (updates) or a step's 64 rows, of up to 4
    response tokens, within the default chunk of 1024 tokens: values and gradients
    torch.equal to the pass before chunking."""
    model = policy(MAIN, chunk=MAIN.model.logits_chunk_tokens)
    if packed:
        enable_packing(model)
    td = batch(MAIN, rows=rows, packed=packed)
    want, want_grads = with_grads(model, lambda: unchunked(model, td, temperature=temperature))
    got, got_grads = with_grads(
        model,
        lambda: response_log_probs(model, td, temperature=temperature, entropy="loss"),
    )
    for w, g in zip((*want, *want_grads), (*got, *got_grads), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


# ------------------------------------------------------------- chunks == one pass


CASES = {
    "padded": {},
    "packed": {"packed": True},
    "lora-on-the-head": {"lora": LoraConfig(rank=4, target_modules=["q_proj", "lm_head"])},
    "tied-embeddings": {"tied": True},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [1, 3, 4096])
def test_chunks_give_the_unchunked_log_probs_entropy_and_gradients(case, chunk):
    options = dict(CASES[case])
    packed = options.pop("packed", False)
    model = policy(chunk=chunk, **options)
    if "lora" in options:
        with torch.no_grad():  # B starts at zero: give the head's adapter a say
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(std=0.1)
    if packed:
        enable_packing(model)
    td = batch(packed=packed)
    want, want_grads = with_grads(model, lambda: unchunked(model, td, temperature=TEMPERATURE))
    got, got_grads = with_grads(
        model,
        lambda: response_log_probs(model, td, temperature=TEMPERATURE, entropy="loss"),
    )
    # fp32 rounding: a weight's gradient is summed over up to 100 chunks instead of one matmul
    for w, g in zip((*want, *want_grads), (*got, *got_grads), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.detach().abs().max()))


@pytest.mark.parametrize("mode", ["bf16-params", "autocast-bf16"])
def test_bf16_compute_gives_fp32_log_probs_chunk_for_chunk(mode):
    """The head's bf16 logits are cast to fp32 before the log-softmax, by chunk or not."""
    dtype = torch.bfloat16 if mode == "bf16-params" else None
    td = batch()
    results = []
    for chunk in (3, 4096):
        model = policy(chunk=chunk, dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast-bf16"):
            (log_probs, entropy), grads = with_grads(
                model,
                lambda m=model: response_log_probs(m, td, temperature=TEMPERATURE, entropy="loss"),
            )
        assert log_probs.dtype == entropy.dtype == torch.float32
        results.append((log_probs, entropy, *grads))
    # The same bf16 logits of each token, whichever chunk computed them; the head's weight
    # gradient alone is summed differently: over chunks, each product rounded to bf16
    # (relative 6e-3 here), against one bf16 product of the whole micro-batch.
    names = ["log_probs", "entropy", *(n for n, _ in model.named_parameters())]
    for name, chunked, whole in zip(names, *results, strict=True):
        if name == "lm_head.weight":
            assert float((chunked - whole).float().norm() / whole.float().norm()) < 1e-2
        else:
            torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5, msg=name)


# ---------------------------------------------------------------------- memory


class LargestLogits(TorchDispatchMode):
    """The most tokens of any tensor with a ``vocab``-sized last dimension that an op
    allocates (aliases of its inputs aside: the head's weight transposed is a view)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.tokens = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        aliased = {t.untyped_storage().data_ptr() for t in inputs}
        for t in tree_flatten(out)[0]:
            fresh = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in aliased
            if fresh and t.dim() and t.shape[-1] == self.vocab:
                self.tokens = max(self.tokens, t.numel() // self.vocab)
        return out


# A vocabulary far wider than the model, so that logits dominate what a pass holds.
WIDE = load_config(
    "configs/ppo_tiny.yaml",
    ["data.max_prompt_length=12", "rollout.max_response_length=16", "model.hidden_size=16"],
)
WIDE_VOCAB = 16384


@pytest.mark.parametrize("chunk", [8, 4096], ids=["chunked", "negative-control"])
def test_no_more_than_a_chunk_of_logits_exists_forward_or_backward(chunk):
    model = policy(WIDE, chunk=chunk, vocab=WIDE_VOCAB)
    model.get_input_embeddings().requires_grad_(False)  # its (vocab, hidden) gradient aside
    td = batch(WIDE, rows=12)
    tokens = int(td["response_mask"].numel())
    assert tokens > 16 * 8

    def forward_backward():
        log_probs, entropy = response_log_probs(model, td, temperature=TEMPERATURE, entropy="loss")
        (log_probs.sum() + entropy.sum()).backward()

    with LargestLogits(WIDE_VOCAB) as seen:
        forward_backward()
    peak = peak_tensor_bytes(forward_backward)
    whole = tokens * WIDE_VOCAB * 4  # the micro-batch's fp32 logits, one tensor
    if chunk < tokens:
        assert 0 < seen.tokens <= chunk
        assert peak < whole, (peak, whole)
    else:  # the control: the micro-batch in one chunk holds its whole logits, and more
        assert seen.tokens == tokens
        assert peak > 3 * whole, (peak, whole)


def test_inference_passes_chunk_too():
    """Old and reference log-probs run under no_grad: the same values, chunked or not."""
    td = batch(packed=True)
    with torch.no_grad():
        results = []
        for chunk in (3, 4096):
            model = policy(chunk=chunk)
            enable_packing(model)
            results.append(response_log_probs(model, td, temperature=1.0, entropy="none"))
    assert results[0][1] is None
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ the head, intercepted


def test_the_head_is_intercepted_for_one_call_and_state_dicts_do_not_see_it():
    model = policy(chunk=3)
    plain = AutoModelForCausalLM.from_config(model.config)
    assert list(model.state_dict()) == list(plain.state_dict())
    reference = copy.deepcopy(model)
    td = batch()
    before, _ = response_log_probs(reference, td, temperature=1.0, entropy="none")
    assert "forward" not in vars(model.lm_head) and "forward" not in vars(reference.lm_head)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # the copy's head is its own
    after, _ = response_log_probs(reference, td, temperature=1.0, entropy="none")
    assert torch.equal(before, after)
    # a plain call (the sampler's) gets the logits
    logits = model(input_ids=td["input_ids"][:, :4]).logits
    assert logits.shape == (*td["input_ids"][:, :4].shape, VOCAB)


def test_a_model_that_changes_its_heads_output_is_refused_in_one_line():
    """Gemma 2 soft-caps its logits after the head: the log-probs would be soft-capped."""
    config = tiny_gemma2_config(vocab_size=VOCAB, final_logit_softcapping=30.0)
    model = AutoModelForCausalLM.from_config(config)
    set_logits_chunk_tokens(model, 1024)
    with pytest.raises(UserError, match=r"Gemma2ForCausalLM does not return its LM head"):
        response_log_probs(model, batch(), temperature=1.0, entropy="none")
    assert "forward" not in vars(model.lm_head)


def test_a_model_without_a_chunk_size_is_refused():
    model = AutoModelForCausalLM.from_config(policy(chunk=3).config)
    with pytest.raises(ValueError, match="no logits chunk size"):
        response_log_probs(model, batch(), temperature=1.0, entropy="none")


# ------------------------------------------------------- across ranks: the audit


def test_the_invariance_audit_passes_with_chunks_of_three_tokens():
    """Every micro-batch here is several chunks, recomputed in backward under DDP and under
    FSDP2 (whose root module holds the head's weight unsharded only in its forward and
    backward); the negative control still fails."""
    cfg = load_config(
        "configs/ppo_tiny.yaml", ["model.dtype=float64", "model.logits_chunk_tokens=3"]
    )
    reports = check_invariance(
        cfg, dps=[1, 2], strategies=["ddp", "fsdp"], micros=["2", "packed"], roles=["actor"]
    )
    assert len(reports) == 8
    failures = [r for r in reports if r.worst() > 1e-9]
    assert not failures, failures
    naive = check_invariance(
        cfg, dps=[2], strategies=["fsdp"], micros=["packed"], roles=["actor"], naive=True
    )
    assert naive[0].worst() > 1e-3
