"""What an expression surely holds, where the file says it: a literal, an
argparse default, a name assigned once. Anything else is unknown (None):
checks that compare values stay quiet rather than guess."""

from __future__ import annotations

import ast

from assistant.lint.model import Script, keyword, short


def resolved_int(script: Script, expr: ast.expr | None, follow: bool = True) -> int | None:
    """An int the expression surely holds: a literal, `args.<dest>` with an int
    argparse default, or a name assigned one of those once."""
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return expr.value
    if isinstance(expr, ast.Attribute):
        return argparse_default(script, expr.attr)
    if isinstance(expr, ast.Name) and follow:
        values = script.assigned_values.get(expr.id, [])
        return resolved_int(script, values[0], follow=False) if len(values) == 1 else None
    return None


def argparse_default(script: Script, dest: str) -> int | None:
    """The int default of the add_argument whose dest is `dest` (`--batch-size` -> batch_size)."""
    for node, name in script.call_names:
        if short(name) != "add_argument":
            continue
        flags = [
            a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
        ]
        given_dest = keyword(node, "dest")
        dests = {f.lstrip("-").replace("-", "_") for f in flags}
        if isinstance(given_dest, ast.Constant):
            dests = {given_dest.value}
        if dest in dests:
            default = keyword(node, "default")
            return resolved_int(script, default, follow=False) if default is not None else None
    return None
