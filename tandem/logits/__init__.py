"""Logits processing a request asks for: structured output (grammar.py, through llguidance), logit_bias and
penalties (adjust.py, pure functions), and one request's state across speculative steps (processor.py)."""
