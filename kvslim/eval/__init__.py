"""Evaluation helpers (synthetic long-context retrieval samples)."""
