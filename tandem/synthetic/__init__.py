"""Synthetic models for tests, benchmarks and the doctor (none is needed to run a real model): named shapes and
random-weight torch models of them (shapes), tiny GGUFs of every architecture and quant type (tiny_gguf, gemma4),
random-weight GGUFs of a named shape that llama.cpp loads like real ones (random_gguf, random_blocks), Gemma 4
assistant head drafts beside a target (heads)."""
