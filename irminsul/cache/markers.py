"""S2 boundary markers: a fixed delimiter the prompt assembler puts around shared regions.

The paper's S2 (Appendix G) has the agent framework insert a 64-token marker around each shared
region, so the chunker restarts at a known state and identical regions chunk identically wherever
they land. The marker is ordinary text the model sees:

    MARKER_TEXT = "\\n\\n" + "IRMINSUL IRMINSUL ... IRMINSUL" (16 times) + "\\n\\n"

Its body tokenises to exactly 64 tokens with the default DeepSeek tokenizer ("IR" "MIN" "SU" "L",
then "ĠIR" "MIN" "SU" "L" fifteen times). The blank lines on either side keep byte-level BPE from
merging the body with neighbouring text (the pre-tokenizer splits at newlines and the body starts
and ends with a letter), so the body's token ids are the same in every context. A detected marker
yields two resets: at its first token and just after its last, so the marker is a chunk of its own
(cached like any other) and the region after it starts from a zero chunker state.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

MARKER_BODY = " ".join(["IRMINSUL"] * 16)
MARKER_TEXT = f"\n\n{MARKER_BODY}\n\n"


def assemble(regions: Iterable[tuple[str, bool]]) -> str:
    """Join prompt regions ``(text, shared)``, with one marker at every edge of a shared region."""
    out: list[str] = []
    marked = False  # whether the text assembled so far ends with a marker
    for text, shared in regions:
        if shared and not marked:
            out.append(MARKER_TEXT)
        out.append(text)
        marked = False
        if shared:
            out.append(MARKER_TEXT)
            marked = True
    return "".join(out)


def find_markers(tokens: np.ndarray, marker: np.ndarray) -> np.ndarray:
    """Resets for every occurrence of the marker token sequence: its start and its end offsets."""
    tokens = np.asarray(tokens)
    width = int(marker.size)
    if width == 0 or tokens.size < width:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(tokens[: tokens.size - width + 1] == marker[0])
    for j in range(1, width):
        starts = starts[tokens[starts + j] == marker[j]]
    # With the default tokenizer the first token ("IR", no leading space) occurs once per marker,
    # so matches cannot overlap; another tokenizer's marker might: scan left to right and keep each
    # match that does not overlap the last one kept (a chain 0, 2, 4 of width 3 keeps 0 and 4).
    kept: list[int] = []
    for s in starts.tolist():
        if not kept or s >= kept[-1] + width:
            kept.append(s)
    starts = np.asarray(kept, dtype=np.int64)
    return np.sort(np.concatenate([starts, starts + width])).astype(np.int64)
