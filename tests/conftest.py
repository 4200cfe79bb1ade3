"""Shared test settings: deterministic, single-threaded torch (several ranks share 2 cores)."""

import torch

torch.set_num_threads(1)
