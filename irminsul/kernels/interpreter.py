"""Whether the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``, which the
tests switch on without CUDA): there bf16 ``tl.dot`` and float32 → bf16 casts are wrong, and the
kernels work around them."""

from __future__ import annotations

import os


def interpreted() -> bool:
    """True under Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"
