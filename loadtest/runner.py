"""Drive a load test: Poisson arrivals (or all at once) under an optional concurrency cap, bounded in time."""

from __future__ import annotations

import asyncio
import ipaddress
import random
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from exspec.loadtest.client import (
    RequestInput,
    RequestResult,
    build_payload,
    send_request,
)

from exspec.errors import LoadTestError


@dataclass(frozen=True)
class LoadConfig:
    model: str  # the model name sent (default: the first of /v1/models)
    base_url: str = "http://127.0.0.1:8000/v1"  # the server's /v1 URL, on this machine
    api_key: str | None = None
    endpoint: str = "completions"  # "completions" | "chat"
    request_rate: float = float("inf")  # requests/s of a Poisson process; inf: all at once
    max_concurrency: int | None = None  # requests in flight at most; None: no cap
    temperature: float = 0.0
    ignore_eos: bool = False
    return_token_ids: bool = False
    seed: int = 0  # arrival times
    request_timeout: float = 300.0  # seconds per request
    total_timeout: float = 1800.0  # seconds for the whole test: requests still running are cancelled

    def __post_init__(self) -> None:
        check_loopback(self.base_url)
        if not self.request_rate > 0:
            raise LoadTestError(f"--request-rate must be > 0 (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise LoadTestError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.endpoint not in ("completions", "chat"):
            raise LoadTestError(f"--endpoint must be completions or chat, got {self.endpoint!r}")
        if self.request_timeout <= 0 or self.total_timeout <= 0:
            raise LoadTestError("--request-timeout and --timeout must be > 0")


# The LoadConfig fields that are flags of `python -m exspec.loadtest` of the same name (`--x-y`; `--timeout` is
# total_timeout), whose defaults the parser takes from LoadConfig: one mapping from the flags to the config.
FLAG_FIELDS = ("base_url", "api_key", "endpoint", "request_rate", "max_concurrency", "temperature", "seed",
               "request_timeout", "total_timeout")


def check_loopback(base_url: str) -> None:
    """The load generator only talks to a server on this machine (127.0.0.0/8, ::1 or localhost)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadTestError(f"--base-url must be an http(s) URL like http://127.0.0.1:8000/v1, got {base_url!r}")
    host = parts.hostname
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise LoadTestError(f"--base-url must point at this machine (127.0.0.1, ::1 or localhost), got host {host!r}")


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `rate` (the first at 0),
    or all at 0 for an infinite rate."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def first_model(base_url: str, api_key: str | None) -> str:
    """The id of the first model /v1/models lists (the one exspec serves)."""
    check_loopback(base_url)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(api_key), timeout=30) as client:
        try:
            resp = await client.get("/models")
        except httpx.HTTPError as e:
            raise LoadTestError(f"cannot reach {base_url}/models: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise LoadTestError(f"{base_url}/models answered HTTP {resp.status_code}: {resp.text[:200]}")
        data = resp.json().get("data") or []
        if not data:
            raise LoadTestError(f"{base_url}/models lists no model")
        return data[0]["id"]


async def run_load(requests: list[RequestInput], cfg: LoadConfig, progress: bool = False) -> tuple[list[RequestResult], float]:
    """Send every request on its arrival schedule; return the results (in request order) and the duration
    (the first send to the last end). Stops by itself: after `total_timeout` whatever still runs is cancelled
    and reported as failed."""
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    in_flight = cfg.max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    sem = asyncio.Semaphore(in_flight)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", desc="load test", leave=False)
    results: dict[int, RequestResult] = {}

    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=_headers(cfg.api_key), limits=limits,
                                 timeout=httpx.Timeout(cfg.request_timeout)) as client:

        async def one(req: RequestInput) -> None:
            body = build_payload(req, cfg.model, cfg.endpoint, cfg.temperature, cfg.ignore_eos, cfg.return_token_ids)
            async with sem:
                results[req.index] = await send_request(client, path, body, req, cfg.endpoint)
            if bar is not None:
                bar.update(1)

        async def dispatch(tasks: list[asyncio.Task]) -> None:
            for req, offset in zip(requests, offsets):
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(req)))
            await asyncio.gather(*tasks)

        tasks: list[asyncio.Task] = []  # every request task, so each can be cancelled
        start = time.perf_counter()
        try:
            await asyncio.wait_for(dispatch(tasks), timeout=cfg.total_timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if bar is not None:
                bar.close()
    ended = [r.start + r.latency for r in results.values() if r.success]
    end = max(ended) if ended else time.perf_counter()
    duration = end - start
    out = []
    for req in requests:
        r = results.get(req.index)
        if r is None:
            r = RequestResult(index=req.index, error=f"not finished within --timeout {cfg.total_timeout:g} s")
        out.append(r)
    return out, duration
