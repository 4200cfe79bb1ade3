"""The actor's fused ``rollout`` call returns exactly what ``generate`` followed by
``compute_log_probs`` returns: the same rows, tokens, old and reference log-probs."""

import pytest
import torch

from verlite.config import load_config
from verlite.data import build_datasets, load_tokenizer, prompt_tensordict
from verlite.rollout import SamplingParams
from verlite.workers.actor import ActorWorker


@pytest.mark.parametrize("kl_in_reward", ["false", "true"])
def test_rollout_equals_generate_then_log_probs(kl_in_reward: str, tmp_path: object) -> None:
    cfg = load_config(
        "configs/ppo_tiny.yaml",
        [
            f"algorithm.use_kl_in_reward={kl_in_reward}",
            "actor.use_kl_loss=false",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    tokenizer = load_tokenizer(None, task=cfg.data.task)
    train_set, _ = build_datasets(cfg, tokenizer)
    worker = ActorWorker(
        rank=0,
        world_size=1,
        torch_threads=1,
        role="actor",
        cfg=cfg,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    worker.init_model()
    prompts = prompt_tensordict(
        train_set[:8],
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        repeat=2,
        temperature=1.0,
    )
    sampling = SamplingParams(max_new_tokens=cfg.rollout.max_response_length)

    fused = worker.rollout(prompts, sampling, 7)
    separate = worker.generate(prompts, sampling, 7)
    separate.update(worker.compute_log_probs(separate))

    keys = sorted(separate.keys())  # iterating a TensorDict itself walks its rows
    assert sorted(fused.keys()) == keys
    assert ("ref_log_prob" in keys) == (kl_in_reward == "true")
    for key in keys:
        assert torch.equal(torch.as_tensor(fused[key]), torch.as_tensor(separate[key])), key
    assert bool(fused["response_mask"].any()) and bool((fused["old_log_probs"] < 0).any())
