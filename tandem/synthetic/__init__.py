"""Synthetic models for tests, benchmarks and the doctor: nothing here is needed to run a real model.

    shapes.py          named model shapes (qwen2.5-0.5b ... 32b) and random-weight torch models of them
    tiny_gguf.py       tiny random GGUFs written from scratch (every supported architecture and quant type)
    gemma4.py          the tiny Gemma 4 stand-ins tiny_gguf writes
    random_gguf.py     random-weight GGUFs of a named shape that llama.cpp loads like real ones
    random_blocks.py   random quantised blocks with realistic scales
"""
