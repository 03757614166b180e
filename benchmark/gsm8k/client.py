"""HTTP clients for an SGLang server or router: native ``/generate`` and the OpenAI-compatible
``/v1/completions`` and ``/v1/chat/completions``. Greedy (temperature 0) always.

Every call returns a :class:`Reply`; transport problems become a failure kind, never an
exception, so the caller can count them per request.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import requests

from .metrics import (
    FAIL_ABORTED,
    FAIL_EMPTY,
    FAIL_HTTP,
    FAIL_MALFORMED,
    FAIL_TIMEOUT,
    SpecCounts,
    spec_counts,
)

API_NATIVE = "native"
API_OPENAI = "openai"  # /v1/completions
API_OPENAI_CHAT = "openai-chat"  # /v1/chat/completions
APIS = (API_NATIVE, API_OPENAI, API_OPENAI_CHAT)


@dataclass
class Reply:
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    completion_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None
    spec: Optional[SpecCounts] = None
    meta: Optional[dict] = None
    latency_s: Optional[float] = None
    failure: Optional[str] = None
    failure_detail: Optional[str] = None
    http_status: Optional[int] = None


def _finish_type(finish: Any) -> Optional[str]:
    if isinstance(finish, dict):
        return finish.get("type")
    return finish


class Client:
    def __init__(
        self,
        base_url: str,
        api: str = API_NATIVE,
        model: str = "default",
        max_new_tokens: int = 512,
        stop: Optional[List[str]] = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
    ):
        if api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {api!r}")
        self.base_url = base_url.rstrip("/")
        self.api = api
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.stop = list(stop or [])
        self.timeout = (connect_timeout_s, timeout_s)
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    # Requests -------------------------------------------------------------------------------
    def request(self, prompt: str):
        """(path, JSON body) for one greedy generation of ``prompt``."""
        if self.api == API_NATIVE:
            return "/generate", {
                "text": prompt,
                "sampling_params": {
                    "temperature": 0.0,
                    "max_new_tokens": self.max_new_tokens,
                    "stop": self.stop,
                },
            }
        common = {
            "model": self.model,
            "temperature": 0.0,
            "max_tokens": self.max_new_tokens,
            "stop": self.stop,
            # sglang extension: per-request speculative counters under sglext.
            "return_spec_tokens_details": True,
        }
        if self.api == API_OPENAI:
            return "/v1/completions", dict(common, prompt=prompt)
        return "/v1/chat/completions", dict(common, messages=[{"role": "user", "content": prompt}])

    # Responses ------------------------------------------------------------------------------
    def parse(self, body: Dict[str, Any]) -> Reply:
        """A 2xx JSON body -> :class:`Reply` (failure set when it is empty or not understood)."""
        try:
            if self.api == API_NATIVE:
                if isinstance(body, list):  # batch form; we send one prompt
                    body = body[0]
                meta = dict(body["meta_info"])
                reply = Reply(
                    text=body["text"],
                    finish_reason=_finish_type(meta.get("finish_reason")),
                    completion_tokens=meta.get("completion_tokens"),
                    prompt_tokens=meta.get("prompt_tokens"),
                    meta=meta,
                )
                reply.spec = spec_counts(meta, reply.completion_tokens)
            else:
                choice = body["choices"][0]
                usage = body.get("usage") or {}
                text = choice["text"] if self.api == API_OPENAI else choice["message"]["content"]
                sglext = body.get("sglext") or {}
                details = sglext.get("spec_tokens_details")
                if isinstance(details, list):
                    details = details[0] if details else None
                reply = Reply(
                    text=text,
                    finish_reason=_finish_type(choice.get("finish_reason")),
                    completion_tokens=usage.get("completion_tokens"),
                    prompt_tokens=usage.get("prompt_tokens"),
                    meta={"usage": usage, "sglext": sglext or None, "id": body.get("id")},
                )
                reply.spec = spec_counts(details, reply.completion_tokens)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            return Reply(
                failure=FAIL_MALFORMED,
                failure_detail=f"{type(e).__name__}: {e}; body={json.dumps(body)[:300]}",
            )
        if not isinstance(reply.completion_tokens, int):
            return Reply(
                failure=FAIL_MALFORMED,
                failure_detail=f"no completion token count in response: {json.dumps(body)[:300]}",
            )
        if reply.finish_reason == "abort":
            finish = (reply.meta or {}).get("finish_reason")
            reply.failure = FAIL_ABORTED
            reply.failure_detail = f"server aborted the request: {json.dumps(finish)[:300]}"
            return reply
        if reply.text is None or not reply.text.strip():
            reply.failure = FAIL_EMPTY
            reply.failure_detail = (
                f"empty output (finish_reason={reply.finish_reason!r}, "
                f"completion_tokens={reply.completion_tokens})"
            )
        return reply

    def generate(self, prompt: str) -> Reply:
        path, payload = self.request(prompt)
        start = time.perf_counter()
        try:
            resp = self._session().post(self.base_url + path, json=payload, timeout=self.timeout)
        except requests.Timeout as e:
            return Reply(
                failure=FAIL_TIMEOUT,
                failure_detail=f"no response within {self.timeout[1]} s: {e}",
                latency_s=time.perf_counter() - start,
            )
        except requests.RequestException as e:
            return Reply(
                failure=FAIL_HTTP,
                failure_detail=f"connection failed: {type(e).__name__}: {e}"[:500],
                latency_s=time.perf_counter() - start,
            )
        latency = time.perf_counter() - start
        if not 200 <= resp.status_code < 300:
            return Reply(
                failure=FAIL_HTTP,
                failure_detail=f"HTTP {resp.status_code}: {resp.text[:300]}",
                http_status=resp.status_code,
                latency_s=latency,
            )
        try:
            body = resp.json()
        except ValueError:
            return Reply(
                failure=FAIL_MALFORMED,
                failure_detail=f"not JSON: {resp.text[:300]}",
                http_status=resp.status_code,
                latency_s=latency,
            )
        reply = self.parse(body)
        reply.http_status = resp.status_code
        reply.latency_s = latency
        return reply

    def flush_cache(self) -> bool:
        """POST /flush_cache (server and router both serve it); True on 2xx."""
        try:
            resp = self._session().post(self.base_url + "/flush_cache", timeout=self.timeout)
        except requests.RequestException:
            return False
        return 200 <= resp.status_code < 300
