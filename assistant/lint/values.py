"""What an expression surely holds, where the file says it: a literal, an
argparse default, a name assigned once. Anything else is unknown (None):
checks that compare values stay quiet rather than guess."""

from __future__ import annotations

import ast
import operator

from assistant.lint.model import Script, keyword, short, source_text

# How many hops (a name's one assignment, an argparse default) a value is followed:
# `args.bs` -> `default=BATCH` -> `BATCH = 2`. A default that names itself
# (`default=args.batch_size`) ends here instead of looping.
MAX_HOPS = 3


def resolved_int(script: Script, expr: ast.expr | None, hops: int = MAX_HOPS) -> int | None:
    """An int the expression surely holds: a literal, `args.<dest>` with an int
    argparse default (or a @dataclass config field's, dataclass_default), or a name
    assigned one of those once."""
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return expr.value
    if hops <= 0:
        return None
    if isinstance(expr, ast.Attribute):
        if argparse_flag(script, expr.attr) is None:
            # `cfg.batch_size` of the file's @dataclass config, when nothing overrides it
            known, value = dataclass_default(script, expr.attr)
            return value if known and type(value) is int else None
        return argparse_default(script, expr.attr, hops - 1)
    if isinstance(expr, ast.Name):
        values = script.assigned_values.get(expr.id, [])
        return resolved_int(script, values[0], hops - 1) if len(values) == 1 else None
    if isinstance(expr, ast.Subscript):  # `cfg["samples_per_gpu"]` of the file's dict
        known, value = config_default(script, expr, hops - 1)
        return value if known and type(value) is int else None
    if is_get_with_a_default(expr):  # `cfg.get("batch_size", 2)`: the file's default
        return resolved_int(script, expr.args[1], hops - 1)  # type: ignore[attr-defined]
    return None


def is_get_with_a_default(expr: ast.expr) -> bool:
    """`mapping.get("key", default)`."""
    return (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "get"
        and len(expr.args) == 2
        and isinstance(expr.args[0], ast.Constant)
        and isinstance(expr.args[0].value, str)
    )


def argparse_default(script: Script, dest: str, hops: int = MAX_HOPS) -> int | None:
    """The int default of the add_argument whose dest is `dest` (`--batch-size` -> batch_size)."""
    flag = argparse_flag(script, dest)
    return None if flag is None else resolved_int(script, keyword(flag, "default"), hops)


def argparse_flag(script: Script, dest: str) -> ast.Call | None:
    """The first add_argument call whose dest is `dest` (`--batch-size` -> batch_size)."""
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
            return node
    return None


# What an option holds when the command line leaves it out, for a default no
# add_argument call gives: argparse's None, or the opposite of a store_* action.
UNSET_DEFAULTS = {"store_true": False, "store_false": True}


def option_default(script: Script, expr: ast.expr) -> tuple[bool, object]:
    """(known, value): what `args.<dest>` holds when its flag is not given, from
    the add_argument call's constant default (`default="verb"`, `action="store_true"`),
    or what `cfg["key"]` holds when no config file overrides it (config_default), or
    for a field no add_argument names, its @dataclass default (dataclass_default).
    Unknown for anything but an option of the file's own parser with a literal
    default, and for a required option (every run names it)."""
    if isinstance(expr, ast.Subscript):
        return config_default(script, expr)
    if not isinstance(expr, ast.Attribute):
        return False, None
    flag = argparse_flag(script, expr.attr)
    if flag is None:
        return dataclass_default(script, expr.attr)
    required = keyword(flag, "required")
    if required is not None and not (isinstance(required, ast.Constant) and not required.value):
        return False, None
    default = keyword(flag, "default")
    if default is not None:
        return named_constant(script, default)
    action = keyword(flag, "action")
    if isinstance(action, ast.Constant) and action.value in UNSET_DEFAULTS:
        return True, UNSET_DEFAULTS[action.value]
    return (True, None) if action is None else (False, None)


def dataclass_fields(script: Script, field: str) -> list[tuple[ast.ClassDef, ast.AnnAssign]]:
    """(class, statement) for each @dataclass of the file that gives `field` a default."""
    return [
        (cls, statement)
        for cls in script.classes.values()
        if any(
            short(script.name_of(d.func if isinstance(d, ast.Call) else d)) == "dataclass"
            for d in cls.decorator_list
        )
        for statement in cls.body
        if isinstance(statement, ast.AnnAssign)
        and isinstance(statement.target, ast.Name)
        and statement.target.id == field
        and statement.value is not None
    ]


def dataclass_default(script: Script, field: str) -> tuple[bool, object]:
    """(known, value): the literal default of `field` in the file's @dataclass config
    (`pool: str = "mean"`), when the file itself never changes it: no construction of
    that class passes it (or any positional argument), and no `cfg.pool = ...` outside
    the class. A config file applied over it (`setattr(cfg, k, v)`, `Config(**loaded)`)
    is the run's choice, as an option given on the command line is. Unknown where two
    dataclasses define the field."""
    defaults = dataclass_fields(script, field)
    if len(defaults) != 1:
        return False, None
    cls, statement = defaults[0]
    default = statement.value
    if any(
        name == cls.name and (call.args or any(k.arg == field for k in call.keywords))
        for call, name in script.call_names
    ):
        return False, None  # `Config(pool="cls")`; `Config(**vars(args))` is the run's
    inside = {id(node) for node in ast.walk(cls)}
    for node in script.nodes:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if not isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            continue
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr == field
                and (id(node) in inside or not is_self(target.value))
            ):
                return False, None
    return named_constant(script, default)


