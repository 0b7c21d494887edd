"""End to end: a real vLLM engine, the asserting 0.24-0.29 resolver in every process.

Proves the plugin is what makes ``kv_cache_dtype="auto"`` boot: the same engine
dies with the upstream AssertionError when the plugin is disabled
(``VLLM_PLUGINS=""``) and boots when it is enabled, with every worker reporting
fp8_ds_mla pages in 576 B multiples.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import engine_boot, legacy_resolver

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BOOT_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def tiny_model_dir() -> Path:
    from dsv4_patch.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


def _boot(model_dir: Path, plugins: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "tests" / "support" / "engine_site"), str(REPO)]
    )
    env["DSV4_TEST_LEGACY_RESOLVER"] = "1"
    env.pop("VLLM_PLUGINS", None)
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    return subprocess.run(
        [sys.executable, "-m", "tests.support.engine_boot", str(model_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=BOOT_TIMEOUT_S,
    )


def _result(proc: subprocess.CompletedProcess[str]) -> dict:
    result = engine_boot.result_of(proc.stdout)
    if result is not None:
        return result
    raise AssertionError(f"engine did not boot (rc={proc.returncode}):\n{proc.stderr[-4000:]}")


def test_plugin_disabled_crashes_with_upstream_assertion(tiny_model_dir: Path) -> None:
    proc = _boot(tiny_model_dir, plugins="")
    output = proc.stdout + proc.stderr  # vLLM logs worker tracebacks to stdout
    assert proc.returncode != 0
    assert f"AssertionError: {legacy_resolver.UPSTREAM_ASSERTION}" in output


@pytest.fixture(scope="module")
def booted(tiny_model_dir: Path) -> dict:
    return _result(_boot(tiny_model_dir, plugins=None))


def test_plugin_enabled_boots_and_fixes_every_worker(booted: dict) -> None:
    assert booted["workers"], "no worker answered collective_rpc"
    for worker in booted["workers"]:
        patches = {p["name"]: p for p in worker["patch_record"]["patches"]}
        fix = patches["dsv4.resolve_kv_cache_dtype"]
        assert fix["status"] == "applied", fix
        assert "AssertionError" in fix["reason"]  # the probe met the legacy resolver


def test_workers_report_fp8_ds_mla_pages_in_576_multiples(booted: dict) -> None:
    for worker in booted["workers"]:
        mla = [s for s in worker["specs"] if s["cache_dtype_str"] is not None]
        assert mla, worker["specs"]
        for spec in mla:
            if spec["cache_role"] == "indexer" or "indexer" in spec["layer"]:
                continue
            assert spec["cache_dtype_str"] == "fp8_ds_mla", spec
            assert spec["page_size_bytes"] % 576 == 0, spec
        assert any(s["compress_ratio"] in (4, 128) for s in mla)


def test_frontend_keeps_the_users_setting(booted: dict) -> None:
    # Only workers resolve; the front-end's cache_config still says what the user wrote.
    assert booted["frontend_cache_dtype"] == "auto"
