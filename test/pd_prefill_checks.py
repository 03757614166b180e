"""End-to-end checks to call against a running PD prefill server of an existing deployment.

Kept out of the default run's deployments on purpose: each call costs a request, and the checks
talk to the prefill directly, never through the router. The empty-prompt check must not go
through the router: the stock decode behind it cannot release a 0-token request and exits
(docs/upstream/bugs/empty-prompt/), which would take a shared deployment down.
"""

from __future__ import annotations

import time

EMPTY_PROMPT_MESSAGE = "The prompt is empty (0 input tokens)"


def assert_empty_prompt_refused_by_prefill(prefill_url: str, bootstrap_port: int,
                                           timeout_s: float = 60.0) -> dict:
    """A DFLASH PP prefill answers ``{"text": ""}`` with a 400 naming the empty prompt, at once,
    and stays healthy.

    The request carries bootstrap fields for a room no decode knows: the prefill refuses it at
    admission, before it creates a KV sender, so no decode is contacted. Needs a tokenizer that
    adds no BOS (this repository's test models), or ``""`` is one token and is served. Returns
    the response body."""
    import requests

    body = {
        "text": "",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": 0x5EED,
    }
    started = time.monotonic()
    r = requests.post(prefill_url + "/generate", json=body, timeout=timeout_s)
    elapsed = time.monotonic() - started
    assert r.status_code == 400, f"{r.status_code}: {r.text[:500]}"
    assert EMPTY_PROMPT_MESSAGE in r.text, r.text[:500]
    assert elapsed < 10, f"the refusal took {elapsed:.1f} s: it should not wait on anything"
    health = requests.get(prefill_url + "/health", timeout=timeout_s)
    assert health.status_code == 200, f"the prefill is not healthy after the refusal: {health.text}"
    return r.json()
