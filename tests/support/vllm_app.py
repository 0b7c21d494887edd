"""vLLM's own OpenAI app, built without an engine: what the edge tests harden.

``build_app`` mounts every route ``vllm serve`` mounts; no engine is attached, so a
request that reaches a route handler fails, which is what the edge tests want to see
handled (tests/test_deployments/test_front.py, test_edge_surface.py, test_model_cards.py,
test_edge_scrub.py).
"""

from __future__ import annotations

import argparse

from fastapi import FastAPI


def vllm_app() -> FastAPI:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import FrontendArgs

    args = argparse.Namespace(**(vars(FrontendArgs()) | vars(AsyncEngineArgs(model="m"))))
    return build_app(args, supported_tasks=("generate",))
