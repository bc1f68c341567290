"""FlashInfer 0.7.4, pruned to the MLA paged-decode path (fa2/fa3) for Irminsul's anchor benchmark.

The wheel's own __init__ imports every kernel family (MoE, GEMM, sampling, CuTe-DSL, ...), whose
modules were pruned from this bundle; this stub imports only what ``flashinfer.mla`` needs. See
scratch/flashinfer/README.md.
"""

from . import jit as jit  # noqa: E402  (the original order: jit before the attention modules)
from .mla import BatchMLAPagedAttentionWrapper as BatchMLAPagedAttentionWrapper  # noqa: E402
from .version import __git_commit__ as __git_commit__
from .version import __version__ as __version__
