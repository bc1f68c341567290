"""``irminsul router``: an OpenAI-compatible proxy in front of several ``irminsul serve``
backends that sends each request to the one whose cache holds most of its tokens.

    digest.py    the published index a backend serves at /irminsul/index (format, prefix blocks)
    keys.py      a request's prefix blocks, regions and chunks, cut as the engines cut them
    view.py      what the router knows of one backend's cache: its index, and what it sent it
    score.py     the score, the choice and its tie-breaking (pure functions)
    backends.py  the backends: their views, load, health and backoff, and the polling of them
    metrics.py   the router's own Prometheus metrics
    app.py       the HTTP proxy, and ``serve_router``
"""
