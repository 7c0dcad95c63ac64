"""The bench's prompt suite: the four kinds of the report we start from, plus an edit that copies its input.
More: docs/internals.md."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

# 40 lines; the variable `x` appears throughout, so the rename touches most lines but copies their structure.
EDIT_SOURCE = '''def summarize_readings(readings, window=5, threshold=2.5):
    """Smooth sensor readings and flag outliers."""
    if not readings:
        return {"mean": None, "smoothed": [], "outliers": []}
    smoothed = []
    outliers = []
    total = 0.0
    for i, x in enumerate(readings):
        total += x
        start = max(0, i - window + 1)
        chunk = readings[start : i + 1]
        avg = sum(chunk) / len(chunk)
        smoothed.append(avg)
        spread = max(chunk) - min(chunk)
        if spread == 0:
            continue
        score = abs(x - avg) / spread
        if score > threshold:
            outliers.append({"index": i, "value": x, "score": score})
    mean = total / len(readings)
    variance = 0.0
    for x in readings:
        variance += (x - mean) ** 2
    variance /= len(readings)
    stdev = variance ** 0.5
    low = mean - threshold * stdev
    high = mean + threshold * stdev
    clipped = []
    for x in readings:
        if x < low:
            clipped.append(low)
        elif x > high:
            clipped.append(high)
        else:
            clipped.append(x)
    return {
        "mean": mean,
        "stdev": stdev,
        "smoothed": smoothed,
        "clipped": clipped,
        "outliers": outliers,
    }'''


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    kind: str  # code | freeform | json | summary | edit | custom
    messages: tuple[dict, ...]  # chat messages, rendered with the target's chat template


def _user(name: str, kind: str, text: str) -> BenchPrompt:
    return BenchPrompt(name, kind, ({"role": "user", "content": text},))


DEFAULT_SUITE: tuple[BenchPrompt, ...] = (
    _user("code", "code", "Write a Python function that returns the n-th Fibonacci number iteratively, with a "
          "docstring and type hints, then a short example of calling it."),
    _user("freeform", "freeform", "Tell a short story about a lighthouse keeper who finds a message in a bottle."),
    _user("json", "json", "Return only a JSON object describing a book with fields title, author, year, genres "
          "(a list of strings), isbn and a nested publisher object with name and city."),
    _user("summary", "summary", "Summarize in three sentences: Speculative decoding lets a small draft model "
          "propose several tokens that a large target model then verifies in a single forward pass. Because the "
          "target checks every proposed token against its own distribution, the output is exactly what the target "
          "alone would produce. The speed-up depends on how often the draft is right, on how cheap a draft step "
          "is next to a target step, and on how little a batch of tokens costs the target more than one token."),
    _user("code-edit", "edit", "Here is a Python function. Rename the variable `x` to `value` everywhere and "
          "return the whole function, unchanged otherwise, in one Python code block.\n\n```python\n"
          + EDIT_SOURCE + "\n```"),
)


def load_suite(spec: str = "default", names: str | None = None) -> list[BenchPrompt]:
    """The default suite or a JSON file's prompts, optionally only those named in a comma list."""
    if spec == "default":
        prompts = list(DEFAULT_SUITE)
    elif os.path.exists(spec):
        with open(spec, encoding="utf-8") as f:
            entries = json.load(f)
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"suite {spec!r}: expected a non-empty JSON list of prompts")
        prompts = [_from_entry(spec, i, e) for i, e in enumerate(entries)]
    else:
        raise ValueError(f"suite {spec!r}: not 'default' and no such file")
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        known = {p.name: p for p in prompts}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise ValueError(f"unknown prompt(s) {', '.join(unknown)}; the suite has {', '.join(known)}")
        prompts = [known[n] for n in wanted]
    return prompts


def _from_entry(spec: str, i: int, entry: dict) -> BenchPrompt:
    if not isinstance(entry, dict) or ("prompt" in entry) == ("messages" in entry):
        raise ValueError(f"suite {spec!r} entry {i}: give exactly one of 'prompt' (text) or 'messages' (a chat)")
    name = str(entry.get("name", f"prompt{i}"))
    kind = str(entry.get("kind", "custom"))
    if "prompt" in entry:
        return _user(name, kind, str(entry["prompt"]))
    return BenchPrompt(name, kind, tuple(entry["messages"]))
