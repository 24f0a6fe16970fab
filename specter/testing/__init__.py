"""Helpers for tests and examples: tiny random-weight checkpoints of real MoE layouts (``zoo``)."""
