"""Tests of the packaging (pyproject.toml: the wheel and what it ships)."""
