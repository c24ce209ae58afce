"""A checkpoint of the DDP wrapper's state_dict() loaded into a model that is not wrapped there
(state-dict-module-prefix).

`ddp_model.state_dict()` names
every tensor "module.<name>", so a strict `load_state_dict` into the plain
model (built fresh to evaluate, or resumed before the wrap) fails on every
key. The save and the load are paired by the file (the same path
expression) or, for a dict, by the entry both use (`{"model": ...}` saved,
`ckpt["model"]` loaded). Quiet when the save goes through `.module`, the
load goes into the wrapper, `strict=False`, the script strips the prefix
anywhere but inside another load's own argument ("module." handed to a call
or a comparison, `k[7:]`, consume_prefix_in_state_dict_if_present), or what the loaded name holds is
not known (a parameter, a helper that may wrap, an imported loader).
"""

from __future__ import annotations

import ast
import bisect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from assistant.lint.checks.wrapper import (
    ScopeFacts,
    bind_closures,
    bind_wrapped_parameters,
    is_prepare,
    plain_names,
    wrapper_of,
)
from assistant.lint.model import (
    Script,
    full_text,
    is_int,
    keyword,
    names_in,
    self_attribute,
    short,
    source_text,
    string_keyed_entries,
    walk,
)
from assistant.lint.registry import check
from assistant.lint.torchapi import loaded_file, saved_file
from assistant.results import Finding

# How many assignments a loaded entry is followed through inside a helper that
# returns what it makes of it (`state` -> `params = {k: v.clone() ...}` -> return).
MADE_FROM_HOPS = 3
# A loaded file named like someone else's weights, not the script's own checkpoint.
FOREIGN_WEIGHTS = re.compile(r"pretrain|teacher|backbone|imagenet|init", re.IGNORECASE)
# A helper that may hand back a wrapped model (`setup_ddp(model)`, `wrap_model(m)`).
MAY_WRAP = re.compile(r"ddp|dist|parallel|wrap|prepare|setup|accelerat", re.IGNORECASE)
# Text that strips the wrapper's prefix: "module.", r"^module\.", a `[7:]` slice.
PREFIX_TEXT = re.compile(r"module\\?\.")
PREFIX_LENGTH = len("module.")


GLOBS = frozenset({"glob", "iglob"})
# A formatted value of an f-string: any text in its place.
FORMATTED = re.compile(r"\{[^{}]*\}")


def wildcarded(text: str) -> str:
    """A path's source text with each f-string field, and each glob `*`, made one `*`,
    and no f prefix (f"{arch}_fold{k}.pth", "resnet_fold*.pth" read alike)."""
    unformatted = re.sub(r"\bf(['\"])", r"\1", FORMATTED.sub("*", text))
    return re.sub(r"\*+", "*", unformatted)


@dataclass(frozen=True)
class SavedEntry:
    """A wrapper's state_dict() that a torch.save writes, and where in the saved object."""

    key: str | None  # the dict entry it is saved under; None when saved as is
    path: ast.expr | None  # the file torch.save writes
    scope: ast.AST  # the function (or module) the torch.save is in
    wrapper_text: str  # `model`, `self.model`
    wrapper: str  # DistributedDataParallel or DataParallel
    line: int


@check("state-dict-module-prefix")
def check_wrapper_state_dict_loaded_unwrapped(script: Script) -> Iterator[Finding]:
    """A checkpoint of `ddp_model.state_dict()` loaded strictly into a plain model."""
    names = {short(name) for _node, name in script.call_names}
    wraps = any(wrapper_of(script, node) or is_prepare(node) for node, _name in script.call_names)
    if not (wraps and "load_state_dict" in names and "save" in names):
        return
    strips = prefix_strips(script)
    where = Places(script)
    saved: dict[str | None, list[SavedEntry]] = {}
    for scope, call in where.calls_named({"torch.save", *forwarders_of_save(script)}):
        for entry in where.saved_entries(scope, call):
            saved.setdefault(entry.key, []).append(entry)
    if not saved:
        return
    for scope in script.all_scopes:
        for node in script.scope_nodes(scope):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load_state_dict"
            ):
                continue
            if any(serves(strip, node, script) for strip in strips):
                continue
            if not strict_load(node) or not where.unwrapped(scope, node.func.value, node.lineno):
                continue
            state = node.args[0] if node.args else keyword(node, "state_dict")
            loaded = where.loaded(scope, state, node.lineno) if state is not None else None
            if loaded is None or loaded[0] not in saved:
                continue
            entry = where.paired(saved[loaded[0]], scope, loaded[1])
            if entry is None:
                continue
            target = source_text(node.func.value)
            yield script.finding(
                "state-dict-module-prefix",
                node,
                f"{target}.load_state_dict loads the checkpoint saved at line {entry.line} "
                f"from the {entry.wrapper} wrapper ({entry.wrapper_text}.state_dict(): every "
                f'key starts with "module.") into {target}, which is not wrapped here, so the '
                "strict load fails with Missing and Unexpected key(s); save "
                f"{entry.wrapper_text}.module.state_dict() instead, or strip the prefix with "
                "consume_prefix_in_state_dict_if_present before loading",
            )


