"""The micro-batch loops of an update and of an inference pass, padded and packed, make no
host sync on the device's tensors: no op whose result size or value the host must read
(``.item()``/``.tolist()``/``bool()``, ``nonzero``, a boolean mask as an index,
``masked_select``, ``unique``) and no tensor built from host values inside the loop (a
blocking copy to a GPU). On a GPU each of these waits for the micro-batches queued before.

There is no GPU here, so the test tracks which tensors would be on the device: the model's
parameters and whatever ``train_engine.to_device`` copies, and every tensor an op computes
from one of them. A sync op is counted when it reads such a tensor between the start of the
loop and its end (the gradient clipping of an update, the row order of an inference pass);
the CPU work of ``micro_batch`` before its copy reads none. None is allowed, Hugging Face's
own included: its check of a 2-D attention mask (``_ignore_causal_mask_sdpa``: whether the
mask may be skipped) and its look for packed sequences in the positions of a pass without a
mask or a KV cache (``find_packed_sequence_indices``) are left out by telling the pass its
padding, which the engine read on the CPU (``models.varlen.known_padding``). After the loop
an update still reads its gradient norm (finite or not) and its metrics, once each.
"""

from functools import partial

import pytest
import torch
from tensordict import TensorDict

from tests.host_sync_support import DeviceSyncs, described
from verlite.audit.invariance import make_batch
from verlite.config import load_config
from verlite.models import build_policy, build_value_model
from verlite.workers import train_engine
from verlite.workers.forward import response_log_probs, response_values
from verlite.workers.objectives import ActorLossSettings, CriticLossSettings, ppo_loss, value_loss
from verlite.workers.packing import PackedRows

CONFIG = load_config("configs/ppo_tiny.yaml", ["actor.use_kl_loss=true"])
LAYOUTS = {
    "padded": {"micro_batch_size_per_worker": 3},
    "packed": {"packing": True, "use_dynamic_bsz": True, "max_token_len_per_worker": 40},
    "packed-checkpointed": {
        "packing": True,
        "micro_batch_size_per_worker": 5,
        "gradient_checkpointing": True,
    },
}


@pytest.fixture
def syncs(monkeypatch):
    mode = DeviceSyncs()

    def copied(value, device):
        copy = value.clone()
        if isinstance(copy, TensorDict):
            mode.put(list(copy.values(include_nested=True, leaves_only=True)))
        return mode.put(copy)

    def micro_batch(*args, **kwargs):
        mode.in_loop = mode.in_micro_batch = True
        try:
            return real_micro_batch(*args, **kwargs)
        finally:
            mode.in_micro_batch = False

    def loop_ended(real):
        def call(*args, **kwargs):
            mode.in_loop = False
            return real(*args, **kwargs)

        return call

    real_micro_batch = train_engine.micro_batch
    monkeypatch.setattr(train_engine, "to_device", copied)
    monkeypatch.setattr(train_engine, "micro_batch", micro_batch)
    monkeypatch.setattr(train_engine, "clip_grad_norm", loop_ended(train_engine.clip_grad_norm))
    monkeypatch.setattr(
        train_engine, "inverse_permutation", loop_ended(train_engine.inverse_permutation)
    )
    return mode


def engines(layout: str, mode: DeviceSyncs):
    cfg = CONFIG.actor.model_copy(update=LAYOUTS[layout])
    kwargs = {"vocab_size": 64, "max_positions": CONFIG.max_sequence_length, "seed": 0}
    built = []
    for build, prefix in ((build_policy, "actor"), (build_value_model, "critic")):
        engine = train_engine.TrainEngine(
            build(CONFIG.model, **kwargs), cfg=cfg, total_updates=1, metric_prefix=prefix
        )
        mode.put([*engine.model.parameters(), *engine.model.buffers()])
        built.append(engine)
    return built


def log_probs(model, td):
    return {"log_probs": response_log_probs(model, td, temperature=1.0, entropy="none")[0]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_micro_batch_loops_wait_for_no_device_value(layout: str, syncs) -> None:
    actor, critic = engines(layout, syncs)
    batch = make_batch(CONFIG)
    with syncs:
        actor.train_mini_batch(
            batch, partial(ppo_loss, settings=ActorLossSettings.from_config(CONFIG.actor))
        )
        critic.train_mini_batch(
            batch, partial(value_loss, settings=CriticLossSettings.from_config(CONFIG.critic))
        )
        actor.infer(batch, log_probs)
        critic.infer(batch, lambda model, td: {"values": response_values(model, td)})
    assert described(syncs.hits) == []


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_the_tracking_sees_hugging_faces_checks_of_padding_it_is_not_told(
    layout: str, syncs, monkeypatch
) -> None:
    """What the test above would see: a pass not told its padding (the engine's mark left
    out; a packed row without its all-ones mask) has Hugging Face check the device's mask,
    or the positions, once per forward."""
    monkeypatch.setattr(train_engine, "mark_padding", lambda td, padded: None)
    inputs = PackedRows.model_inputs
    monkeypatch.setattr(
        PackedRows, "model_inputs", lambda self: inputs(self) | {"attention_mask": None}
    )
    actor, _ = engines(layout, syncs)
    with syncs:
        actor.infer(make_batch(CONFIG), log_probs)
    check = "_ignore_causal_mask_sdpa" if layout == "padded" else "find_packed_sequence_indices"
    assert syncs.hits
    assert all(any(f.name == check for f in stack) for _, stack in syncs.hits)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_micro_batch_goes_to_a_gpu_from_dense_pinned_memory(packing: bool, monkeypatch) -> None:
    """Pinning keeps a tensor's strides, and CUDA copies a strided host tensor through a
    contiguous temporary in pageable memory, whose copy waits for the device's queue: every
    tensor ``to_device`` pins must be dense. A trimmed micro-batch's columns are views of the
    batch's (``trim_padding``). Without a GPU here the pinning is recorded and the copy to
    the device left out."""
    pinned: list[torch.Tensor] = []
    real_to = torch.Tensor.to

    def pin_memory(self, *args, **kwargs):
        pinned.append(self)
        return self

    def to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cuda":
            return self
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    batch = make_batch(CONFIG)
    train_engine.micro_batch(batch, [1, 3], device=torch.device("cuda", 0), packing=packing)
    assert pinned and [tuple(t.shape) for t in pinned if not t.is_contiguous()] == []
