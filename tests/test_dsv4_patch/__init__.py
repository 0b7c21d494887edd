"""Tests of the ``dsv4_patch`` package (mirrors its modules)."""
