"""Each "the one X" of the house is one by construction: a second one fails here.

Read statically (ast); nothing is imported. What is checked:

* one series catalogue: no product module but ``deployments/observe/series.py`` builds a
  Prometheus/Ray metric (``Gauge``/``Counter``/``Histogram`` of ``ray.util.metrics``,
  ``ray.serve.metrics`` or ``prometheus_client``); every other module asks
  ``series.make`` for a series the catalogue lists. The one exception is named below.
* one resolution of ``kv_cache_dtype: auto``: no module outside ``dsv4_patch/rules/``
  compares a dtype-named value with ``"auto"`` (``rules.build`` and its resolvers do).
* one place orders every layer in front of vLLM's handler: only
  ``deployments/http/edge.py`` adds to an app's ``user_middleware`` or builds a
  Starlette ``Middleware``; elsewhere the list may only be filtered.
* one check of ``engine_kwargs.worker_extension_cls``: the literal key is compared in
  ``deployments/config/llm.py`` only.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.house import REPO, python_files

CATALOGUE = "deployments/observe/series.py"
METRIC_MODULES = ("ray.util.metrics", "ray.serve.metrics", "prometheus_client")
METRIC_CLASSES = frozenset({"Gauge", "Counter", "Histogram", "Summary"})
# Files allowed to build metrics other than the catalogue, and why.
NOT_OURS = {
    # Re-exports vLLM's own engine histograms under vLLM's names (``vllm:*``, read by
    # tests/support/vllm_series.py against the installed vLLM): not dsv4 series.
    "deployments/serving/engine_metrics.py",
}


def metric_builders(source: str) -> list[tuple[int, str]]:
    """(line, call) for every metric constructor ``source`` calls."""
    tree = ast.parse(source)
    names: set[str] = set()  # Gauge, ... imported from a metrics module
    modules: set[str] = set()  # local names bound to a metrics module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in METRIC_MODULES or (alias.name == "metrics" and node.module in (
                        "ray.util", "ray.serve")):
                    modules.add(alias.asname or alias.name)
                elif node.module.startswith(METRIC_MODULES) and alias.name in METRIC_CLASSES:
                    names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in METRIC_MODULES:
                    modules.add(alias.asname or alias.name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in names:
            found.append((node.lineno, func.id))
        elif isinstance(func, ast.Attribute) and func.attr in METRIC_CLASSES \
                and ast.unparse(func.value) in modules:
            found.append((node.lineno, ast.unparse(func)))
    return found


def product_files() -> list[Path]:
    return python_files("deployments", "dsv4_patch")


def test_only_the_catalogue_builds_metrics() -> None:
    found = []
    for path in product_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in NOT_OURS or rel == CATALOGUE:
            continue
        found += [f"{rel}:{line} builds {call}: list the series in {CATALOGUE} and create "
                  "it with series.make" for line, call in metric_builders(path.read_text())]
    assert not found, "\n".join(found)


def test_the_catalogue_check_sees_each_way_to_build_a_metric() -> None:
    assert metric_builders("from ray.serve.metrics import Gauge\nGauge('x', 'y')\n")
    assert metric_builders("from ray.util import metrics\nmetrics.Counter('x', 'y')\n")
    assert metric_builders("from ray.util import metrics as m\nm.Histogram('x', 'y')\n")
    assert metric_builders("import prometheus_client\nprometheus_client.Gauge('x', 'y')\n")
    assert not metric_builders("from collections import Counter\nCounter('abc')\n")
    assert metric_builders((REPO / CATALOGUE).read_text())  # the catalogue itself builds


def test_the_catalogue_lists_every_dsv4_series_the_docs_name() -> None:
    """A ``dsv4_*`` series named in the docs or the dashboard is one the catalogue has."""
    import re

    from deployments.observe import series

    known = {s.name for s in series.ALL} | {n for s in series.ALL for n in s.exported()}
    # Prefixes of our series: a name with one of them is a series, not a setting.
    prefixes = ("dsv4_kv_spec_", "dsv4_kv_replica_", "dsv4_kv_layout_", "dsv4_kv_page_",
                "dsv4_kv_bytes_", "dsv4_kv_capacity_", "dsv4_kv_budget_", "dsv4_serve_",
                "dsv4_api_key_file_", "dsv4_responses_store_", "dsv4_pd_")
    texts = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md",
             *sorted((REPO / "k8s" / "monitoring").glob("*.json"))]
    found = []
    for path in texts:
        for name in set(re.findall(r"\b(?:ray_)?(dsv4_[a-z0-9_]+)", path.read_text())):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            if name.startswith(prefixes) and name not in known and base not in known \
                    and not name.endswith("_"):
                found.append(f"{path.relative_to(REPO)} names {name}: not in {CATALOGUE}")
    assert not found, "\n".join(sorted(found))


def test_one_check_of_the_worker_extension() -> None:
    found = []
    for path in product_files():
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "get" and node.args \
                    and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value == "worker_extension_cls" \
                    and rel != "deployments/serving/server.py":
                found.append(f"{rel}:{node.lineno} reads worker_extension_cls itself")
            if isinstance(node, ast.Raise) and "worker_extension_cls" in ast.unparse(node) \
                    and rel != "deployments/config/llm.py":
                found.append(f"{rel}:{node.lineno} refuses worker_extension_cls itself: "
                             "call deployments.config.llm.ours_or_unset")
    assert not found, "\n".join(found)


def test_one_reader_of_config_json() -> None:
    """A product function that names ``config.json`` and parses JSON is a second reader:
    read it through ``deployments.plan.model_configs.read_config_json`` (flat once)."""
    reader = "deployments/plan/model_configs.py"
    found = []
    for path in python_files("deployments"):
        rel = path.relative_to(REPO).as_posix()
        if rel == reader:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            text = "\n".join(ast.unparse(stmt) for stmt in body)
            if "config.json" in text and ("json.load" in text or "flatten_config" in text):
                found.append(f"{rel}:{node.lineno} {node.name} reads config.json itself")
    assert not found, "\n".join(found)
    text = (REPO / reader).read_text()
    assert "def read_config_json" in text and "flatten_config" in text


# The rules accept a config in either form (vLLM hands them its own flat one); every
# product module above them gets the flat form from the reader.
FLATTENS_ALLOWED = ("deployments/plan/model_configs.py", "dsv4_patch/rules/")


def flatten_calls(source: str) -> list[int]:
    """Lines of ``source`` that call ``flatten_config`` (bare or as an attribute)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call)
            and ast.unparse(node.func).rsplit(".", 1)[-1] == "flatten_config"]


