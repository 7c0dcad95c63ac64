"""`tandem loadtest`: N concurrent streaming clients against a running OpenAI-compatible server.
More: docs/internals.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

PROMPTS: dict[str, list[str]] = {
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
        "Implement binary search over a sorted list in Python and explain its complexity in one line.",
    ],
    "freeform": [
        "Tell a short story about a lighthouse keeper who finds a message in a bottle.",
        "Describe a walk through a city market on a rainy morning.",
    ],
    "json": [
        "Return a JSON object describing a book with fields title, author, year, genres (a list) and isbn.",
        "Give a JSON array of three users, each with id, name, email and a boolean active field.",
    ],
    "summary": [
        "Summarize in three sentences: Speculative decoding lets a small draft model propose several tokens that "
        "a large target model then verifies in a single forward pass, keeping the target's output distribution "
        "exactly while cutting the number of slow target steps when the draft is often right.",
        "Summarize briefly: The Hubble Space Telescope, launched in 1990, has observed distant galaxies, measured "
        "the expansion rate of the universe and imaged planets in our solar system for more than three decades.",
    ],
}


@dataclass
class RequestResult:
    kind: str
    ok: bool
    status: int = 0
    latency_s: float = 0.0  # request sent -> [DONE]
    ttft_s: float | None = None  # request sent -> first content chunk
    completion_tokens: int = 0
    prompt_tokens: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, where the server sends it
    cache_n: int | None = None  # timings.cache_n (llama-server's name for the same)
    prompt_ms: float | None = None  # timings.prompt_ms: the server's own time for the prompt (both servers)
    text: str = ""
    error: str | None = None


@dataclass
class LoadReport:
    url: str
    concurrency: int
    requests: int
    max_tokens: int
    wall_s: float
    ok: int
    failed: int
    requests_per_s: float
    output_tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    mean_completion_tokens: float
    acceptance_rate: float | None  # summed accepted / summed drafted; None when nothing was drafted
    draft_n: int
    errors: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-quantile (0..1) of values; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def one_request(client, url: str, model: str, kind: str, prompt: str | list[dict], max_tokens: int,
                      temperature: float, extra_body: dict | None = None) -> RequestResult:
    """One streamed chat completion; prompt: a user message, or a whole chat's messages."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
            **(extra_body or {})}
    result = RequestResult(kind=kind, ok=False)
    started = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                choices = chunk.get("choices") or []
                content = choices[0].get("delta", {}).get("content") if choices else None
                if content:
                    if result.ttft_s is None:
                        result.ttft_s = time.perf_counter() - started
                    result.text += content
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.completion_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if chunk.get("timings"):
                    result.draft_n = chunk["timings"].get("draft_n", 0)
                    result.draft_n_accepted = chunk["timings"].get("draft_n_accepted", 0)
                    result.cache_n = chunk["timings"].get("cache_n")
                    result.prompt_ms = chunk["timings"].get("prompt_ms")
        result.ok = True
    except Exception as e:  # noqa: BLE001  (a load test reports failures, it does not stop at them)
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.latency_s = time.perf_counter() - started
    return result


async def run_load(url: str, concurrency: int, n_requests: int, max_tokens: int, kinds: list[str],
                   temperature: float = 0.0, api_key: str | None = None, model: str | None = None,
                   extra_body: dict | None = None) -> LoadReport:
    """Send n_requests chat completions from `concurrency` clients at once; return the summary. extra_body: more
    request fields (e.g. llama-server's ignore_eos)."""
    import httpx

    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pool = [(kind, prompt) for kind in kinds for prompt in PROMPTS[kind]]
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0),
                                 limits=httpx.Limits(max_connections=concurrency + 1)) as client:
        if model is None:
            models = (await client.get(f"{url}/v1/models")).json()
            model = models["data"][0]["id"]
        next_index = 0
        results: list[RequestResult] = []

        async def worker() -> None:
            nonlocal next_index
            while next_index < n_requests:
                kind, prompt = pool[next_index % len(pool)]
                next_index += 1  # no await in between: asyncio makes this claim atomic
                results.append(await one_request(client, url, model, kind, prompt, max_tokens, temperature,
                                                 extra_body))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return summarize(results, url, concurrency, max_tokens, wall)


def summarize(results: list[RequestResult], url: str, concurrency: int, max_tokens: int, wall: float) -> LoadReport:
    ok = [r for r in results if r.ok]
    drafted = sum(r.draft_n for r in ok)
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    latencies = [r.latency_s for r in ok]
    return LoadReport(
        url=url, concurrency=concurrency, requests=len(results), max_tokens=max_tokens, wall_s=wall, ok=len(ok),
        failed=len(results) - len(ok), requests_per_s=len(ok) / wall if wall else 0.0,
        output_tokens_per_s=tokens / wall if wall else 0.0,
        latency_p50_s=percentile(latencies, 0.5), latency_p99_s=percentile(latencies, 0.99),
        ttft_p50_s=percentile(ttfts, 0.5), ttft_p99_s=percentile(ttfts, 0.99),
        mean_completion_tokens=tokens / len(ok) if ok else 0.0,
        acceptance_rate=sum(r.draft_n_accepted for r in ok) / drafted if drafted else None, draft_n=drafted,
        errors=sorted({r.error for r in results if r.error})[:10],
    )


def format_report(report: LoadReport) -> str:
    acceptance = f"{100 * report.acceptance_rate:.0f}% of {report.draft_n}" if report.acceptance_rate is not None \
        else "no drafting"
    rows = [
        ("server", report.url),
        ("clients x requests", f"{report.concurrency} x {report.requests} (max_tokens {report.max_tokens})"),
        ("ok / failed", f"{report.ok} / {report.failed}"),
        ("wall time", f"{report.wall_s:.1f} s"),
        ("requests/s", f"{report.requests_per_s:.2f}"),
        ("output tokens/s", f"{report.output_tokens_per_s:.1f} (mean {report.mean_completion_tokens:.0f} a request)"),
        ("latency p50 / p99", f"{report.latency_p50_s:.2f} / {report.latency_p99_s:.2f} s"),
        ("first token p50 / p99", f"{report.ttft_p50_s:.2f} / {report.ttft_p99_s:.2f} s"),
        ("draft acceptance", acceptance),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    lines += [f"error: {e}" for e in report.errors]
    return "\n".join(lines)


def run_loadtest(args: argparse.Namespace) -> int:
    """`tandem loadtest`: run, print the table, optionally write JSON; exit 1 when any request failed."""
    kinds = [k.strip() for k in args.prompt_kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in PROMPTS]
    if unknown or not kinds:
        raise ValueError(f"unknown prompt kinds {unknown}; choose from {', '.join(PROMPTS)}")
    if args.concurrency < 1 or args.requests < 1:
        raise ValueError("--concurrency and --requests must be >= 1")
    report = asyncio.run(run_load(args.url, args.concurrency, args.requests, args.max_tokens, kinds,
                                  args.temperature, args.api_key, args.model))
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(asdict(report), f, indent=2)
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0 if report.failed == 0 else 1
