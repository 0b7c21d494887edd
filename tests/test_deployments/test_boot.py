"""Replica boot (``deployments/serving/boot.py``): what a replica skips between its
start and its first answer, and what it keeps."""

from __future__ import annotations

import threading

import pytest

from deployments.serving import boot


def test_node_init_is_skipped_only_for_a_local_directory_on_the_only_node(tmp_path) -> None:
    assert boot.skip_reason(str(tmp_path), "n1", {"n1"})
    assert boot.skip_reason(str(tmp_path), "n1", {"n1", "n2"}) is None  # others download
    assert boot.skip_reason(str(tmp_path), "n1", set()) is None
    assert boot.skip_reason("deepseek-ai/DeepSeek-V4-Flash", "n1", {"n1"}) is None
    assert boot.skip_reason(None, "n1", {"n1"}) is None


@pytest.mark.parametrize("usage_stats_on", [False, True])
def test_the_telemetry_push_never_blocks_and_runs_only_with_usage_stats_on(
        usage_stats_on: bool) -> None:
    """Ray Serve LLM's push blocks on a detached actor; deferred, the caller returns at
    once, and the same arguments reach it on another thread when usage stats are on."""
    release, done = threading.Event(), threading.Event()
    seen: list[tuple[object, str]] = []

    def slow_push(*args: object, **kwargs: object) -> None:
        release.wait(10)
        seen.append((kwargs.get("all_models"), threading.current_thread().name))
        done.set()

    boot.deferred_push(slow_push, usage_stats_on)(all_models=["m"])
    assert not seen  # returned before the push could finish
    release.set()
    assert done.wait(10 if usage_stats_on else 0.5) is usage_stats_on
    assert seen == ([(["m"], "dsv4-llm-telemetry")] if usage_stats_on else [])


def test_the_telemetry_touch_is_present_on_the_pinned_ray() -> None:
    from deployments import ray_touches

    assert ray_touches.present("ray_llm.telemetry_push")
