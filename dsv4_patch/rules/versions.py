"""vLLM release numbers, and which releases assert on ``auto`` (the bug dsv4_patch fixes)."""

from __future__ import annotations

# ---------------------------------------------------------------- vLLM versions

ASSERTING_RESOLVER = ((0, 20), (0, 30))  # [first, end) minor versions that assert on auto


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.29.0"`` / ``"0.30.1.dev3+g..."`` -> (0, 29, 0); unknown parts count as 0."""
    parts: list[int] = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]
