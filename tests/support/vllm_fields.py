"""Every field of vLLM's request models, by dotted path: from the installed vLLM (import) or
from a release's wheel (an AST walk of its class definitions, no import).

A path is ``field`` or ``field.nested`` where the field's annotation names one of vLLM's
own models (pydantic or dataclass, at any depth through unions, lists and dicts); other
types (openai's TypedDicts, plain dicts: the free-form carriers) end the path.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel

from tests.releases import sources

# (route, vLLM's request model class) for every served route that takes a body.
REQUEST_MODELS = (
    ("/v1/chat/completions", "ChatCompletionRequest"),
    ("/v1/chat/completions/batch", "BatchChatCompletionRequest"),
    ("/v1/completions", "CompletionRequest"),
    ("/v1/responses", "ResponsesRequest"),
    ("/v1/messages", "AnthropicMessagesRequest"),
    ("/v1/messages/count_tokens", "AnthropicCountTokensRequest"),
    ("/tokenize", "TokenizeCompletionRequest"),
    ("/tokenize", "TokenizeChatRequest"),
    ("/detokenize", "DetokenizeRequest"),
)
MAX_DEPTH = 6
_SKIP = {"model_config"}


# ------------------------------------------------------------------ installed (import)


def _vllm_types(annotation: Any) -> Iterator[type]:
    """vLLM's own model classes an annotation names, through unions/lists/dicts."""
    if isinstance(annotation, type):
        module = getattr(annotation, "__module__", "")
        if module.startswith("vllm.") and (issubclass(annotation, BaseModel)
                                           or dataclasses.is_dataclass(annotation)):
            yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _vllm_types(arg)


def _own_fields(cls: type) -> dict[str, Any]:
    if issubclass(cls, BaseModel):
        return {n: f.annotation for n, f in cls.model_fields.items()}
    return {f.name: f.type for f in dataclasses.fields(cast(Any, cls))}  # a vLLM dataclass


def imported_paths(cls: type, prefix: str = "", depth: int = 0,
                   seen: frozenset[type] = frozenset()) -> set[str]:
    """Every field path of an installed model class."""
    paths: set[str] = set()
    try:  # string annotations (forward references) resolved
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable name: the declared annotations stand
        hints = {}
    for name, annotation in _own_fields(cls).items():
        if name in _SKIP or name.startswith("_"):  # private: no client sets it
            continue
        annotation = hints.get(name, annotation)
        path = prefix + name
        paths.add(path)
        if depth >= MAX_DEPTH:
            continue
        for nested in _vllm_types(annotation):
            if nested not in seen:
                paths |= imported_paths(nested, path + ".", depth + 1, seen | {cls})
    return paths


def installed_models() -> dict[str, type]:
    """The installed vLLM's request model classes, by name."""
    from vllm.entrypoints.anthropic import protocol as anthropic
    from vllm.entrypoints.openai.chat_completion import protocol as chat
    from vllm.entrypoints.openai.completion import protocol as completion
    from vllm.entrypoints.openai.responses import protocol as responses
    from vllm.entrypoints.serve.tokenize import protocol as tokenize

    modules = (chat, completion, responses, anthropic, tokenize)
    return {name: getattr(m, name) for _, name in REQUEST_MODELS for m in modules
            if hasattr(m, name)}


# ------------------------------------------------------------------ a wheel (AST)


def wheel_path(version: str) -> Path:
    """The release's wheel in the cache (``tests.releases.sources`` downloads those it
    knows); 0.34 and later: the CUDA ``vllm`` wheel, put there by the release matrix."""
    found = sorted(sources.wheel_dir().glob(f"vllm*-{version}-*.whl"))
    return found[0] if found else sources.wheel(version)


class _Index:
    """Class definitions and module-level aliases of ``vllm/entrypoints`` and the
    sampling params, by name."""

    def __init__(self, wheel: Path):
        self.classes: dict[str, ast.ClassDef] = {}
        self.aliases: dict[str, ast.expr] = {}
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.endswith(".py") and (name.startswith("vllm/entrypoints/")
                                             or name == "vllm/sampling_params.py"):
                    self._add(ast.parse(zf.read(name)))

    def _add(self, tree: ast.Module) -> None:
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, node)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                self.aliases.setdefault(node.targets[0].id, node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.value is not None:
                self.aliases.setdefault(node.target.id, node.value)

    def is_model(self, name: str, seen: frozenset[str] = frozenset()) -> bool:
        """A vLLM pydantic model or dataclass (by its bases or decorator)."""
        node = self.classes.get(name)
        if node is None or name in seen:
            return False
        if any("dataclass" in ast.unparse(d) for d in node.decorator_list):
            return True
        for base in node.bases:
            text = ast.unparse(base)
            if text in ("BaseModel", "OpenAIBaseModel") or self.is_model(text, seen | {name}):
                return True
        return False

    def names_in(self, expr: ast.expr, seen: frozenset[str] = frozenset()) -> set[str]:
        """The model classes an annotation names, through aliases and string forms."""
        found: set[str] = set()
        for node in ast.walk(expr):
            name = None
            if isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                try:
                    found |= self.names_in(ast.parse(node.value, mode="eval").body, seen)
                except SyntaxError:
                    pass
            if name is None or name in seen:
                continue
            if self.is_model(name):
                found.add(name)
            elif name in self.aliases:
                found |= self.names_in(self.aliases[name], seen | {name})
        return found

    def fields(self, name: str) -> dict[str, ast.expr]:
        """Annotated fields of a class and its model bases (bases first)."""
        node = self.classes[name]
        out: dict[str, ast.expr] = {}
        for base in node.bases:
            if self.is_model(ast.unparse(base)):
                out.update(self.fields(ast.unparse(base)))
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                    and not item.target.id.startswith("_") \
                    and "ClassVar" not in ast.unparse(item.annotation):
                out[item.target.id] = item.annotation
        return out

    def paths(self, name: str, prefix: str = "", depth: int = 0,
              seen: frozenset[str] = frozenset()) -> set[str]:
        paths: set[str] = set()
        for field, annotation in self.fields(name).items():
            if field in _SKIP:
                continue
            path = prefix + field
            paths.add(path)
            if depth >= MAX_DEPTH:
                continue
            for nested in self.names_in(annotation):
                if nested not in seen and nested != name:
                    paths |= self.paths(nested, path + ".", depth + 1, seen | {name})
        return paths


def wheel_fields(version: str) -> dict[str, set[str]]:
    """Every field path of each request model in ``version``'s wheel (absent models
    are left out)."""
    index = _Index(wheel_path(version))
    return {name: index.paths(name) for _, name in REQUEST_MODELS if name in index.classes}


def installed_fields() -> dict[str, set[str]]:
    return {name: imported_paths(cls) for name, cls in installed_models().items()}
