"""Tests of the ``deployments`` package (mirrors its modules)."""
