"""The router's score and its tie-breaking, against values computed by hand."""

from __future__ import annotations

import pytest
import xxhash

from irminsul.config import RouterConfig
from irminsul.router.score import Candidate, choose, score

CONFIG = RouterConfig(queue_weight=0.02, kv_weight=0.05, tie_margin=0.01)


def test_score_is_the_documented_formula() -> None:
    # 600/1000 - 0.02*2 - 0.05*0.5 = 0.6 - 0.04 - 0.025
    assert score(Candidate("a", 600, 2, 0.5), 1000, CONFIG) == pytest.approx(0.535)
    # 500/1000 - 0 - 0.05*0.1
    assert score(Candidate("b", 500, 0, 0.1), 1000, CONFIG) == pytest.approx(0.495)
    # an empty prompt gains nothing from a cache: load alone
    assert score(Candidate("c", 0, 3, 1.0), 0, CONFIG) == pytest.approx(-0.11)


def test_the_most_cached_backend_wins_unless_its_queue_outweighs_it() -> None:
    a, b = Candidate("http://a", 600, 2, 0.5), Candidate("http://b", 500, 0, 0.1)
    assert choose([a, b], 1000, CONFIG, session_backend=None, tie_key=0) == (a, "score")
    # 0.6 - 0.02*5 - 0.025 = 0.475 < 0.495: five requests queued on a lose it to b
    busy = Candidate("http://a", 600, 5, 0.5)
    assert choose([busy, b], 1000, CONFIG, session_backend=None, tie_key=0) == (b, "score")


def test_a_tie_goes_to_the_sessions_backend() -> None:
    # 0.500 and 0.495 (within the margin 0.01): tied; the session last went to b
    a, b = Candidate("http://a", 500, 0, 0.0), Candidate("http://b", 500, 0, 0.1)
    assert choose([a, b], 1000, CONFIG, session_backend="http://b", tie_key=7) == (b, "session")
    # a third backend outside the margin (0.4) never wins a tie, even as the session's
    c = Candidate("http://c", 400, 0, 0.0)
    assert choose([a, b, c], 1000, CONFIG, session_backend="http://c",
                  tie_key=7)[1] == "hash"


def test_a_tie_without_a_session_is_broken_by_rendezvous_hashing() -> None:
    urls = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    idle = [Candidate(u, 0, 0, 0.0) for u in urls]
    for key in range(50):
        # the highest xxh64(url, seed=key) wins, whatever the order of the candidates
        expected = max(urls, key=lambda u: xxhash.xxh64_intdigest(u.encode(), key))
        for order in (idle, idle[::-1]):
            chosen, reason = choose(order, 100, CONFIG, session_backend=None, tie_key=key)
            assert (chosen.url, reason) == (expected, "hash")
    # and different keys spread over every backend
    winners = {choose(idle, 100, CONFIG, session_backend=None, tie_key=k)[0].url
               for k in range(50)}
    assert winners == set(urls)


def test_one_more_request_in_flight_breaks_a_tie_of_empty_caches() -> None:
    # 0 - 0.02 = -0.02 is outside the margin of 0: the idle one wins on score
    a, b = Candidate("http://a", 0, 1, 0.0), Candidate("http://b", 0, 0, 0.0)
    assert choose([a, b], 100, CONFIG, session_backend="http://a", tie_key=0) == (b, "score")


def test_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError, match="no backend"):
        choose([], 10, CONFIG, session_backend=None, tie_key=0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"policy": "random"}, "unknown routing policy"),
    ({"backends": ("localhost:8000",)}, "http://HOST:PORT"),
    ({"backends": ("http://a", "http://a")}, "given twice"),
    # one server: the router strips the slash, and would keep two backends of one URL (round
    # robin sending it twice its share, the second one's in-flight requests never counted)
    ({"backends": ("http://a:8000", "http://a:8000/")}, "given twice"),
    ({"queue_weight": -1.0}, "queue_weight"),
    ({"poll_interval_s": 0.0}, "poll_interval_s"),
    ({"backoff_s": 10.0, "backoff_max_s": 1.0}, "backoff_max_s"),
])
def test_a_bad_config_says_which_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**fields)
