"""A decode loop reads the device once per step, for whether to stop: the eager sampler's
``agree`` and the static path's ``_check`` (a step behind, its flags copied while the next
step runs). Nothing else waits for the device per step, nor per generation when the
prompts were marked on the CPU (``sampling.mark_prompt_padding``, as the workers do): not Hugging
Face's check of a 2-D attention mask (``_ignore_causal_mask_sdpa``, once per forward),
which the passes leave out knowing the prompts' padding (``varlen.known_padding``), and not
``torch.isin`` (on a GPU it sorts through ``torch.unique`` past a few rows).

Counted with ``tests/host_sync_support.py`` on CPU: the model's tensors, the prompts and the
noise's keys, and whatever the generation allocates, are taken as on the device; the static
path runs its steps eagerly (``rollout.decode=static``, as on CPU)."""

from __future__ import annotations

import collections

import pytest
import torch

from tests.generation.test_sampler import EOS, PAD, VOCAB, prompts
from tests.generation.test_static_decode import SETTINGS, assert_same, llama, noise
from tests.host_sync_support import DeviceSyncs
from tests.model_support import tiny_qwen2, tiny_sliding
from verlite.data import position_ids
from verlite.generation import DecodeSettings, Sampler
from verlite.generation.sampling import BUDGET_KEY, PROMPTS_PADDED_KEY, mark_prompt_padding

BUCKETS = (2, 4, 8)


def unpadded(td):  # type: ignore[no-untyped-def]
    td["attention_mask"] = torch.ones_like(td["attention_mask"])
    td["position_ids"] = position_ids(td["attention_mask"])
    return td


def generation_syncs(mode: str, padded: bool) -> tuple[collections.Counter[tuple[str, str]], int]:
    """The syncs of one generation of marked prompts, as (the verlite function that made it,
    the op), and its steps."""
    model, td = llama("fp64"), prompts(batch=12, width=9, seed=1)
    if not padded:
        unpadded(td)
    td[BUDGET_KEY] = torch.arange(12) % 9 + 2  # rows end at different steps: compaction
    td = mark_prompt_padding(td)
    decode = DecodeSettings(mode, batch_buckets=BUCKETS)
    sampler = Sampler(model, eos_token_id=EOS, pad_token_id=PAD, lockstep=False, decode=decode)
    keyed = noise(td, 4, 14)
    syncs = DeviceSyncs()
    syncs.put([*model.parameters(), *model.buffers(), *td.values(), keyed.keys])
    syncs.in_loop = syncs.allocates = True
    with syncs:
        out = sampler.generate(td, SETTINGS["sampled"], keyed)
    assert PROMPTS_PADDED_KEY not in set(out.keys())
    steps = int(out["response_mask"].sum(-1).max())
    return collections.Counter(
        (next(f.name for f in reversed(stack) if "/verlite/" in f.filename), _name(op))
        for op, stack in syncs.hits
    ), steps


def _name(op: str) -> str:
    """``nonzero`` for ``aten.nonzero.default``; a method's name (``tolist``) as it is."""
    return op.split(".")[1] if op.startswith("aten.") else op


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("mode", ["eager", "static"])
def test_a_decode_step_reads_the_device_only_for_whether_to_stop(mode: str, padded: bool) -> None:
    found, steps = generation_syncs(mode, padded)
    if mode == "eager":
        # Each step's termination read; the end tokens copied to the device once.
        assert found == {("agree", "tolist"): steps, ("_generate", "lift_fresh"): 1}
        return
    # Each step's flags, read a step behind (one step runs after the last row finished);
    # the first rows' state and the end tokens written into the held buffers; per bucket
    # the unfinished rows are compacted into (at most one per bucket below the batch):
    # which rows they are, and two writes of host numbers (the filling rows' state).
    compactions = found[("_compact", "nonzero")]
    assert 1 <= compactions <= len(BUCKETS)
    assert found == {
        ("_check", "tolist"): steps + 1,
        ("_start", "lift_fresh"): 2,
        ("_compact", "nonzero"): compactions,
        ("_compact", "lift_fresh"): 2 * compactions,
    }


MODELS = {
    "llama-fp32": lambda: llama("fp32"),
    "llama-fp64": lambda: llama("fp64"),
    "qwen2-tied": lambda: tiny_qwen2(tied=True, vocab_size=VOCAB),
    # Every layer slides, over a window shorter than the sequences (eager only: the static
    # path refuses a window a sequence passes).
    "mistral-window-6": lambda: tiny_sliding("mistral", 6, vocab_size=VOCAB),
}


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("mode", ["eager", "static"])
@pytest.mark.parametrize("name", list(MODELS))
def test_known_padding_samples_what_hugging_faces_checks_do_bit_for_bit(
    name: str, mode: str, padded: bool
) -> None:
    """The sampler's model on verlite's attention, its masks built from the marked padding,
    against the same model on Hugging Face's SDPA attention (which reads the device's mask):
    the same tokens and log-probs, bit for bit."""
    if mode == "static" and name.startswith("mistral"):
        pytest.skip("the static path refuses a window a sequence passes")
    model = MODELS[name]()
    td = prompts(batch=12, width=9, seed=1)
    if not padded:
        unpadded(td)
    decode = DecodeSettings(mode, batch_buckets=BUCKETS)
    sampler = Sampler(model, eos_token_id=EOS, pad_token_id=PAD, lockstep=False, decode=decode)
    params = SETTINGS["top_k_top_p"]
    ours = sampler.generate(mark_prompt_padding(td), params, noise(td, 4, 14))
    model.set_attn_implementation("sdpa")
    assert_same(sampler.generate(td, params, noise(td, 4, 14)), ours.exclude(PROMPTS_PADDED_KEY))


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_a_worker_marks_its_prompts_padding_before_moving_them(padded: bool) -> None:
    """``PolicyWorker.sample`` reads the padding from the prompts as they arrive, on the CPU,
    and the generation gets it marked (the caller's prompts are left unmarked). Mutation:
    ``sample`` without ``mark_prompt_padding`` (the sampler then reads the device's mask once a
    generation)."""
    from types import SimpleNamespace

    from verlite.config import load_config
    from verlite.workers.policy_worker import PolicyWorker

    td = prompts(batch=4, width=5, seed=1)
    if not padded:
        unpadded(td)
    assert bool(td["attention_mask"].all()) != padded
    seen = []
    worker = SimpleNamespace(cfg=load_config("configs/ppo_tiny.yaml"), noise=lambda *a: None)

    def generate(given, params, noise):  # type: ignore[no-untyped-def]
        seen.append(given.get_non_tensor(PROMPTS_PADDED_KEY))
        return given

    PolicyWorker.sample(worker, generate, td, SETTINGS["greedy"], 0, None, device=td.device)  # type: ignore[arg-type]
    assert seen == [padded] and PROMPTS_PADDED_KEY not in set(td.keys())
