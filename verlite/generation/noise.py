"""Where sampling's random numbers come from: one uniform per row and decode position.

``KeyedNoise`` makes a run independent of its layout. Each response row carries a key
(``sample_keys``): a hash of the run seed, the step, the prompt's position in the step's
batch (the data order fixes it) and the sample index within ``rollout.n``. The uniform
drawn at decode position ``t`` is a hash of (key, t), computed for the whole batch with a
few integer tensor ops. A response's tokens then depend on its key and its logits alone:
not on the rank that generated it, the number of workers, or the rows it shares a batch with.

``StreamNoise`` is a ``torch.Generator`` stream, one per rank: the rows' draws depend on
their position in the rank's share. It is ``rollout.randomness=per_rank``, kept as the
negative control of ``verlite check-invariance --run``.

The hash is MurmurHash3's 32-bit finalizer, computed in int64 tensors (or Python ints)
without overflow (``_mul32``).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, overload

import torch
from tensordict import TensorDict

MASK32 = 0xFFFF_FFFF
_KEY_LANES = (0x5BD1_E995, 0x1B87_3593)  # one salt per 32-bit half of a key
_DRAW_LANES = (0x68E3_1DA4, 0xB529_7A4D)  # one salt per half of a 53-bit uniform

Int = TypeVar("Int", int, torch.Tensor)


def _mul32(x: Int, constant: int) -> Int:
    """``x * constant mod 2**32`` for 32-bit ``x`` and ``constant``: a constant of 2**31 or
    more is taken as ``constant - 2**32`` (the same modulo 2**32), so that the int64 product
    stays below 2**63 in magnitude; masking a negative product keeps its two's-complement
    low 32 bits, in torch as in Python."""
    signed = constant - 2**32 if constant >= 2**31 else constant
    return (x * signed) & MASK32


def fmix32(x: Int) -> Int:
    """MurmurHash3's finalizer: a bijection of 32-bit values in which every input bit
    flips each output bit with probability about 1/2."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EB_CA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2_AE35)
    return x ^ (x >> 16)


@overload
def _hash(values: list[int], salt: int) -> int: ...  # type: ignore[overload-overlap]  # no caller passes ints alone in a list typed with tensors
@overload
def _hash(values: list[int | torch.Tensor], salt: int | torch.Tensor) -> torch.Tensor: ...
def _hash(values: list[Any], salt: Any) -> Any:
    """A 32-bit hash of a sequence of 32-bit values: an int for ints, a tensor (of the
    values' and salts' broadcast shape) when any value or the salt is one (``int ^ tensor``
    is a tensor), which fmix32's constrained type cannot follow through the loop. A tensor
    of salts hashes under each of them in one pass (the lanes of a key), each element as
    its own salt would."""
    h: Any = fmix32(salt)  # an int until the first tensor value, unless the salts are one
    for value in values:
        h = fmix32(h ^ fmix32((value ^ salt) & MASK32))
    return h


def sample_keys(
    seed: int, step: int, num_prompts: int, n: int, *, first_prompt: int = 0
) -> torch.Tensor:
    """The (num_prompts * n, 2) int64 keys of a step's rows, prompt-major (row ``i * n + j``
    is sample ``j`` of prompt ``first_prompt + i``): two 32-bit hashes of (seed, step, prompt,
    j). A step's prompts are numbered across its draws (``algorithm.dynamic_sampling``), so
    no two of its rows share a key."""
    prompt = torch.arange(first_prompt, first_prompt + num_prompts, dtype=torch.int64)
    prompt = prompt.repeat_interleave(n)
    sample = torch.arange(n, dtype=torch.int64).repeat(num_prompts)
    values: list[int | torch.Tensor] = [
        seed & MASK32,
        (seed >> 32) & MASK32,
        step & MASK32,
        prompt[:, None],
        sample[:, None],
    ]
    # Both lanes in one pass: the (rows, 1) values broadcast against the (2,) salts.
    return _hash(values, torch.tensor(_KEY_LANES, dtype=torch.int64))


