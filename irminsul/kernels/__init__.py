"""Triton kernels for the GPU serve path: absorbed MLA attention read in place from the split
pool, the δ-rotation of cached k_r rows, the fused MoE and its router, and the small fusions a
launch-bound decode step needs (residual add + norm, the new tokens' rope: the latent rows'
norm + rope + store with the query's rope). Importing this package needs triton.

The kernels take tensors and integers only and import nothing from :mod:`irminsul.model` (the
model imports them): callers unpack a rotary into plain arguments (``Rotary.kernel_args``,
``Rotary.phasors``)."""

from .fused_norm import add_rms_norm, store_latent
from .mla_attention import PagedLayout, TileConfig, paged_mla_attention
from .rotate import rotate_kr

__all__ = ["PagedLayout", "TileConfig", "add_rms_norm", "paged_mla_attention", "rotate_kr",
           "store_latent"]
