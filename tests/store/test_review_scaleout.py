"""Review: the store's cost model and its other parts, on their own (no Redis, no model)."""

from __future__ import annotations

from irminsul.store.cost import CostModel

ROW = 8 + 4608  # bytes per token of a value at the embedded model's shapes (float32)


def test_a_link_that_was_slow_for_a_while_is_used_again_once_it_recovers() -> None:
    """The cost model learns only from fetches it allows. A spell of congestion drives its
    bandwidth estimate below what makes fetching pay; once the link is fast again, it must
    measure again (some fetch must go out) and go back to fetching, not decline every batch
    for the rest of the process's life on a figure nothing can correct any more."""
    cost = CostModel(1.25e9, 20_000.0)
    tokens = 400
    nbytes = tokens * ROW  # 1.8 MB: 23 ms to prefill, 1.5 ms over a 1.25 GB/s link

    def serve(link: float) -> bool:
        """One request's batch, as SharedStore._fetch decides it; whether it was fetched."""
        if not cost.worth_fetching(tokens, nbytes):
            return False
        cost.observe(nbytes, cost.round_trip + nbytes / link)
        return True

    assert serve(1.25e9)
    congested = [serve(20e6) for _ in range(50)]  # 20 MB/s: 92 ms a batch, prefill wins
    assert not congested[-1]  # the model learnt to prefill: right
    recovered = [serve(1.25e9) for _ in range(500)]
    assert any(recovered), "the cost model never fetches again after a slow spell"
    assert recovered[-1]  # and it goes back to fetching for good
