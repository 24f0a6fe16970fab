"""Helpers for tests and examples: tiny random-weight checkpoints of real MoE layouts (``zoo``);
pytest marks the suite shares (``marks``, which imports pytest)."""