def is_self(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id == "self"


def named_constant(script: Script, expr: ast.expr) -> tuple[bool, object]:
    """(known, value) of a literal, or of a name the file assigns a literal once
    (`default=ENCODER` where `ENCODER = "bert-base-uncased"` heads the file)."""
    if isinstance(expr, ast.Name):
        values = script.assigned_values.get(expr.id, [])
        expr = values[0] if len(values) == 1 else expr
    return (True, expr.value) if isinstance(expr, ast.Constant) else (False, None)


# How a config dict is copied from the file's defaults: `cfg = dict(DEFAULTS)`,
# `DEFAULTS.copy()`, `copy.deepcopy(DEFAULTS)`, `{**DEFAULTS}`.
COPIES = frozenset({"dict", "copy", "deepcopy"})


def config_default(
    script: Script, expr: ast.Subscript, hops: int = MAX_HOPS
) -> tuple[bool, object]:
    """(known, value): the constant `cfg["key"]` holds when nothing overrides the
    file's defaults: `cfg` (or what it copies) is a dict literal or `dict(key=...)`
    of the file, and no `cfg["key"] = ...` sets the key elsewhere. What a config
    file loaded over it (`cfg.update(yaml.safe_load(f))`) holds is the run's
    choice, as an option given on the command line is."""
    key = expr.slice
    if not (
        isinstance(expr.value, ast.Name)
        and isinstance(key, ast.Constant)
        and isinstance(key.value, str)
    ):
        return False, None
    if any(
        isinstance(target, ast.Subscript)
        and isinstance(target.slice, ast.Constant)
        and target.slice.value == key.value
        for node in script.of_type(ast.Assign)
        for target in node.targets
    ):
        return False, None
    return literal_entry(script, expr.value.id, key.value, hops)


def literal_entry(script: Script, name: str, key: str, hops: int) -> tuple[bool, object]:
    values = script.assigned_values.get(name, [])
    if len(values) != 1 or hops <= 0:
        return False, None
    value = values[0]
    if isinstance(value, ast.Dict):
        for k, v in reversed(list(zip(value.keys, value.values, strict=True))):  # the last wins
            if k is None and isinstance(v, ast.Name):  # {**DEFAULTS, ...}
                known, held = literal_entry(script, v.id, key, hops - 1)
                if known:
                    return known, held
            elif isinstance(k, ast.Constant) and k.value == key:
                return (True, v.value) if isinstance(v, ast.Constant) else (False, None)
        return False, None
    if not isinstance(value, ast.Call):
        return False, None
    called = short(script.name_of(value.func))
    if called == "dict":
        given = keyword(value, key)
        if given is not None:
            return (True, given.value) if isinstance(given, ast.Constant) else (False, None)
    if called in COPIES:
        source = value.args[0] if value.args else None
        if called == "copy" and isinstance(value.func, ast.Attribute):
            source = value.func.value  # DEFAULTS.copy()
        if isinstance(source, ast.Name):
            return literal_entry(script, source.id, key, hops - 1)
    return False, None


# given[TEST_KEY + text of a test]: that test's truth (decide), whatever it reads.
TEST_KEY = "test:"


def decide(test: ast.expr, given: dict[str, object]) -> bool | None:
    """The test's truth from the parameters' values (or given for the test itself,
    under TEST_KEY and its text), None when they do not decide it."""
    if TEST_KEY + source_text(test) in given:
        return bool(given[TEST_KEY + source_text(test)])
    if isinstance(test, ast.Name):
        return bool(given[test.id]) if test.id in given else None
    if isinstance(test, ast.Attribute | ast.Subscript):
        key = source_text(test)  # a flag the model was built with (built_flags), an option
        return bool(given[key]) if key in given else None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = decide(test.operand, given)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        parts = [decide(value, given) for value in test.values]
        stop = isinstance(test.op, ast.Or)  # the value that settles an `or` (an `and`: False)
        if stop in parts:
            return stop
        return None if None in parts else not stop
    if (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and (compared := compared_key(test.left)) in given
        and isinstance(test.comparators[0], ast.Constant)
    ):
        return compare(test.ops[0], given[compared], test.comparators[0].value)
    return None


def compared_key(left: ast.expr) -> str | None:
    """What a comparison's left side is known by in `given`: a parameter's name, or
    a flag the model was built with (`self.output_mode == "quantile"`), or an
    option's text (`args.exist_weight`)."""
    if isinstance(left, ast.Name):
        return left.id
    return source_text(left) if isinstance(left, ast.Attribute | ast.Subscript) else None


def compare(op: ast.cmpop, left: object, right: object) -> bool | None:
    if isinstance(op, ast.Eq):
        return left == right
    if isinstance(op, ast.NotEq):
        return left != right
    if isinstance(op, ast.Is):
        return left is right
    if isinstance(op, ast.IsNot):
        return left is not right
    if isinstance(op, ast.Gt | ast.GtE | ast.Lt | ast.LtE):
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (left, right)):
            return None
        return ORDERINGS[type(op)](left, right)
    return None


ORDERINGS = {
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
}
