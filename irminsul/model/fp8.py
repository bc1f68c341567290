"""FP8 block-scaled linear layers: DeepSeek-V3's float8 weights kept as float8 in memory.

A DeepSeek-V3 / Kimi-K2 checkpoint stores each linear weight W [out, in] as float8_e4m3fn ``Wq``
plus ``weight_scale_inv`` float32 [ceil(out / br), ceil(in / bc)] (``br`` x ``bc`` blocks, 128 x
128 in V3): W[m, n] = float(Wq[m, n]) * scale_inv[m // br, n // bc]. :func:`dequantize_blocks` is
the one definition of that arithmetic; the loader's dequantize-at-load path and
:class:`FP8Linear`'s forward both call it, so the two give bit-identical weights.

:class:`FP8Linear` holds ``Wq`` and the scales (1 byte a weight instead of bf16's 2) and, per
forward, dequantizes into the input's dtype and runs ``F.linear``: the reference path, correct on
any device. With kernels on (:func:`~irminsul.model.model.use_kernels`) the forward is
:func:`irminsul.kernels.fp8.fp8_linear`, which reads the float8 weight as stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn


def scale_grid(shape: tuple[int, int] | torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    """The shape [ceil(out / br), ceil(in / bc)] of the scale grid of a weight of ``shape``: the
    last row / column of blocks may be partial (V3's dims are not all multiples of 128)."""
    rows, cols = block
    return -(-int(shape[0]) // rows), -(-int(shape[1]) // cols)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """W[..., m, n] = float(Wq[..., m, n]) * scale_inv[..., m // br, n // bc] in float32: one
    weight [M, N], or a stack of them [E, M, N] with their grids [E, gm, gn].

    ``scale_inv`` must already be checked to be :func:`scale_grid` of ``weight`` (the loader does,
    with a message naming the tensor). Float32, whatever the caller wants in the end: the product
    is then rounded once into the target dtype, the same on every path.
    """
    rows, cols = block
    scale = scale_inv.float().repeat_interleave(rows, -2)[..., : weight.shape[-2], :]
    scale = scale.repeat_interleave(cols, -1)[..., : weight.shape[-1]]
    return weight.float() * scale


def dequantize_stacked(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                       parts: int = 1) -> torch.Tensor:
    """:func:`dequantize_blocks` over a stack of weights [E, M, N] whose rows are ``parts``
    matrices of M / parts rows, each with its own grid of gm / parts rows, joined (the MoE's
    ``w13``: each expert's gate, then its up projection)."""
    return torch.cat([dequantize_blocks(w, s, block) for w, s in
                      zip(weight.chunk(parts, 1), scale_inv.chunk(parts, 1), strict=True)], 1)


class FP8Linear(nn.Module):
    """y = x @ dequant(Wq, scale_inv)ᵀ (+ bias), with ``weight`` float8_e4m3fn [out, in] and
    ``weight_scale_inv`` float32 [ceil(out / br), ceil(in / bc)] — the checkpoint's names, so
    the state dict loads straight from it. Both are parameters without gradients (inference only),
    so ``model.parameters()`` counts the bytes the model really holds."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block: tuple[int, int] = (128, 128), device: torch.device | str | None = None,
                 bias_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.kernels = False  # irminsul.model.model.use_kernels: the Triton FP8 linear
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE,
                                               device=device), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_grid((out_features, in_features), block), dtype=torch.float32,
                        device=device), requires_grad=False)
        self.bias: nn.Parameter | None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                     requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def like(cls, linear: nn.Linear, block: tuple[int, int]) -> FP8Linear:
        """An (uninitialised) FP8Linear of ``linear``'s shape, bias and device (meta, when the
        loader builds the model there before assigning the checkpoint's tensors)."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, block,
                   device=linear.weight.device,
                   bias_dtype=None if linear.bias is None else linear.bias.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype``, exactly as the dequantize-at-load path holds it."""
        # Weight and scales are replaced wholesale by loading (and could be by tensor-parallel
        # slicing, which would cut the weight but not its scales): check they still agree, or the
        # scales would be silently cropped onto the wrong blocks. Python ints only: no sync.
        expected = scale_grid(self.weight.shape, self.block)
        if tuple(self.weight_scale_inv.shape) != expected:
            raise ValueError(f"FP8Linear: weight_scale_inv {tuple(self.weight_scale_inv.shape)} "
                             f"does not fit weight {tuple(self.weight.shape)} with blocks "
                             f"{self.block} (needs {expected})")
        return dequantize_blocks(self.weight, self.weight_scale_inv, self.block).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:  # the float8 weight read as stored, its tiles dequantized in registers
            from ..kernels.fp8 import fp8_linear  # needs triton: only with kernels

            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        # The torch path: a transient full-precision copy of W per call. The memory saved is
        # the resident weights', not their bandwidth.
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, block={self.block}")
