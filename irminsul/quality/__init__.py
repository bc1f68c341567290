"""Output quality of position-independent reuse: the per-checkpoint correctness gate.

    probes        the shipped probe set (content re-sent at new positions)
    gate          measure PIC and naive reuse against full recomputation; the verdict
    checkpoint    a checkpoint directory's hash, what results are cached by
    result_cache  where measurements are kept
    report        the result as text
"""

from .checkpoint import checkpoint_hash
from .gate import GateError, GateResult, ProbeResult, judge, run_gate
from .probes import PROBE_KINDS, Probe, gate_probes

__all__ = ["PROBE_KINDS", "GateError", "GateResult", "Probe", "ProbeResult", "checkpoint_hash",
           "gate_probes", "judge", "run_gate"]
