"""Client of reward servers (`python -m hybridjax.rewards.serve`): `reward_model.remote.*`.

Rows are cut into requests of `batch_size`, spread round-robin over `urls`, and at most
`concurrency` requests are in flight (threads sharing one `httpx.Client`; the trainer's device
stages run meanwhile). A request that times out (`timeout_s`), cannot connect, gets a 5xx or
a body that is not the expected JSON is retried up to `max_retries` times, each retry on the
next URL after a backoff of `retry_backoff_s` · 2^(retry - 1) seconds; after that its rows fail
(`timeout` or `error`, the message naming the URL, the HTTP status and the body's start) and
follow `reward_model.on_error` (and the failure guard, `hybridjax.rewards.guard`). A 4xx is not
retried (the request itself is wrong). The bearer token, when the servers want one, is read
from the environment variable `HYBRIDJAX_REWARD_TOKEN` (never from the config, which is
logged).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from hybridjax.errors import UserError
from hybridjax.rewards.scoring import Outcome, Row

TOKEN_ENV = "HYBRIDJAX_REWARD_TOKEN"


class RewardServerError(UserError, RuntimeError):
    """A reward server is unreachable, refused the request, or serves the wrong kind (a user
    error: the command line reports it in one line)."""


@dataclasses.dataclass(frozen=True)
class RemoteConfig:
    """`reward_model.remote.*`: `urls` comma-separated (empty = score locally); `timeout_s`
    per request; `max_retries` per request; `concurrency` requests in flight; `batch_size`
    rows (or token sequences) per request."""

    urls: tuple[str, ...] = ()
    timeout_s: float = 60.0
    max_retries: int = 2
    concurrency: int = 4
    batch_size: int = 32
    retry_backoff_s: float = 0.5

    def __post_init__(self):
        for key in ("concurrency", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"reward_model.remote.{key}={getattr(self, key)}; must be >= 1")
        if self.max_retries < 0 or self.timeout_s <= 0 or self.retry_backoff_s < 0:
            raise ValueError(
                "reward_model.remote.max_retries and retry_backoff_s must be >= 0, timeout_s > 0"
            )
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"reward_model.remote.urls: {url!r} is not an http(s) URL")

    @classmethod
    def from_dict(cls, d: Any) -> RemoteConfig:
        urls = d.get("urls", "") or ""
        urls = urls.split(",") if isinstance(urls, str) else list(urls)
        return cls(
            urls=tuple(u.strip().rstrip("/") for u in urls if u.strip()),
            timeout_s=float(d.get("timeout_s", cls.timeout_s)),
            max_retries=int(d.get("max_retries", cls.max_retries)),
            concurrency=int(d.get("concurrency", cls.concurrency)),
            batch_size=int(d.get("batch_size", cls.batch_size)),
            retry_backoff_s=float(d.get("retry_backoff_s", cls.retry_backoff_s)),
        )


class RemoteClient:
    """Posts batches to reward servers; counts latency, timeouts and retries.

    Args:
      config: `RemoteConfig` with at least one URL.
      kind: what the servers must serve, `rule` (rows of text), `model` (token ids) or `judge`
        (a generative reward model: prompt and response texts).

    Raises:
      RewardServerError: a URL fails its health check or serves another kind (names the URL).
    """

    def __init__(self, config: RemoteConfig, kind: str):
        self.config, self.kind = config, kind
        token = os.environ.get(TOKEN_ENV, "")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(timeout=config.timeout_s, headers=headers)
        self._pool = concurrent.futures.ThreadPoolExecutor(config.concurrency, "reward-http")
        self._lock = threading.Lock()
        self._next = 0
        self.reset_counters()
        serves = {url: self._health(url) for url in config.urls}
        if len(set(serves.values())) > 1:
            listed = "; ".join(f"{u} serves {what}" for u, what in serves.items())
            raise RewardServerError(
                f"reward_model.remote.urls serve different rewards ({listed}); requests are "
                "spread over every URL, so they must all serve the same function or model"
            )

    def _health(self, url: str) -> str:
        """Checks one server; returns what it serves (its health's `serves`)."""
        try:
            response = self._http.get(f"{url}/health")
            response.raise_for_status()
            health = response.json()
        except (httpx.HTTPError, ValueError) as e:
            raise RewardServerError(f"reward server {url} failed its health check: {e!r}") from e
        if not health.get("authorized", True):  # checked first: it then says nothing else
            raise RewardServerError(
                f"reward server {url} wants a bearer token: set {TOKEN_ENV} to the server's "
                "token in the trainer's environment"
            )
        served = health.get("kind")
        if served != self.kind:
            raise RewardServerError(
                f"reward server {url} serves kind {served!r}, expected {self.kind!r} "
                "(a rule server takes rows of text, a model server token ids, a judge server "
                "prompt and response texts)"
            )
        return str(health.get("serves", served))

    def reset_counters(self) -> None:
        self.latencies_ms: list[float] = []
        self.num_retries = 0

    def metrics(self) -> dict[str, float]:
        """`reward/remote_latency_ms` (mean per request), `reward/num_retries`; since the last
        `reset_counters()`. Timeouts are counted per row by the caller."""
        lat = self.latencies_ms
        return {
            "reward/remote_latency_ms": sum(lat) / len(lat) if lat else 0.0,
            "reward/num_retries": float(self.num_retries),
        }

    def post_all(self, path: str, items: Sequence[Any], body) -> list[Any]:
        """POSTs `items` in requests of `batch_size` (`body(chunk)` is the JSON of one);
        returns per item the server's result, or an `Outcome` failure (timeout / error)."""
        size = self.config.batch_size
        chunks = [list(items[i : i + size]) for i in range(0, len(items), size)]
        futures = [self._pool.submit(self._post, path, body(c), len(c)) for c in chunks]
        return [r for f in futures for r in f.result()]

    def _post(self, path: str, payload: dict, n: int) -> list[Any]:
        with self._lock:
            first = self._next
            self._next += 1
        urls = self.config.urls
        failure = None
        for attempt in range(self.config.max_retries + 1):
            url = urls[(first + attempt) % len(urls)]
            if attempt:
                with self._lock:
                    self.num_retries += 1
                time.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
            start = time.perf_counter()
            try:
                response = self._http.post(f"{url}{path}", json=payload)
            except httpx.TimeoutException as e:
                failure = Outcome(kind="timeout", error=f"reward server {url}{path}: {e!r}")
                continue
            except httpx.TransportError as e:
                failure = Outcome(kind="error", error=f"reward server {url}{path}: {e!r}")
                continue
            where = f"reward server {url}{path} answered {response.status_code}"
            if 400 <= response.status_code < 500:
                raise RewardServerError(f"{where} (request refused): {_shown(response.text)}")
            results = _results(response, n)
            if results is None:
                failure = Outcome(kind="error", error=f"{where}: {_shown(response.text)}")
                continue
            with self._lock:
                self.latencies_ms.append(1e3 * (time.perf_counter() - start))
            return results
        return [failure] * n

    def score_rows(self, rows: Sequence[Row]) -> list[Outcome]:
        """Rule scores of `rows` from `rule` servers (`POST /score`)."""
        keys = ("data_source", "solution_str", "ground_truth", "extra_info")
        body = lambda chunk: {"rows": [dict(zip(keys, r, strict=True)) for r in chunk]}
        return [
            r if isinstance(r, Outcome) else Outcome.from_json(r)
            for r in self.post_all("/score", rows, body)
        ]

    def score_tokens(
        self, prompts: Sequence[list[int]], responses: Sequence[list[int]]
    ) -> list[Outcome]:
        """Reward-model scores from `model` servers (`POST /score_tokens`), one per
        (prompt ids, response ids) pair."""
        pairs = list(zip(prompts, responses, strict=True))
        body = lambda chunk: {"prompts": [p for p, _ in chunk], "responses": [r for _, r in chunk]}
        return [
            r if isinstance(r, Outcome) else Outcome.from_json(r)
            for r in self.post_all("/score_tokens", pairs, body)
        ]

    def judge(
        self,
        prompts: Sequence[str],
        responses: Sequence[str],
        ground_truths: Sequence[Any] | None = None,
    ) -> list[Outcome]:
        """Verdict scores from `judge` servers (`POST /judge`), one per (prompt, response)
        text pair; the same outcomes as `hybridjax.rewards.genrm.Judge.score` on the server."""
        truths = [None] * len(prompts) if ground_truths is None else list(ground_truths)
        rows = [
            {"prompt": p, "response": r, "ground_truth": t}
            for p, r, t in zip(prompts, responses, truths, strict=True)
        ]
        return [
            r if isinstance(r, Outcome) else Outcome.from_json(r)
            for r in self.post_all("/judge", rows, lambda chunk: {"rows": chunk})
        ]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def _shown(body: str, limit: int = 300) -> str:
    """The start of a response body, for messages."""
    return repr(body[:limit]) + ("..." if len(body) > limit else "")


def _results(response: httpx.Response, n: int) -> list[Any] | None:
    """The `results` list of a 2xx answer with `n` entries, or None for anything else (a 5xx,
    a body that is not JSON, another shape or count): the request is retried."""
    if response.status_code >= 300:
        return None
    try:
        results = response.json()["results"]
    except (ValueError, KeyError, TypeError):
        return None
    return results if isinstance(results, list) and len(results) == n else None
