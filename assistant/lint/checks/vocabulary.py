"""Special ids a tokenizer of the file gives past the vocabulary size it reports (device-side-assert).

    class CharTokenizer:
        def __init__(self, chars):
            self.chars = sorted(chars)
            self.pad_id = len(self.chars)
            self.bos_id = len(self.chars) + 1
            self.eos_id = len(self.chars) + 2

        @property
        def vocab_size(self):
            return len(self.chars) + 2

The model is built with `vocab_size` rows (`GPT2Config(vocab_size=tok.vocab_size)`,
`nn.Embedding(tok.vocab_size, d)`), and the last special id is one past them: the
first sequence that holds it indexes out of range, a CUDA device-side assert that
kills the rank (the others then wait in a collective, and the job looks like a
DDP or NCCL failure; on the CPU, "index out of range in self").

Read within one class: ids assigned as `len(<the list>) + k` and a size
(`vocab_size`, `n_vocab`, `__len__`, as a method, a property or a field)
returned as `len(<the same list>) + m`; reported when an id that the file reads
has k >= m.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.model import Script, called_name, self_attribute, source_text, walk
from assistant.lint.registry import check
from assistant.results import Finding

# What a tokenizer calls the number of ids it has.
SIZE_NAMES = frozenset({"vocab_size", "n_vocab", "num_tokens", "vocab_len", "__len__"})


@check("device-side-assert")
def check_special_id_past_the_vocabulary(script: Script) -> Iterator[Finding]:
    """A special id `len(self.chars) + 2` beside `vocab_size` = `len(self.chars) + 2`."""
    read = {n.attr for n in script.of_type(ast.Attribute) if isinstance(n.ctx, ast.Load)}
    for cls in script.of_type(ast.ClassDef):
        assigned = class_ids(cls)
        sizes = class_sizes(cls, assigned)
        if not sizes:
            continue
        ids = [item for item in assigned if item[0] in read and item[0] not in SIZE_NAMES]
        grown = grown_lists(cls)
        for size_node, counted, extra in sizes:
            if counted in grown:
                continue  # `self.itos.append("<pad>")` after the id: the size counts it
            past = [(name, k) for name, base, k, _where in ids if base == counted and k >= extra]
            if not past:
                continue
            name, k = max(past, key=lambda item: item[1])
            yield script.finding(
                "device-side-assert",
                size_node,
                f"{cls.name} reports len({counted}) + {extra} ids here, but gives {name} = "
                f"len({counted}) + {k}, past them: a model built with this size has no row for "
                f"it, and the first sequence holding {name} indexes out of range (a CUDA "
                "device-side assert that kills the rank; the others then wait in a "
                "collective); count every special id in the size",
            )


def grown_lists(cls: ast.ClassDef) -> set[str]:
    """Lists the class adds to (`self.itos.append(...)`, `+=`), as text."""
    found = set()
    for node in walk(cls):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "extend", "insert")
        ):
            found.add(source_text(node.func.value))
        elif isinstance(node, ast.AugAssign):
            found.add(source_text(node.target))
    return found


def len_plus(value: ast.expr) -> tuple[str, int] | None:
    """(`len`'s argument as text, k) for `len(x) + k` (k an int) or `len(x)` (k 0)."""
    k = 0
    if (
        isinstance(value, ast.BinOp)
        and isinstance(value.op, ast.Add)
        and isinstance(value.right, ast.Constant)
        and type(value.right.value) is int
    ):
        value, k = value.left, value.right.value
    if isinstance(value, ast.Call) and called_name(value) == "len" and len(value.args) == 1:
        return source_text(value.args[0]), k
    return None


def class_ids(cls: ast.ClassDef) -> list[tuple[str, str, int, ast.Assign]]:
    """(field, counted list, k, the assignment) for each `self.field = len(list) + k`
    of the class."""
    found = []
    for node in walk(cls):
        if isinstance(node, ast.Assign) and (sized := len_plus(node.value)):
            for target in node.targets:
                if (field := self_attribute(target)) is not None:
                    found.append((field, *sized, node))
    return found


def class_sizes(
    cls: ast.ClassDef, assigned: list[tuple[str, str, int, ast.Assign]]
) -> list[tuple[ast.AST, str, int]]:
    """(where, counted list, m) for the class's size: a method or property named
    like one that returns `len(list) + m`, or a field of that name assigned so
    (among `assigned`, class_ids)."""
    found: list[tuple[ast.AST, str, int]] = []
    for statement in cls.body:
        if isinstance(statement, ast.FunctionDef) and statement.name in SIZE_NAMES:
            returns = [n for n in walk(statement) if isinstance(n, ast.Return) and n.value]
            if len(returns) == 1 and (sized := len_plus(returns[0].value)):
                found.append((returns[0], *sized))
    found += [(where, counted, m) for field, counted, m, where in assigned if field in SIZE_NAMES]
    return found
