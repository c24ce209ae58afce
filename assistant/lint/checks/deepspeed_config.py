"""A DeepSpeed config written in the file whose batch sizes contradict the
Trainer's (deepspeed-config-mismatch).

The Hugging Face Trainer fills a DeepSpeed config's "auto" values from its
TrainingArguments and checks the rest against them: a
`train_micro_batch_size_per_gpu` or `gradient_accumulation_steps` written as
a number that differs from per_device_train_batch_size or
gradient_accumulation_steps stops the run before the first step ("Please
correct the following DeepSpeed config values that mismatch TrainingArguments
values"). People copy a config from another run, or change the arguments and
not the dict beside them.

Read only where the file shows both sides as numbers: a dict literal with
those keys, handed to TrainingArguments(deepspeed=...) by name or inline,
and the arguments' values as literals or argparse defaults.

DeepSpeed itself asserts train_batch_size == micro batch x accumulation x
world size when a config gives all three. A config that fixes all three as
numbers fits one world size only: none at all when the product does not
divide the total, or not the one the file's own launch line starts.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from assistant.lint.launchtext import launched_world_size
from assistant.lint.model import Script, keyword, short, source_text
from assistant.lint.registry import check
from assistant.lint.values import resolved_int
from assistant.results import Finding

# DeepSpeed's key, and the TrainingArguments field the Trainer checks it against.
CHECKED_KEYS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
}
# TrainingArguments' defaults, used when the call leaves a field out.
ARGUMENT_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1}


@check("deepspeed-config-mismatch")
def check_config_against_training_arguments(script: Script) -> Iterator[Finding]:
    """`ds = {"train_micro_batch_size_per_gpu": 16, ...}` and
    `TrainingArguments(per_device_train_batch_size=32, deepspeed=ds)`."""
    for arguments in (n for n, name in script.call_names if short(name) == "TrainingArguments"):
        config = config_dict(script, keyword(arguments, "deepspeed"))
        if config is None or any(given.arg is None for given in arguments.keywords):
            continue  # no config in the file, or **options may set the fields
        for key, value in zip(config.keys, config.values, strict=True):
            if not (isinstance(key, ast.Constant) and key.value in CHECKED_KEYS):
                continue
            field = CHECKED_KEYS[key.value]
            written = resolved_int(script, value)
            given = keyword(arguments, field)
            expected = ARGUMENT_DEFAULTS[field] if given is None else resolved_int(script, given)
            if written is None or expected is None or written == expected:
                continue
            yield script.finding(
                "deepspeed-config-mismatch",
                key,
                f'the DeepSpeed config says "{key.value}": {written}, TrainingArguments '
                f"(line {arguments.lineno}) {field}={expected}"
                + (
                    f" ({source_text(given)})"
                    if given is not None and not isinstance(given, ast.Constant)
                    else ""
                )
                + ': the Trainer stops before the first step ("Please correct the following '
                'DeepSpeed config values that mismatch TrainingArguments values"); write "auto" '
                "in the config and let the arguments decide",
            )


def config_dict(script: Script, given: ast.expr | None) -> ast.Dict | None:
    """The dict literal handed as deepspeed=: inline, or a name assigned it once."""
    if isinstance(given, ast.Dict):
        return given
    if isinstance(given, ast.Name):
        values = script.assigned_values.get(given.id, [])
        if len(values) == 1 and isinstance(values[0], ast.Dict):
            return values[0]
    return None


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@check("deepspeed-config-mismatch")
def check_batch_sizes_against_world_size(script: Script) -> Iterator[Finding]:
    """`{"train_batch_size": 512, "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4}` launched on 8 GPUs: 8 x 4 x 8 = 256."""
    world = None
    for config in script.of_type(ast.Dict):
        sizes = batch_sizes(script, config)
        if sizes is None:
            continue
        (total_key, total), micro, accumulation = sizes
        per_rank = micro * accumulation
        if total % per_rank:
            fits = "no world size fits it"
        else:
            world = world if world is not None else launched_world_size(script.source)
            if world is None or total == per_rank * world:
                continue
            fits = (
                f"the file's launch line starts {world} processes: "
                f"{micro} x {accumulation} x {world} = {per_rank * world}"
            )
        yield script.finding(
            "deepspeed-config-mismatch",
            total_key,
            f"the DeepSpeed config fixes train_batch_size={total}, micro batch {micro} and "
            f"accumulation {accumulation}; DeepSpeed asserts train_batch_size == micro x "
            f"accumulation x world size, and {fits}; leave train_batch_size out (or "
            '"auto" under the Trainer) so it is computed',
        )


def batch_sizes(script: Script, config: ast.Dict) -> tuple[tuple[ast.expr, int], int, int] | None:
    """The three batch keys of a DeepSpeed config dict, all resolved to numbers."""
    found: dict[str, tuple[ast.expr, int]] = {}
    for key, value in zip(config.keys, config.values, strict=True):
        if isinstance(key, ast.Constant) and key.value in BATCH_KEYS:
            number = resolved_int(script, value)
            if number is None or number <= 0:
                return None
            found[key.value] = (key, number)
    if len(found) < len(BATCH_KEYS):
        return None
    total, micro, accumulation = (found[name] for name in BATCH_KEYS)
    return total, micro[1], accumulation[1]


# deepspeed.initialize's parameters that take the config (a dict or a JSON path).
CONFIG_PARAMETERS = ("config", "config_params")
# Calls that copy a dict without changing it.
COPIES = frozenset({"dict", "deepcopy", "copy"})


@check("deepspeed-config-mismatch")
def check_auto_values_given_to_deepspeed_itself(script: Script) -> Iterator[Finding]:
    """A config with "auto" values (the Hugging Face template's) handed to
    `deepspeed.initialize` itself.

    Only the Hugging Face integrations (the Trainer's TrainingArguments(deepspeed=),
    Accelerate's DeepSpeed plugin) fill "auto" from their own arguments; DeepSpeed
    reads the string as it is, and the optimizer, the scheduler or the precision
    that asked for "auto" cannot be built ("auto" is no number, no bool). Keys the
    file sets to a value after the dict (`ds_config["train_batch_size"] = n`) are
    filled; nested ones likewise (`ds_config["bf16"]["enabled"] = True`).
    """
    for call, name in script.call_names:
        if name != "deepspeed.initialize":
            continue
        given = next(filter(None, (keyword(call, p) for p in CONFIG_PARAMETERS)), None)
        if not isinstance(given, ast.Name):
            continue
        copied = copied_dict(script, given)
        if copied is None:
            continue
        config, names = copied
        filled = filled_paths(script, names)
        left = [p for p in auto_paths(config) if not any(p[: len(f)] == f for f in filled)]
        if not left:
            continue
        shown = ", ".join(".".join(path) for path in left[:4]) + (", ..." if len(left) > 4 else "")
        yield script.finding(
            "deepspeed-config-mismatch",
            call,
            f'the DeepSpeed config handed to deepspeed.initialize still says "auto" for '
            f"{shown} (line {config.lineno}): only the Hugging Face Trainer and Accelerate "
            'fill "auto" in; DeepSpeed reads the string itself, and what asked for it (the '
            "optimizer, the scheduler, the precision) cannot be built; write the values, or "
            "fill each key before deepspeed.initialize",
        )


def copied_dict(script: Script, name: ast.Name) -> tuple[ast.Dict, set[str]] | None:
    """The dict literal a name holds (assigned it once, or a copy of one: `dict(DS_CONFIG)`,
    `copy.deepcopy(DS_CONFIG)`) and every name along the copies (items set on any of
    them count)."""
    names = {name.id}
    for _ in range(3):
        values = script.assigned_values.get(name.id, [])
        if len(values) != 1:
            return None
        value = values[0]
        if isinstance(value, ast.Dict):
            return value, names
        if not (
            isinstance(value, ast.Call)
            and short(script.name_of(value.func)) in COPIES
            and len(value.args) == 1
            and isinstance(value.args[0], ast.Name)
        ):
            return None
        name = value.args[0]
        names.add(name.id)
    return None


def auto_paths(config: ast.Dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Key paths whose value is the string "auto", nested dicts included."""
    found = []
    for key, value in zip(config.keys, config.values, strict=True):
        if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            continue
        path = (*prefix, key.value)
        if isinstance(value, ast.Constant) and value.value == "auto":
            found.append(path)
        elif isinstance(value, ast.Dict):
            found += auto_paths(value, path)
    return found


def filled_paths(script: Script, names: set[str]) -> list[tuple[str, ...]]:
    """Key paths the file assigns into these dicts (`cfg["a"]["b"] = v`, v not "auto")."""
    found = []
    for node in script.of_type(ast.Assign):
        if isinstance(node.value, ast.Constant) and node.value.value == "auto":
            continue
        for target in node.targets:
            path: list[str] = []
            while isinstance(target, ast.Subscript):
                key = target.slice
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    break
                path.insert(0, key.value)
                target = target.value
            else:
                if isinstance(target, ast.Name) and target.id in names and path:
                    found.append(tuple(path))
    return found
