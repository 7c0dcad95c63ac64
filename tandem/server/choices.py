"""One choice of a response, assembled from the engine's chunks: its text (the echoed prompt first, with echo), its
tool calls parsed out of that text, its logprobs, how it finished. Streamed and whole responses are built from the
same calls, so a stream reassembles to the whole answer."""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine import GenerationChunk
from tandem.server import responses
from tandem.server.tools import ToolCallParser
from tandem.speculative.stats import GenerationStats


class Choice:
    """One choice as its chunks arrive. Streamed and whole responses come from the same `add` calls, so they carry
    the same answer: `add` returns what a stream sends for the chunk; `whole` is the choice object."""

    def __init__(self, index: int, kind: responses.Kind, piece: Callable[[int], str], tool_format: str | None,
                 tool_names: list[str], max_calls: int | None = None,
                 token_bytes: Callable[[int], bytes] | None = None) -> None:
        """piece(id): a token's text as logprobs show it, token_bytes(id) its own bytes; tool_format: parse tool
        calls in this format (None: none), to the functions in tool_names; max_calls: the choice ends once it holds
        this many calls (parallel_tool_calls false: one), as a stop string would end it; the caller then cancels its
        generation."""
        self.index, self.kind, self.piece, self.max_calls = index, kind, piece, max_calls
        self.token_bytes = token_bytes or (lambda token: piece(token).encode())
        self.parser = ToolCallParser(tool_format, tool_names) if tool_format else None
        self.texts: list[str] = []
        self.calls: list[dict] = []
        self.scored: list = []  # TokenLogprob of every token so far (echoed prompt tokens first)
        self.n_tokens = 0
        self.offsets = responses.TextOffsets(self.token_bytes)  # completions' logprobs text_offset
        self.echoed: tuple[str, dict | None] | None = None  # what a stream sends first with echo: text, logprobs
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended it, if one did
        self.stats = GenerationStats()
        self.prompt_tokens = 0  # set by the caller: for the stats of a choice that ends before its generation
        self.ended_early = False  # it ended before its generation did (max_calls): cancel that generation

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def echo(self, prompt_text: str, prompt_scored: list | None) -> None:
        """Put the prompt before the completion (completions' echo), with its tokens' logprobs when scored."""
        self.texts.append(prompt_text)
        logprobs = None
        if prompt_scored is not None:
            logprobs = self._logprobs(prompt_scored)
        self.echoed = (prompt_text, logprobs)

    def add(self, chunk: GenerationChunk) -> tuple[str, list[dict] | None, dict | None]:
        """Take a chunk; return what a stream sends for it: text, tool-call deltas, logprobs."""
        text, calls = chunk.text, []
        if self.parser is not None:
            text, calls = self.parser.push(chunk.text)
            if chunk.finish_reason is not None:
                tail, more = self.parser.finish()
                text, calls = text + tail, calls + more
        enough = self.max_calls is not None and len(self.calls) + len(calls) >= self.max_calls
        if enough:
            calls = calls[:self.max_calls - len(self.calls)]
        self.texts.append(text)
        deltas = [c.openai(index=len(self.calls) + i) for i, c in enumerate(calls)]  # a whole call per delta
        self.calls += [c.openai() for c in calls]
        self.n_tokens += len(chunk.tokens)
        logprobs = None
        if chunk.logprobs:
            logprobs = self._logprobs(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.stop_string = chunk.stop_string
            self.close("tool_calls" if self.calls else chunk.finish_reason, chunk.stats)
        elif enough:  # ended here: the generation's own stats never come, so these count what it returned
            self.close("tool_calls", GenerationStats(prompt_tokens=self.prompt_tokens, generated_tokens=self.n_tokens))
            self.ended_early = True
        return text, deltas or None, logprobs

    def _logprobs(self, entries: list) -> dict:
        self.scored += entries
        offsets = self.offsets.take([e.token for e in entries])
        return responses.logprobs_object(self.kind, entries, self.piece, self.token_bytes, offsets)

    def close(self, finish_reason: str, stats: GenerationStats) -> None:
        self.finish_reason, self.stats = finish_reason, stats

    def whole(self, with_logprobs: bool) -> dict:
        text = "".join(self.texts)
        logprobs = responses.logprobs_object(self.kind, self.scored, self.piece, self.token_bytes,
                                             self.offsets.all) if with_logprobs else None
        content = None if self.calls and not text else text
        return responses.choice_object(self.kind, self.index, content, self.finish_reason, logprobs, self.calls)