def turn_keys(keys: torch.Tensor, turn: int) -> torch.Tensor:
    """The keys a multi-turn trajectory samples its turn ``turn`` with: its own keys for the
    first turn (a single-turn run draws the same), then a hash of (key, turn), so that no
    two turns reuse each other's uniforms."""
    if turn == 0:
        return keys
    return torch.stack(
        [_hash([keys[:, lane], turn], salt) for lane, salt in enumerate(_KEY_LANES)], dim=-1
    )


class Noise(Protocol):
    def uniforms(self, position: int) -> torch.Tensor:
        """(rows,) float64 uniforms in [0, 1) for decode position ``position``."""
        ...


def _position_salts(positions: torch.Tensor) -> torch.Tensor:
    """(..., 2) int64: the hashes of decode ``positions`` (int64, on the keys' device) mixed
    into the keys, computed where they are: built on the host, they would be copied to a GPU
    from pageable memory, which waits for its queue."""
    return torch.stack([_hash([positions], salt) for salt in _DRAW_LANES], dim=-1)


class KeyedNoise:
    """Uniforms that depend on each row's key and the decode position only.

    They are computed for a block of positions at a time (up to ``horizon``, the most a
    generation draws, and at most ``MAX_BLOCK``): one hash pass over (rows, block) costs
    about what one position alone would (~0.1 ms of tensor-op overhead on CPU), which next
    to a small model's decode step (~1 ms) would not be negligible.
    """

    MAX_BLOCK = 64

    def __init__(self, keys: torch.Tensor, *, horizon: int) -> None:
        if keys.dtype != torch.int64 or keys.dim() != 2 or keys.shape[1] != 2:
            raise ValueError(f"sample keys must be (rows, 2) int64, got {keys.dtype} {keys.shape}")
        self.keys = keys
        self.block = max(1, min(horizon, self.MAX_BLOCK))
        self._cached: tuple[int, torch.Tensor] | None = None  # (first position, (rows, block))

    def uniforms(self, position: int) -> torch.Tensor:
        start = position - position % self.block
        if self._cached is None or self._cached[0] != start:
            self._cached = (start, self._uniform_block(start))
        return self._cached[1][:, position - start]

    def _uniform_block(self, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + self.block, device=self.keys.device)
        return _uniform(fmix32(self.keys[:, None, :] ^ _position_salts(positions)))  # (rows, block)


def _uniform(bits: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1) from (..., 2) pairs of 32-bit hashes: 27 + 26 random bits, every
    double on a 2**-53 grid, as numpy draws them."""
    return ((bits[..., 0] >> 5) * 2**26 + (bits[..., 1] >> 6)).double() * 2.0**-53


def keyed_uniforms(keys: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The (rows,) uniforms of ``keys`` at decode position ``position``, a (1,) int64 tensor
    on their device: :meth:`KeyedNoise.uniforms` computed without a host number, for a
    decode step captured once and replayed at every position."""
    return _uniform(fmix32(keys ^ _position_salts(position)))  # salts (1, 2)


class StreamNoise:
    """One ``torch.Generator`` stream for all rows: a row's draws depend on its position."""

    def __init__(self, seed: int, rows: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.rows, self.device = rows, device

    def uniforms(self, position: int) -> torch.Tensor:
        return torch.rand(
            self.rows, dtype=torch.float64, device=self.device, generator=self.generator
        )


def noise_for(
    prompts: TensorDict,
    *,
    temperature: float,
    horizon: int,
    randomness: str,
    stream_seed: int,
    device: torch.device,
) -> Noise | None:
    """The noise a worker samples ``prompts`` with, for up to ``horizon`` new tokens: each
    row's ``sample_key`` (``rollout.randomness=per_sample``), or a stream seeded
    ``stream_seed`` (``per_rank``, where the worker adds its rank to the seed); None when
    greedy."""
    if temperature == 0:
        return None
    if randomness == "per_rank":
        return StreamNoise(stream_seed, len(prompts), device)
    return KeyedNoise(prompts["sample_key"], horizon=horizon)
