"""Triton kernels for the GPU serve path: absorbed MLA attention read in place from the split
pool, and the δ-rotation of cached k_r rows. Importing this package needs triton."""

from .mla_attention import PagedLayout, TileConfig, paged_mla_attention
from .rotate import rotate_kr

__all__ = ["PagedLayout", "TileConfig", "paged_mla_attention", "rotate_kr"]
