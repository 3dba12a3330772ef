"""Loaded by schemathesis (SCHEMATHESIS_HOOKS=tests.schemathesis_hooks) in test_fuzz.py.

Streaming answers stay open while a job runs (GET /jobs/{id}/logs?follow=true, and
the server-sent events of /jobs/{id}/events): a fuzzer that opened one would wait for
its request timeout. They are asked for without following; the events stream is left
out of the run by path (see test_fuzz.py).
"""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.hook
def map_query(context: Any, query: dict[str, Any] | None) -> dict[str, Any] | None:
    if query and "follow" in query:
        query = {k: v for k, v in query.items() if k != "follow"}
    return query
