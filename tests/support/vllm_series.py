"""vLLM's Prometheus series as its own code defines them, read from the installed source.

``vllm/v1/metrics/loggers.py`` creates every ``vllm:*`` series through
``self._gauge_cls`` / ``_counter_cls`` / ``_histogram_cls`` (vLLM 0.19-0.33); reading
that text, rather than importing vLLM, gives the names a dashboard may use.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from deployments.observe.series import Kind, exported

_DEFINED = re.compile(r"self\._(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[a-z0-9_]+)\"")


def loggers_source() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"


def defined() -> dict[str, Kind]:
    """``vllm:`` series name -> kind, as the installed vLLM defines them."""
    text = loggers_source().read_text()
    return {name: Kind(kind) for kind, name in _DEFINED.findall(text)}


def exported_names() -> set[str]:
    """The sample names of vLLM's series after Ray's export (``ray_vllm_...``)."""
    return {n for name, kind in defined().items() for n in exported(name, kind)}
