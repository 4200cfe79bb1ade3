"""Matrix products whose rows do not depend on how many rows are multiplied together.

A BLAS picks its kernel by the shape of a product: on a CPU with AVX-512 (MKL), a product of
one or two rows of float32 (up to 15 for a 896 x 4864 weight) sums in another order than the
same rows among more, and its results differ in the last bit. A decode path that multiplies
fewer rows than another (the static path's logits of a prompt's last token alone, or of the
rows left unfinished) then differs from it by those roundings, whatever its logic. Tests of
that logic run both paths under :class:`RowByRowMatmul`: every product one row at a time,
the same kernel for a row wherever it is, so they compare what the paths compute, not what
the machine's BLAS chose (on a GPU, cuBLAS chooses by shape too: the rollout's
``rollout/logprob_abs_diff`` reports it there)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MM = torch.ops.aten.mm.default
_ADDMM = torch.ops.aten.addmm.default


class RowByRowMatmul(TorchDispatchMode):
    """``aten.mm`` and ``aten.addmm`` (what ``nn.Linear`` and ``torch.matmul`` of 2-d or
    flattened inputs run) computed one row of their left operand at a time."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is _MM and args[0].shape[0] > 1:
            left, right = args
            return torch.cat([func(row, right) for row in left.split(1)])
        if func is _ADDMM and args[1].shape[0] > 1:
            bias, left, right = args
            rows = left.split(1)
            biases = bias.split(1) if bias.dim() == 2 and bias.shape[0] > 1 else [bias] * len(rows)
            return torch.cat(
                [func(b, row, right, **kwargs) for b, row in zip(biases, rows, strict=True)]
            )
        return func(*args, **kwargs)
