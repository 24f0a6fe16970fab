"""The package version (kept apart so that low layers can report it without importing the API)."""

__version__ = "0.1.0"