def test_config_json_is_flattened_once_where_it_is_read() -> None:
    """A product module that flattens a config again doubts the one reader: take the
    config from ``read_config_json`` (or ``find_model_config``), already flat."""
    found = []
    for path in python_files("deployments", "dsv4_patch"):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(FLATTENS_ALLOWED):
            found += [f"{rel}:{line} flattens a config again"
                      for line in flatten_calls(path.read_text())]
    assert not found, "\n".join(found)
    assert flatten_calls("x = rules.flatten_config(cfg)\n")
    assert flatten_calls("x = flatten_config(cfg)\n")
    assert flatten_calls((REPO / FLATTENS_ALLOWED[0]).read_text())


# A kv-cache-dtype value is named so: ``kv_cache_dtype``, ``cache_dtype``, ``requested``...
DTYPE_NAMES = ("dtype", "requested")
# Where ``auto`` is mapped: the rules (``dsv4_patch.rules.dtypes`` for V4, ``family`` for
# V4.1, both under ``rules.build``). Every other site calls them; none is allowed besides
# (the run-time patch of vLLM's resolver answers through ``rules.upstream_resolver_decision``).
AUTO_ALLOWED: frozenset[str] = frozenset()


def auto_mappings(source: str) -> list[tuple[int, str]]:
    """(line, code) for each comparison of a dtype-named value with the literal ``auto``,
    and each dict keyed by ``auto`` next to a dtype name: mapping ``auto`` by hand."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literal = any(isinstance(c, ast.Constant) and c.value == "auto"
                          for side in sides for c in ast.walk(side))
            named = any(word in ast.unparse(side).lower() for side in sides
                        for word in DTYPE_NAMES)
            if literal and named:
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.stmt) and not hasattr(node, "body") and any(
                isinstance(d, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "auto"
                                                for k in d.keys) for d in ast.walk(node)) \
                and any(w in ast.unparse(node).lower() for w in DTYPE_NAMES):
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def test_one_resolution_of_auto() -> None:
    """``kv_cache_dtype: auto`` is resolved by ``dsv4_patch.rules`` only (``rules.build``
    and the resolvers it is made of); a module that compares a dtype with ``"auto"`` is
    a second resolution: call ``rules.build`` (or its node step, ``rules.build_v4_node`` /
    ``rules.v41_record``)."""
    found = []
    for path in python_files("deployments", "dsv4_patch"):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("dsv4_patch/rules/") or rel in AUTO_ALLOWED:
            continue
        found += [f"{rel}:{line} maps auto itself: {code}"
                  for line, code in auto_mappings(path.read_text())]
    assert not found, "\n".join(found)


# The resolvers ``rules.build`` is made of, and the one module that calls them (their
# defining modules aside). ``upstream_resolver_decision`` is not among them: it is vLLM's
# own resolver, fixed, which the run-time patch installs (``patches/kv_dtype.py``).
RESOLVERS = {"resolve_kv_cache_dtype": "dsv4_patch/rules/dtypes.py",
             "resolve_v41_kv_cache_dtype": "dsv4_patch/rules/family.py"}
BUILD = "dsv4_patch/rules/engine.py"


def resolver_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) for each name, attribute or import of a resolver in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in RESOLVERS:
                found.append((node.lineno, name))
        if isinstance(node, ast.ImportFrom):
            found += [(node.lineno, a.name) for a in node.names if a.name in RESOLVERS]
    return found


def test_only_the_build_calls_the_resolvers() -> None:
    """Every site that needs what ``kv_cache_dtype`` becomes asks ``rules.build`` (or
    its node step): a second caller of a resolver is a second answer that can drift
    from the build's (its layout, its release checks)."""
    found = []
    for path in python_files("deployments", "dsv4_patch"):
        rel = path.relative_to(REPO).as_posix()
        if rel == BUILD:
            continue
        found += [f"{rel}:{line} uses {name}: ask rules.build / rules.build_v4_node"
                  for line, name in resolver_uses(path.read_text())
                  if RESOLVERS[name] != rel]
    assert not found, "\n".join(found)
    from dsv4_patch import rules

    assert not set(RESOLVERS) & set(rules.__all__), "the rules' face hands on a resolver"
    assert {n for _, n in resolver_uses((REPO / BUILD).read_text())} == set(RESOLVERS)
    assert resolver_uses("from dsv4_patch import rules\nrules.resolve_kv_cache_dtype(x, y)\n")


