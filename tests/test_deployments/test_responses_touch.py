"""The vLLM touch behind the store (``dsv4_patch.responses_touch``) against real vLLM.

The installed release (0.32) by its live class; 0.33 and 0.34 from their wheels
(``tests/releases/sources.py``, marked ``releases``): the dicts the binding replaces
are created in ``OpenAIServingResponses.__init__`` and every method it wraps takes the
arguments the binding passes.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import zipfile

import pytest

from dsv4_patch import registry
from dsv4_patch.responses_touch import CLASS, METHODS, MODULE, READ, STATE

# method -> the parameters (after self) the binding calls it with
CALLED_WITH = {
    "create_responses": ["request", "raw_request"],
    "retrieve_responses": ["response_id", "starting_after", "stream"],
    "cancel_responses": ["response_id"],
    "_run_background_request": ["request"],
    "_run_background_request_stream": ["request"],
}
PATH = MODULE.replace(".", "/") + ".py"


def _check(tree: ast.Module) -> list[str]:
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == CLASS)
    methods = {n.name: n for n in cls.body if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef)}
    problems = []
    init = ast.unparse(methods["__init__"])
    problems += [f"__init__ no longer sets self.{a}" for a in STATE if f"self.{a}" not in init]
    for name, params in CALLED_WITH.items():
        if name not in methods:
            problems.append(f"{name} is gone")
            continue
        args = [a.arg for a in methods[name].args.args[1:]]
        if args[:len(params)] != params:
            problems.append(f"{name}{tuple(args)} no longer takes {params}")
    return problems


def test_installed_vllm_has_what_the_binding_touches() -> None:
    assert READ.probe() is None
    assert READ in registry.all_reads()  # the doctor lists it
    import importlib

    source = inspect.getsource(importlib.import_module(MODULE))
    assert _check(ast.parse(source)) == []
    assert set(CALLED_WITH) <= set(METHODS)


def _wheel_source(version: str) -> str:
    """serving.py of the CUDA ``vllm`` wheel ``version`` (downloaded once, like the matrix)."""
    from tests.releases import sources

    folder = sources.wheel_dir()
    found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                        "-d", str(folder), f"vllm=={version}"], check=True)
        found = sorted(folder.glob(f"vllm-{version}-*.whl"))
    with zipfile.ZipFile(found[0]) as zf:
        return zf.read(PATH).decode()


@pytest.mark.releases
@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_released_vllm_has_what_the_binding_touches(version: str) -> None:
    assert _check(ast.parse(_wheel_source(version))) == [], version
