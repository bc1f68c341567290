"""Triton kernels for the GPU serve path: absorbed MLA attention read in place from the split
pool, and the δ-rotation of cached k_r rows. Importing this package needs triton.

The kernels take tensors and integers only and import nothing from :mod:`irminsul.model` (the
model imports them): callers unpack a rotary into plain arguments (``Rotary.kernel_args``)."""

from .mla_attention import PagedLayout, TileConfig, paged_mla_attention
from .rotate import rotate_kr

__all__ = ["PagedLayout", "TileConfig", "paged_mla_attention", "rotate_kr"]