def test_the_auto_scan_sees_a_hand_mapping() -> None:
    assert auto_mappings('if kv_cache_dtype == "auto":\n    x = 1\n')
    assert auto_mappings('x = requested in ("auto", None)\n')
    assert auto_mappings('x = {"auto": "fp8_ds_mla"}.get(cache_dtype)\n')
    assert not auto_mappings('x = replicas == "auto"\n')
    # The rules' own mapping is what the scan sees (so an empty result elsewhere is real).
    assert auto_mappings((REPO / "dsv4_patch/rules/dtypes.py").read_text())


LAYER_PLACE = "deployments/http/edge.py"


def layer_placements(source: str) -> list[tuple[int, str]]:
    """(line, code) for each way ``source`` puts a middleware into an app: ``add_middleware``,
    ``Middleware(...)``, ``user_middleware`` grown (insert/append/extend/slice) or replaced
    by anything but a filter of itself."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else \
                node.func.id if isinstance(node.func, ast.Name) else ""
            grows = name in ("insert", "append", "extend") and \
                isinstance(node.func, ast.Attribute) and "user_middleware" in \
                ast.unparse(node.func.value)
            if name in ("add_middleware", "Middleware") or grows:
                found.append((node.lineno, ast.unparse(node)[:80]))
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not any("user_middleware" in ast.unparse(t) for t in targets):
                continue
            value = node.value
            is_filter = isinstance(node, ast.Assign) and isinstance(value, ast.ListComp) \
                and isinstance(value.elt, ast.Name) and all(
                    isinstance(t, ast.Attribute) for t in targets) and all(
                    isinstance(g.target, ast.Name) and g.target.id == value.elt.id
                    for g in value.generators)
            if not is_filter:
                found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def test_one_place_orders_the_layers() -> None:
    """``front.harden`` and the Responses store place their layers through
    ``edge.place``/``place_innermost`` (order: ``edge_stack``); nowhere else adds one."""
    found = []
    for path in python_files("deployments"):
        rel = path.relative_to(REPO).as_posix()
        if rel != LAYER_PLACE:
            found += [f"{rel}:{line} places a middleware itself: {code}"
                      for line, code in layer_placements(path.read_text())]
    assert not found, "\n".join(found)
    assert layer_placements((REPO / LAYER_PLACE).read_text()), "the scan sees nothing in edge.py"


def test_the_layer_scan_sees_each_way_in() -> None:
    for code in ("app.add_middleware(X)\n", "app.user_middleware.append(m)\n",
                 "app.user_middleware[:0] = layers\n", "app.user_middleware += [m]\n",
                 "m = Middleware(X)\n", "app.user_middleware = [m, *app.user_middleware]\n"):
        assert layer_placements(code), code
    assert not layer_placements(
        "app.user_middleware = [m for m in app.user_middleware if m.cls is not C]\n")
