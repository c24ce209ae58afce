"""torch-compile-ddp: a torch.compile'd model's checkpoint ("_orig_mod." keys) loaded
strictly into a model that is not compiled (assistant/lint/checks/compile_prefix.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "compiled_model_checkpoint_loaded_uncompiled.py"
FIXED = SCRIPTS / "correct_compiled_model_checkpoint_of_the_inner_module.py"

PRELUDE = '''"""Keys of a compiled model start with "_orig_mod." (a docstring: not code)."""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    model = torch.compile(build())
    model = DDP(model)
'''


def reported(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(PRELUDE, "", ["torch-compile-ddp"], indented=body)]


@pytest.mark.parametrize(
    "body",
    [
        """    torch.save(model.module.state_dict(), path)
    final = build()
    final.load_state_dict(torch.load(path, map_location="cpu"))
""",
        """    torch.save({"model": model.module.state_dict(), "epoch": 3}, path)
    ckpt = torch.load(path)
    final = build()
    final.load_state_dict(ckpt["model"])
""",
    ],
)
def test_a_compiled_modules_checkpoint_loaded_into_a_plain_model(body):
    assert reported(body) == [body.count("\n")]


@pytest.mark.parametrize(
    "body",
    [
        # the inner module's own keys
        """    torch.save(model.module._orig_mod.state_dict(), path)
    final = build()
    final.load_state_dict(torch.load(path))
""",
        # the prefix stripped
        """    torch.save(model.module.state_dict(), path)
    state = {k.removeprefix("_orig_mod."): v for k, v in torch.load(path).items()}
    final = build()
    final.load_state_dict(state)
""",
        # not strict
        """    torch.save(model.module.state_dict(), path)
    final = build()
    final.load_state_dict(torch.load(path), strict=False)
""",
        # not strict, given by position
        """    torch.save(model.module.state_dict(), path)
    final = build()
    final.load_state_dict(torch.load(path), False)
""",
        # loaded into a compiled model
        """    torch.save(model.module.state_dict(), path)
    final = torch.compile(build())
    final.load_state_dict(torch.load(path))
""",
        # another file
        """    torch.save(model.module.state_dict(), path)
    final = build()
    final.load_state_dict(torch.load(pretrained))
""",
    ],
)
def test_the_inner_module_a_stripped_prefix_or_a_compiled_target_are_quiet(body):
    assert reported(body) == []


@pytest.mark.slow
def test_the_strict_load_fails_under_torchrun_and_the_twin_loads(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun, BROKEN, "Missing key(s) in state_dict", FIXED, "loaded the best weights"
    )


FSDP_COMPILED = """
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
model = FSDP(net, device_id=0OPTIONS)
BETWEEN
model = torch.compile(model)
"""


@pytest.mark.parametrize(
    ("options", "between", "reported"),
    [
        # blind sets eu's 01 and fm's 12: FSDP1's default flattens the parameters
        ("", "", [6]),
        ("", "fsdp_model = model", [6]),
        (", use_orig_params=False", "", [6]),
        (", use_orig_params=True", "", []),
        (", **fsdp_options", "", []),  # a value the file does not show
        # compiled before the wrap, or another model compiled: not FSDP's flat parameters
        ("", "model = build()", []),
    ],
)
def test_compile_of_an_fsdp_model_with_flat_parameters(options, between, reported):
    body = FSDP_COMPILED.replace("OPTIONS", options).replace("BETWEEN", between)
    found = lint_snippet("", body, ["torch-compile-ddp"])
    assert [line for line, _ in found] == reported
