"""One streaming request against an OpenAI-compatible server (httpx + SSE), timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class RequestInput:
    index: int  # position in the load test's request list
    prompt: str | list[int]  # text, or token ids (sent as-is to /v1/completions)
    max_tokens: int
    prompt_len: int | None = None  # known when the prompt is token ids


@dataclass
class RequestResult:
    index: int
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter when the request was sent
    ttft: float = 0.0  # seconds from sending to the first chunk with output
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between successive chunks with output
    chunk_times: list[float] = field(default_factory=list)  # seconds since sending, per chunk with output
    prompt_tokens: int = 0  # from the usage chunk (else the prompt's length when known)
    output_tokens: int = 0  # from the usage chunk (else the count of token ids or output chunks)
    usage_reported: bool = False  # the server sent a usage chunk
    token_ids: list[int] | None = None  # generated ids when the server returns them (return_token_ids)
    text: str = ""
    finish_reason: str | None = None


def build_payload(req: RequestInput, model: str, endpoint: str, temperature: float, ignore_eos: bool,
                  return_token_ids: bool) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        if not isinstance(req.prompt, str):
            raise ValueError("the chat endpoint takes text prompts only")
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM extension, honoured by exspec
    if return_token_ids:
        body["return_token_ids"] = True  # vLLM extension, honoured by exspec
    return body


def _chunk_output(obj: dict, endpoint: str) -> tuple[str, list[int], str | None]:
    """Text, token ids and finish reason of one SSE chunk (first choice; the load test sends n = 1)."""
    choices = obj.get("choices") or []
    if not choices:
        return "", [], None
    c = choices[0]
    text = ((c.get("delta") or {}).get("content") or "") if endpoint == "chat" else (c.get("text") or "")
    return text, list(c.get("token_ids") or []), c.get("finish_reason")


async def send_request(client: httpx.AsyncClient, path: str, body: dict, req: RequestInput,
                       endpoint: str) -> RequestResult:
    """POST one streaming request; never raises (a failure is a result with success=False)."""
    res = RequestResult(index=req.index, prompt_tokens=req.prompt_len or 0)
    ids: list[int] = []
    texts: list[str] = []
    chunks = 0
    done = False  # saw `data: [DONE]`: a stream cut short (a proxy or a replica dying) never does
    res.start = time.perf_counter()
    last = res.start
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    res.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    return res
                now = time.perf_counter()
                text, tok, finish = _chunk_output(obj, endpoint)
                if text or tok:
                    if chunks == 0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    res.chunk_times.append(now - res.start)
                    last = now
                    chunks += 1
                    texts.append(text)
                    ids.extend(tok)
                if finish is not None:
                    res.finish_reason = finish
                usage = obj.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
                    res.output_tokens = usage.get("completion_tokens", 0)
        res.latency = time.perf_counter() - res.start
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if not done:
        res.error = "the stream ended without data: [DONE] (cut short)"
        return res
    res.text = "".join(texts)
    res.token_ids = ids if body.get("return_token_ids") else None
    if not res.usage_reported:
        res.output_tokens = len(ids) if ids else chunks
    if chunks == 0 and res.output_tokens > 0:
        res.error = "the stream ended without any output chunk"
        return res
    res.success = True
    return res
