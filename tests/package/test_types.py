"""No `Any` on a signature where a real type exists: every parameter or return annotated
`Any` in src/dtrain is listed in ALLOWED with the reason no narrower type fits.

Counted: a parameter or return whose annotation is exactly `Any`, `Any | None`,
`Optional[Any]`, or a module-level alias of `Any` (`GroupLike = Any` would hide one).
Not counted, on purpose:
- containers of Any (`dict[str, Any]`, `list[Any]`): JSON-like data, a config's options,
  metadata whose values are of mixed types;
- `*args: Any` and `**kwargs: Any`: arguments forwarded unchanged to a callee whose
  signature dtrain does not know (a wrapped module's forward, torch's native collectives).

A value that is only inspected (isinstance, `tree_flatten`, formatted) is typed `object`,
not `Any`. A new `Any` fails the test until it gets a real type or a line in ALLOWED; an
entry of ALLOWED that no longer matches fails it too, so the list stays true.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import SRC

PACKAGE = SRC / "dtrain"

ALLOWED: dict[str, str] = {
    "dtrain:__getattr__:return":
        "a lazily imported attribute of the package (PEP 562): any of its public names",
    "dtrain.data:__getattr__:return":
        "a lazily imported attribute of the package (PEP 562): any of its public names",
    "dtrain.ft.live.handover:_json_value:value": "a JSON value, checked here",
    "dtrain.ft.live.handover:_json_value:return": "a JSON value, returned as checked",
    "dtrain.timeline:_write_json:value": "a JSON value (the trace file's document)",
    "dtrain.models:loss_of_output:output":
        "any model's forward output: a (logits, loss) tuple or an object with .loss "
        "(a transformers ModelOutput)",
    "dtrain.models.init:_NoValuesOnMeta.__torch_function__:return":
        "torch's own untyped API: whatever the intercepted torch function returns",
    "dtrain.models.recompute:_recomputed_forward:return":
        "whatever the recomputed module's forward returns",
    "dtrain.data_parallel.wrapper:DataParallel.forward:return":
        "whatever the wrapped module's forward returns",
    "dtrain.data_parallel.zero.wrapper:ZeRO.forward:return":
        "whatever the wrapped module's forward returns",
    "dtrain.planner.traced.trace:_keep_backward_label.watched:return":
        "whatever the watched autograd function returns",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _any_aliases(trees: dict[str, ast.Module]) -> set[str]:
    """Names bound at module level to `Any` itself (`X = Any`, `X: TypeAlias = Any`)."""
    names = set()
    for tree in trees.values():
        for node in tree.body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            if not (isinstance(value, ast.Name) and value.id == "Any"):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _is_any(annotation: ast.expr | None, aliases: set[str]) -> bool:
    """Whether `annotation` is `Any`, `Any | None`, `Optional[Any]` (or an alias of Any)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body  # a quoted annotation
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any" or annotation.id in aliases
    if isinstance(annotation, ast.Attribute):  # typing.Any
        return annotation.attr == "Any"
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        sides = (annotation.left, annotation.right)
        none = [s for s in sides if isinstance(s, ast.Constant) and s.value is None]
        return len(none) == 1 and any(_is_any(s, aliases) for s in sides)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in (
            "Optional", "typing.Optional"):
        return _is_any(annotation.slice, aliases)
    return False


def _signatures(node: ast.AST, prefix: tuple[str, ...] = ()):
    """(qualified name, function node) of every function and method under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            yield from _signatures(child, (*prefix, child.name))
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = (*prefix, child.name)
            yield ".".join(name), child
            yield from _signatures(child, name)
        else:
            yield from _signatures(child, prefix)


def any_typed() -> dict[str, int]:
    """`module:function:parameter` (or `:return`) -> line, for each one typed `Any`."""
    trees = {_module_name(p): ast.parse(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    aliases = _any_aliases(trees)
    found = {}
    for module, tree in trees.items():
        for name, fn in _signatures(tree):
            args = fn.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):  # not *args, **kw
                if _is_any(arg.annotation, aliases):
                    found[f"{module}:{name}:{arg.arg}"] = arg.lineno
            if _is_any(fn.returns, aliases):
                found[f"{module}:{name}:return"] = fn.lineno
    return found


def test_every_any_on_a_signature_is_listed_with_its_reason() -> None:
    found = any_typed()
    new = sorted(f"{key} (line {line})" for key, line in found.items() if key not in ALLOWED)
    assert new == [], ("typed Any where a real type exists: give it one (a Config section, "
                       "comm.GroupLike, nn.Module, torch.Tensor, a Protocol in the lower "
                       "layer, `object` for a value only inspected) or list it in ALLOWED "
                       "with its reason")


def test_no_stale_entry_in_allowed() -> None:
    found = any_typed()
    assert sorted(key for key in ALLOWED if key not in found) == []


def test_the_allowed_list_stays_small() -> None:
    assert len(ALLOWED) < 20
    assert all(reason.strip() for reason in ALLOWED.values())


def test_the_scan_sees_each_form_of_any() -> None:
    """The forms counted are recognized, and the forms left out are left out."""
    source = ("from typing import Any, Optional\nAlias = Any\n"
              "def f(a: Any, b: Any | None, c: Optional[Any], d: 'Any', e: Alias,\n"
              "      f: dict[str, Any], g: object, *args: Any, **kwargs: Any) -> Any: ...\n")
    tree = ast.parse(source)
    aliases = _any_aliases({"m": tree})
    (_, fn), = _signatures(tree)
    counted = [a.arg for a in fn.args.args if _is_any(a.annotation, aliases)]
    assert counted == ["a", "b", "c", "d", "e"]
    assert _is_any(fn.returns, aliases)
