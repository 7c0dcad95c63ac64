"""Peers run in the same bench process on the same GGUF pair: Hugging Face transformers, plain and assisted.
More: docs/internals.md."""

from __future__ import annotations

import os
import time

import torch


class HFPeer:
    def __init__(self, target_path: str, draft_path: str | None, device: str, dtype: str, static: bool = False) -> None:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as e:
            raise ValueError(f"--peer hf needs transformers: {e}") from None
        from tandem.backends.torch_backend import parse_dtype

        self.device, self.dtype = torch.device(device), parse_dtype(dtype)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: never reach for the hub

        def load(path: str):
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                         gguf_file=os.path.basename(path), dtype=self.dtype)
            return model.to(self.device).eval()

        self.static = static
        self.name = "hf-static" if static else "hf"
        self.target_path, self.draft_path = target_path, draft_path
        self.target = load(target_path)
        self.draft = load(draft_path) if draft_path else None
        self.warm = False

    def describe(self) -> dict:
        import transformers

        return {"library": "transformers", "version": transformers.__version__, "target": self.target_path,
                "draft": self.draft_path, "device": str(self.device), "dtype": str(self.dtype),
                "cache": "static (compiled by generate on CUDA)" if self.static else "dynamic, eager"}

    def _generate(self, ids: list[int], max_tokens: int, assisted: bool) -> tuple[list[int], float]:
        input_ids = torch.tensor([ids], device=self.device)
        extra = {"assistant_model": self.draft} if assisted else {}
        if self.static:
            extra["cache_implementation"] = "static"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=max_tokens, pad_token_id=self.target.config.eos_token_id,
                                       **extra)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out[0, len(ids):].tolist(), time.perf_counter() - started

    def run(self, ids: list[int], max_tokens: int) -> dict:
        """tokens/s of plain and assisted greedy generation (wall clock, prompt included) and their ratio."""
        modes = [False] + ([True] if self.draft is not None else [])
        if self.static:
            self._generate(ids, max_tokens, False)
        elif not self.warm:
            for assisted in modes:
                self._generate(ids, min(max_tokens, 8), assisted)
            self.warm = True
        out: dict = {}
        tokens = {}
        for assisted in modes:
            key = "assisted" if assisted else "plain"
            tokens[key], seconds = self._generate(ids, max_tokens, assisted)
            out[f"{key}_tps"] = len(tokens[key]) / seconds if seconds > 0 else 0.0
            out[f"{key}_tokens"] = len(tokens[key])
        if self.draft is not None:
            out["speedup"] = out["assisted_tps"] / out["plain_tps"] if out["plain_tps"] else 0.0
            out["lossless"] = tokens["assisted"] == tokens["plain"]
        return out