def forwarders_of_save(script: Script) -> set[str]:
    """The file's functions that hand their arguments on to torch.save unchanged
    (`def save_on_master(*args, **kwargs): if is_main_process(): torch.save(*args,
    **kwargs)`, as DETR / DeiT / MAE carry): a call of one saves like torch.save."""
    found = set()
    for name, function in script.functions.items():
        forwarded = function.args.vararg
        if forwarded is None or "." in name:
            continue
        for node in walk(function):
            if (
                isinstance(node, ast.Call)
                and script.name_of(node.func) == "torch.save"
                and node.args
                and isinstance(node.args[0], ast.Starred)
                and isinstance(node.args[0].value, ast.Name)
                and node.args[0].value.id == forwarded.arg
            ):
                found.add(name)
    return found


def prefix_strips(script: Script) -> list[ast.AST]:
    """Where the script handles the prefix itself: "module." handed to a call or a
    comparison (`k.replace("module.", "")`, `k.startswith("module.")`), `k[7:]`, or
    torch's consume_prefix helper."""
    found: list[ast.AST] = []
    for node in script.nodes:
        if isinstance(node, (ast.Call, ast.Compare)):
            parts = (
                [*node.args, *(k.value for k in node.keywords)]
                if isinstance(node, ast.Call)
                else [node.left, *node.comparators]
            )
            if any(
                isinstance(part, ast.Constant)
                and isinstance(part.value, str)
                and PREFIX_TEXT.search(part.value)
                for part in parts
            ):
                found.append(node)
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        if isinstance(name, str) and name.startswith("consume_prefix"):
            found.append(node)
        if (
            isinstance(node, ast.Slice)
            and is_int(node.lower)
            and node.lower.value == PREFIX_LENGTH
            and node.upper is None
        ):
            found.append(node)
    return found


def serves(strip: ast.AST, load: ast.Call, script: Script) -> bool:
    """A strip serves every load, except one written inside another load_state_dict's
    own arguments: that one renames the keys of that load alone
    (`net.load_state_dict({k.replace("module.", ""): v ...}, strict=False)` on one path
    leaves the resume on another path loading "module." keys)."""
    owner = script.parents.get(id(strip))
    while owner is not None:
        if (
            isinstance(owner, ast.Call)
            and isinstance(owner.func, ast.Attribute)
            and owner.func.attr == "load_state_dict"
        ):
            return owner is load
        owner = script.parents.get(id(owner))
    return True


def strict_load(call: ast.Call) -> bool:
    """load_state_dict with strict=True, the default (a computed strict is not known)."""
    value = keyword(call, "strict")
    if value is None and len(call.args) > 1:
        value = call.args[1]
    return value is None or (isinstance(value, ast.Constant) and value.value is True)


# A library's model factory that returns the model first, with what goes with it:
# open_clip's create_model_and_transforms, clip.load, a from_pretrained asked for
# its loading info. The model it builds is a plain one.
# Matched on the full name: a bare `load` is torch.load's too, which returns what was pickled.
MODEL_FACTORY = re.compile(r"create_model|build_model|load_model|from_pretrained|(^|\.)clip\.load$")


def first_of_a_model_factory(script: Script, target: ast.expr, value: ast.expr) -> str | None:
    """`model` of `model, preprocess, _ = open_clip.create_model_and_transforms(...)`."""
    if not (
        isinstance(target, ast.Tuple | ast.List)
        and target.elts
        and isinstance(target.elts[0], ast.Name)
        and isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)  # a library's, not the file's own
    ):
        return None
    return target.elts[0].id if MODEL_FACTORY.search(script.name_of(value.func)) else None


@dataclass
class ScopeIndex:
    """One scope's bindings, in line order: each plain name's assignments (the value,
    or None for an unpacking, a loop or a with target), and `name["key"] = value`."""

    lines: dict[str, list[int]] = field(default_factory=dict)
    values: dict[str, list[ast.expr | None]] = field(default_factory=dict)
    items: dict[str, list[tuple[int, str, ast.expr]]] = field(default_factory=dict)

    def bind(self, name: str, line: int, value: ast.expr | None) -> None:
        at = bisect.bisect_right(self.lines.setdefault(name, []), line)
        self.lines[name].insert(at, line)
        self.values.setdefault(name, []).insert(at, value)


class Places:
    """Answers about a line of a scope: does a name hold the wrapper or a plain
    model, what a torch.save writes, what a load_state_dict is handed. Each
    scope is indexed once, so a file of many loads costs one walk per scope."""

    def __init__(self, script: Script):
        self.script = script
        self.facts = {
            id(scope): ScopeFacts(script, script.scope_nodes(scope)) for scope in script.all_scopes
        }
        bind_wrapped_parameters(script, self.facts)
        # `def save(tag): torch.save({"state_dict": model.state_dict()}, ...)` nested in
        # main and called after `model = DDP(model)`: its model is the wrapper
        bind_closures(script, self.facts)
        self.owner = {
            id(method): cls.name
            for cls in script.tree.body
            if isinstance(cls, ast.ClassDef)
            for method in cls.body
            if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        self.indexes: dict[int, ScopeIndex] = {}
        self.wrapping_functions: dict[str, bool] = {}
        self.path_cache: dict[int, set[str]] = {}
        self.files_cache: dict[int, dict[str, SavedEntry]] = {}
        self.callers: dict[str, list[tuple[ast.AST, ast.Call]]] = {}
        for scope in script.all_scopes:
            for node in script.scope_nodes(scope):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    self.callers.setdefault(node.func.id, []).append((scope, node))
        self.fields = self.field_kinds()

    def calls_named(self, names: set[str]) -> Iterator[tuple[ast.AST, ast.Call]]:
        for scope in self.script.all_scopes:
            for node in self.script.scope_nodes(scope):
                if isinstance(node, ast.Call) and self.script.name_of(node.func) in names:
                    yield scope, node

    # ---------------------------------------------------------- what names hold

    def index(self, scope: ast.AST) -> ScopeIndex:
        if id(scope) in self.indexes:
            return self.indexes[id(scope)]
        index = ScopeIndex()
        for node in self.script.scope_nodes(scope):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        index.bind(target.id, node.lineno, node.value)
                    elif (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Name)
                        and isinstance(target.slice, ast.Constant)
                        and isinstance(target.slice.value, str)
                    ):
                        entry = (node.lineno, target.slice.value, node.value)
                        index.items.setdefault(target.value.id, []).append(entry)
                    else:
                        # `fresh, _ = factorise(fresh)`: one of what a same-file function
                        # returns; bound to that call, which `plain_build` judges (it wraps
                        # nothing, or it does); any other unpacking holds an unknown value
                        value = node.value if self.own_call(node.value) else None
                        for name in plain_names(target):
                            index.bind(name, node.lineno, value)
                        model = first_of_a_model_factory(self.script, target, node.value)
                        if model is not None:  # `model, preprocess, _ = create_model_and_...`
                            index.bind(model, node.lineno, node.value)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
                targets = (
                    [i.optional_vars for i in node.items if i.optional_vars is not None]
                    if isinstance(node, (ast.With, ast.AsyncWith))
                    else [node.target]
                )
                for name in {n for target in targets for n in plain_names(target)}:
                    index.bind(name, node.lineno, None)
        self.indexes[id(scope)] = index
        return index

    def own_call(self, value: ast.expr) -> bool:
        """A call of one of the file's own functions (by its plain name)."""
        return (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in self.script.functions
        )

    def last_value(self, scope: ast.AST, name: str, line: int) -> ast.expr | None:
        """What `name` was last assigned above `line` in the scope; None when that is
        not an assignment of a value (a parameter, a loop target, an unpacking)."""
        index = self.index(scope)
        at = bisect.bisect_left(index.lines.get(name, []), line) - 1
        return index.values[name][at] if at >= 0 else None

    def wrapper(self, scope: ast.AST, expr: ast.expr, line: int) -> str | None:
        """The wrapper `expr` (a name or `self.field`) holds at `line`, if any."""
        if isinstance(expr, ast.Name):
            return self.facts[id(scope)].wrapper_at(expr.id, line)
        field_name = self_attribute(expr)
        if field_name is not None and id(scope) in self.owner:
            return self.fields.get((self.owner[id(scope)], field_name)) or None
        return None

    def field_kinds(self) -> dict[tuple[str, str], str]:
        """(class, field) -> the wrapper every `self.field = ...` of the class assigns,
        or "" when every one assigns a plain model built by a call; fields assigned
        both ways, or anything else, are left out."""
        kinds: dict[tuple[str, str], set[str]] = {}
        for cls in (node for node in self.script.tree.body if isinstance(node, ast.ClassDef)):
            for method in cls.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in self.script.scope_nodes(method):
                    if not isinstance(node, ast.Assign):
                        continue
                    for target in node.targets:
                        if field_name := self_attribute(target):
                            kind = wrapper_of(self.script, node.value)
                            if kind is None:
                                kind = "" if self.plain_build(node.value) else "?"
                            kinds.setdefault((cls.name, field_name), set()).add(kind)
        return {key: next(iter(k)) for key, k in kinds.items() if len(k) == 1 and "?" not in k}

    def plain_build(self, value: ast.expr) -> bool:
        """A call that builds a model and wraps nothing: no wrapper or accelerator.prepare
        in it, no same-file function that wraps, no imported helper named like one."""
        if not isinstance(value, ast.Call):
            return False
        for node in walk(value):
            if not isinstance(node, ast.Call):
                continue
            if wrapper_of(self.script, node) is not None or is_prepare(node):
                return False
            callee = self.script.name_of(node.func)
            if MAY_WRAP.search(short(callee)) or short(callee) in ("deepcopy", "copy"):
                return False
            if callee in self.script.functions and self.wraps_inside(callee):
                return False
        return True

    def wraps_inside(self, name: str) -> bool:
        """The file's function `name` constructs a wrapper itself."""
        if name not in self.wrapping_functions:
            self.wrapping_functions[name] = any(
                isinstance(node, ast.Call) and wrapper_of(self.script, node) is not None
                for node in self.script.scope_nodes(self.script.functions[name])
            )
        return self.wrapping_functions[name]

    def unwrapped(self, scope: ast.AST, target: ast.expr, line: int) -> bool:
        """`target` is a plain model at `line`: `wrapper.module`, a name last bound to
        a model built by a call (or to `wrapper.module`), or a field only ever
        assigned such models."""
        if isinstance(target, ast.Attribute) and target.attr == "module":
            return self.wrapper(scope, target.value, line) is not None
        if isinstance(target, ast.Name):
            if self.wrapper(scope, target, line) is not None:
                return False
            value = self.last_value(scope, target.id, line)
            if isinstance(value, ast.Attribute) and value.attr == "module":
                return self.wrapper(scope, value.value, value.lineno) is not None
            return (
                value is not None
                and self.plain_build(value)
                and not any(
                    self.wrapper(scope, inner, line) is not None
                    for inner in walk(value)
                    if isinstance(inner, (ast.Name, ast.Attribute))
                )
            )
        field_name = self_attribute(target)
        if field_name is not None and id(scope) in self.owner:
            return self.fields.get((self.owner[id(scope)], field_name)) == ""
        return False

    # ---------------------------------------------------------- what is saved

    def saved_entries(self, scope: ast.AST, call: ast.Call) -> list[SavedEntry]:
        """The wrapper state_dicts one torch.save writes, directly or in a dict entry;
        in a helper that saves its parameter (`def save_checkpoint(state, path)`),
        what the file's calls of the helper pass for it."""
        obj = call.args[0] if call.args else keyword(call, "obj")
        path = saved_file(call)
        if obj is None:
            return []
        found = self.state_dicts_in(scope, obj, call.lineno)
        if not found and isinstance(obj, ast.Name):
            for caller, passed in self.passed_for(scope, obj.id):
                found += self.state_dicts_in(caller, passed, passed.lineno)
        return [
            SavedEntry(key, path, scope, text, kind, call.lineno) for key, (text, kind) in found
        ]

    def passed_for(self, scope: ast.AST, name: str) -> list[tuple[ast.AST, ast.expr]]:
        """(caller's scope, expression) for what each call of the top-level function
        `scope` passes for its parameter `name`; [] when `name` is no parameter."""
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return []
        if self.script.functions.get(scope.name) is not scope:
            return []
        names = [a.arg for a in scope.args.posonlyargs + scope.args.args]
        if name not in names:
            return []
        position = names.index(name)
        passed = []
        for caller, node in self.callers.get(scope.name, []):
            value = node.args[position] if len(node.args) > position else keyword(node, name)
            if value is not None:
                passed.append((caller, value))
        return passed

    def state_dicts_in(
        self, scope: ast.AST, obj: ast.expr, line: int
    ) -> list[tuple[str | None, tuple[str, str]]]:
        """(entry, (wrapper text, wrapper class)) for each wrapper state_dict in `obj`:
        `W.state_dict()` itself (entry None), or a string-keyed entry of a dict,
        written out or built in the scope before `line`."""
        found: list[tuple[str | None, tuple[str, str]]] = []
        if direct := self.state_dict_of_wrapper(scope, obj):
            found.append((None, direct))
        dicts = [obj]
        if isinstance(obj, ast.Name):
            value = self.last_value(scope, obj.id, line)
            dicts = [value] if value is not None else []
            for item_line, key, item in self.index(scope).items.get(obj.id, []):
                if item_line < line and (wrapped := self.state_dict_of_wrapper(scope, item)):
                    found.append((key, wrapped))
        for value in dicts:
            for key, item in string_keyed_entries(value):
                if wrapped := self.state_dict_of_wrapper(scope, item):
                    found.append((key, wrapped))
        return found

    def state_dict_of_wrapper(
        self, scope: ast.AST, expr: ast.expr, depth: int = 0
    ) -> tuple[str, str] | None:
        """(wrapper text, wrapper class) when `expr` is `W.state_dict()` for a wrapper W,
        directly or through a name bound to it in the scope."""
        if isinstance(expr, ast.Name) and depth < 2:
            value = self.last_value(scope, expr.id, expr.lineno)
            return self.state_dict_of_wrapper(scope, value, depth + 1) if value else None
        if not (
            isinstance(expr, ast.Call)
            and isinstance(expr.func, ast.Attribute)
            and expr.func.attr == "state_dict"
        ):
            return None
        owner = expr.func.value
        wrapper = self.wrapper(scope, owner, expr.lineno)
        return (source_text(owner), wrapper) if wrapper else None

    # ---------------------------------------------------------- what is loaded

    def loaded(
        self, scope: ast.AST, expr: ast.expr, line: int, depth: int = 0
    ) -> tuple[str | None, ast.Call] | None:
        """(entry, torch.load call) when `expr` is what a torch.load returned, or one
        string-keyed entry of it, directly or through names bound in the scope."""
        if depth > 3:
            return None
        if isinstance(expr, ast.Call) and self.script.name_of(expr.func) == "torch.load":
            return None, expr
        if isinstance(expr, ast.IfExp):
            # `torch.load(path) if os.path.exists(path) else None`: a resume that may not happen
            for branch in (expr.body, expr.orelse):
                if (found := self.loaded(scope, branch, line, depth + 1)) is not None:
                    return found
            return None
        if isinstance(expr, ast.Name):
            value = self.last_value(scope, expr.id, line)
            return self.loaded(scope, value, line, depth + 1) if value is not None else None
        if self.own_call(expr):
            return self.returned_from_a_load(self.script.functions[expr.func.id], depth + 1)
        if (
            isinstance(expr, ast.Subscript)
            and isinstance(expr.slice, ast.Constant)
            and isinstance(expr.slice.value, str)
        ):
            inner = self.loaded(scope, expr.value, line, depth + 1)
            if inner is not None and inner[0] is None:
                return expr.slice.value, inner[1]
        return None

    def returned_from_a_load(
        self, function: ast.AST, depth: int
    ) -> tuple[str | None, ast.Call] | None:
        """A file function whose return is made from an entry of a checkpoint it
        loads (fairseq's average_checkpoints: `state = torch.load(p)["model"]`, the
        sum of each key's tensors, `return {k: v / n ...}`): the keys are the saved
        ones, "module." and all."""
        seeds: dict[str, tuple[str | None, ast.Call]] = {}
        assigns = [n for n in self.script.scope_nodes(function) if isinstance(n, ast.Assign)]
        for node in assigns:
            found = self.loaded(function, node.value, node.lineno, depth)
            if found is not None and found[0] is not None:
                seeds.update((t.id, found) for t in node.targets if isinstance(t, ast.Name))
        made = dict(seeds)
        for _ in range(MADE_FROM_HOPS):
            for node in assigns:
                sources = [made[n] for n in sorted(names_in(node.value)) if n in made]
                if sources:
                    made.update((t.id, sources[0]) for t in node.targets if isinstance(t, ast.Name))
        returns = [
            n
            for n in self.script.scope_nodes(function)
            if isinstance(n, ast.Return) and n.value is not None
        ]
        sources = [made[n] for r in returns for n in sorted(names_in(r.value)) if n in made]
        return sources[0] if seeds and sources else None

    def paired(
        self, entries: list[SavedEntry], scope: ast.AST, load: ast.Call
    ) -> SavedEntry | None:
        """The saved entry (of the same key) this torch.load reads: for a dict entry,
        any file not named like another model's weights; otherwise the same file."""
        path = loaded_file(load)
        if path is None:
            return None
        if entries[0].key is not None and not FOREIGN_WEIGHTS.search(full_text(path)):
            return entries[0]
        files = self.files_of(entries)
        found = next((files[t] for t in self.path_texts(scope, path) if t in files), None)
        if found is not None:
            return found
        # `for path in glob.glob(f"{arch}_fold*.pth")`: the files saved as f"{arch}_fold{k}.pth"
        patterns = {wildcarded(p) for p in self.glob_patterns(scope, path)}
        return next((entry for text, entry in files.items() if wildcarded(text) in patterns), None)

    def glob_patterns(self, scope: ast.AST, path: ast.expr) -> list[str]:
        """The glob patterns a loop variable walks the matches of (`for path in
        sorted(glob.glob(pattern))`, or a name assigned those matches)."""
        if not isinstance(path, ast.Name):
            return []
        walked = [
            node.iter
            for node in self.script.scope_nodes(scope)
            if isinstance(node, ast.For)
            and isinstance(node.target, ast.Name)
            and node.target.id == path.id
        ]
        walked += [
            value
            for w in list(walked)
            for value in self.script.assigned_values.get(source_text(w), [])
        ]
        return [
            source_text(call.args[0])
            for expr in walked
            for call in walk(expr)
            if isinstance(call, ast.Call)
            and short(self.script.name_of(call.func)) in GLOBS
            and call.args
        ]

    def files_of(self, entries: list[SavedEntry]) -> dict[str, SavedEntry]:
        """Each way the entries' files may read, to the first entry written there."""
        if id(entries) not in self.files_cache:
            files: dict[str, SavedEntry] = {}
            for entry in entries:
                if entry.path is not None:
                    for text in self.path_texts(entry.scope, entry.path):
                        files.setdefault(text, entry)
            self.files_cache[id(entries)] = files
        return self.files_cache[id(entries)]

    def path_texts(self, scope: ast.AST, path: ast.expr) -> set[str]:
        """How a path may read: its text, what the file assigns to it, and for a
        parameter of the function `scope`, its default and what the file's calls of
        that function pass for it."""
        if id(path) in self.path_cache:
            return self.path_cache[id(path)]
        text = source_text(path)
        texts = {text, *(source_text(v) for v in self.script.assigned_values.get(text, []))}
        self.path_cache[id(path)] = texts
        if not isinstance(path, ast.Name) or not isinstance(
            scope, (ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            return texts
        names = [a.arg for a in scope.args.posonlyargs + scope.args.args]
        if path.id in names:
            position = names.index(path.id)
            defaults = scope.args.defaults
            if position >= len(names) - len(defaults):
                texts.add(source_text(defaults[position - (len(names) - len(defaults))]))
        texts |= {source_text(value) for _caller, value in self.passed_for(scope, path.id)}
        return texts
