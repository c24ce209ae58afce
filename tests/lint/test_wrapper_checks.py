"""ddp-wrapper-attribute: the model's own attributes read through the DDP / DataParallel wrapper."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from snippets import assert_broken_fails_and_twin_runs, lint_snippet
from torch import nn

from assistant.lint.checks.wrapper import DATA_PARALLEL_API, DDP_API, MODULE_API

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "ddp_wrapper_custom_method.py"
FIXED = SCRIPTS / "correct_ddp_wrapper_module_method.py"

HEADER = """
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
"""


def findings(body: str) -> list[tuple[int, str]]:
    return [(line, f.message) for line, f in lint_snippet(HEADER, body, ["ddp-wrapper-attribute"])]


@pytest.mark.slow
def test_the_fixture_fails_as_linted_under_torchrun_and_its_twin_runs(torchrun):
    assert_broken_fails_and_twin_runs(
        torchrun,
        BROKEN,
        "'DistributedDataParallel' object has no attribute 'generate'",
        FIXED,
        "again [1, 8]",
    )


def test_the_model_api_and_the_wrappers_own_are_not_reported():
    found = findings(
        """
        def main():
            model = DDP(nn.Linear(2, 2))
            model.train()
            model.zero_grad()
            with model.no_sync():
                model(torch.ones(1, 2)).sum().backward()
            torch.save(model.module.state_dict(), "m.pt")
            print(model.device_ids, model.state_dict().keys())
        """
    )
    assert found == []


def test_a_dataparallel_wrapper_is_read_the_same_way():
    found = findings(
        """
        class Net(nn.Module):
            def forward(self, x):
                return x
            def encode(self, x):
                return x

        model = nn.DataParallel(Net())
        model.encode(torch.ones(2))
        """
    )
    assert [line for line, _ in found] == [9]
    assert "DataParallel wrapper" in found[0][1] and "model.module.encode" in found[0][1]


@pytest.mark.parametrize(
    "body",
    [
        # rebound to the wrapped model before the read
        """
        model = DDP(net)
        model = model.module
        model.generate()
        """,
        # the script sets the attribute on the wrapper itself
        """
        model = DDP(net)
        model.config = net.config
        print(model.config)
        """,
        # it asks for the wrapper's own attribute, and unwraps
        """
        model = DDP(net)
        inner = model.module if hasattr(model, "module") else model
        inner.generate()
        """,
        # it asks the unwrapped model
        """
        model = DDP(net)
        if hasattr(model.module, "generate"):
            model.module.generate()
        """,
        # read before the wrapping
        """
        model = net
        model.generate()
        model = DDP(model)
        """,
        # a parameter: what the caller passes is not known here
        """
        def evaluate(model):
            return model.generate()
        """,
    ],
)
def test_what_the_script_may_handle_itself_is_not_reported(body):
    assert findings(body) == []


def test_a_trainer_field_that_is_only_ever_the_wrapper_is_reported():
    found = findings(
        """
        class Trainer:
            def __init__(self, net):
                self.model = DDP(net)

            def sample(self):
                return self.model.generate(torch.ones(1, 2))

            def save(self):
                torch.save(self.model.module.state_dict(), "m.pt")
        """
    )
    assert [line for line, _ in found] == [7]
    assert "self.model.generate" in found[0][1]


def test_a_trainer_field_also_given_the_bare_model_is_not_judged():
    found = findings(
        """
        class Trainer:
            def __init__(self, net, distributed):
                self.model = net

            def wrap(self):
                self.model = DDP(self.model)

            def sample(self):
                return self.model.generate(torch.ones(1, 2))
        """
    )
    assert found == []


def test_the_lists_cover_the_installed_torchs_wrappers():
    # Reading a real attribute would be a false finding: every public attribute of
    # nn.Module, DistributedDataParallel and DataParallel must be in the lists, also
    # those libraries add to nn.Module on import (transformers, which
    # sentence-transformers brings, adds smart_apply).
    import transformers.modeling_utils  # noqa: F401

    public = {name for name in dir(nn.parallel.DistributedDataParallel) if name[0] != "_"}
    assert public <= MODULE_API | DDP_API
    assert {name for name in dir(nn.Module) if name[0] != "_"} <= MODULE_API
    dp_public = {name for name in dir(nn.DataParallel) if name[0] != "_"}
    assert dp_public <= MODULE_API | DATA_PARALLEL_API
    model = nn.DataParallel(nn.Linear(2, 2))
    assert {name for name in vars(model) if name[0] != "_"} <= MODULE_API | DATA_PARALLEL_API


def test_every_read_of_a_big_script_is_judged_against_its_own_binding():
    # 20,000 reads and 200 rebindings of one name: each read looks up the binding above
    # it (a bisect over the name's binding lines), nothing walks the script again.
    lines = ["model = DDP(net)"]
    for i in range(20_000):
        lines.append(f"model.generate_{i % 50}()")
        if i % 100 == 99:
            lines.append("model = model.module" if i % 200 == 99 else "model = DDP(net)")
    found = findings("\n".join(lines))
    assert len(found) == 10_000  # the reads while `model` is the wrapper, half of them


@pytest.mark.parametrize(
    "probe, outcome",
    [
        ('hasattr(model, "generate")', "is False"),
        ('getattr(model, "no_weight_decay", None)', "returns its default"),
    ],
)
def test_a_probe_of_the_models_attribute_on_the_wrapper_is_reported(probe, outcome):
    # The probe never finds the model's own method on the wrapper: the branch is
    # skipped on every GPU run, silently (blind set ai's 07: Swin's no_weight_decay).
    found = findings(
        f"""
        model = DDP(net)
        if {probe}:
            print("probed")
        """
    )
    assert [line for line, _ in found] == [3]
    assert outcome in found[0][1] and "model.module" in found[0][1]


def test_a_probe_in_a_function_every_call_hands_the_wrapper_is_reported():
    found = findings(
        """
        def build_optimizer(model):
            skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
            return torch.optim.AdamW(model.parameters()), skip

        def main():
            model = DDP(nn.Linear(2, 2))
            build_optimizer(model)
        """
    )
    assert [line for line, _ in found] == [3]


def test_the_wrapper_handed_to_a_function_is_the_wrapper_there():
    # Every call of evaluate() passes the DDP model: its parameter holds the wrapper.
    found = findings(
        """
        def evaluate(net, batch):
            return net.generate(batch)

        def main():
            model = DDP(nn.Linear(2, 2))
            evaluate(model, torch.ones(2))
        """
    )
    assert [line for line, _ in found] == [3]


@pytest.mark.parametrize(
    "other_call, reported",
    [
        ("", [3]),  # br's 08: main -> meta_eval(model) -> logits(model) -> model.scale
        # logits also gets the bare model somewhere: the call through meta_eval still
        # hands it the wrapper, and fails there (blind set cy's 18)
        ("logits(bare, torch.ones(2))", [3]),
    ],
)
def test_the_wrapper_is_followed_through_the_functions_it_is_handed_on_to(other_call, reported):
    found = findings(
        f"""
        def logits(net, batch):
            return net.scale * net(batch)

        def meta_eval(net, batch):
            return logits(net, batch).argmax()

        def main():
            bare = nn.Linear(2, 2)
            model = DDP(bare)
            meta_eval(model, torch.ones(2))
            {other_call}
        """
    )
    assert [line for line, _ in found] == reported


def test_the_wrapper_handed_to_a_method_of_the_files_class_is_the_wrapper_there():
    # ckpt is only ever a Saver: its save() gets the DDP model after self; a
    # staticmethod's parameters start at the first; a class built twice from
    # two classes is not judged.
    found = findings(
        """
        class Saver:
            def save(self, net, step):
                return net.config

            @staticmethod
            def log(net):
                return net.config

        def main(other):
            model = DDP(nn.Linear(2, 2))
            ckpt = Saver()
            ckpt.save(model, 1)
            ckpt.log(model)
            maybe = Saver() if other else dict()
            maybe.save(model, 2)
        """
    )
    assert [line for line, _ in found] == [4, 8]


def test_the_wrapper_handed_to_a_constructor_of_the_files_class_is_the_wrapper_there():
    # blind set be's 16: YOLOv5's ComputeLoss(model) built after the DDP wrap reads
    # model.hyp and model.model[-1] in its __init__; built from model.module it is quiet
    source = """
        class ComputeLoss:
            def __init__(self, model, autobalance=False):
                self.hyp = model.hyp
                self.detect = model.model[-1]

        def main():
            model = DDP(nn.Linear(2, 2))
            compute_loss = ComputeLoss(MODEL)
        """
    assert [line for line, _ in findings(source.replace("MODEL", "model"))] == [4, 5]
    assert findings(source.replace("MODEL", "model.module")) == []


def test_a_method_called_on_an_object_of_another_class_is_not_judged():
    found = findings(
        """
        class Saver:
            def save(self, net, step):
                return net.config

        def main(store):
            model = DDP(nn.Linear(2, 2))
            store = make_store()
            store.save(model, 1)
        """
    )
    assert found == []


def test_a_function_also_given_the_bare_model_fails_where_it_is_given_the_wrapper():
    found = findings(
        """
        def evaluate(net, batch):
            return net.generate(batch)

        def main():
            bare = nn.Linear(2, 2)
            model = DDP(bare)
            evaluate(model, torch.ones(2))
            evaluate(bare, torch.ones(2))
        """
    )
    assert [line for line, _ in found] == [3]
    assert "(other calls pass the bare model)" in found[0][1]


@pytest.mark.parametrize(
    ("given", "expected"),
    [("density_fn=bare.query_density", []), ("density_fn=None", [3]), ("", [3])],
    ids=["given", "given None", "not given"],
)
def test_a_fallback_read_only_when_its_parameter_is_empty_is_judged_by_the_calls(given, expected):
    # blind set jl's 14 (correct): the wrapper's call hands the bare model's method in
    found = findings(
        f"""
        def render(field, rays, density_fn=None):
            density_fn = density_fn or field.query_density
            return field(rays), density_fn(rays)

        def main():
            bare = nn.Linear(2, 2)
            model = DDP(bare)
            render(model, torch.ones(2), {given})
            render(bare, torch.ones(2))
        """
    )
    assert [line for line, _ in found] == expected


def test_accelerate_prepare_wraps_the_module_among_what_it_returns():
    found = findings(
        """
        from accelerate import Accelerator

        def main(model, loader):
            accelerator = Accelerator()
            optimizer = torch.optim.AdamW(model.parameters())
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            optimizer.zero_grad()
            print(loader.batch_size)
            return model.generate(torch.ones(2))
        """
    )
    assert [line for line, _ in found] == [10]
    assert "accelerator.unwrap_model(model).generate" in found[0][1]


def test_accelerate_prepare_of_what_is_not_a_module_wraps_nothing():
    found = findings(
        """
        from accelerate import Accelerator

        def main(loader):
            accelerator = Accelerator()
            loader = accelerator.prepare(loader)
            print(loader.batch_size, loader.dataset)
        """
    )
    assert found == []


CLOSURE = """
def main():
    model = nn.Linear(2, 2)
    model = DDP(model)

    def evaluate(batch):
        return model.generate(batch)

    evaluate(torch.ones(2))
"""


def test_a_closure_called_where_the_name_holds_the_wrapper_reads_the_wrapper():
    """Blind set ag's 04: an evaluation function nested in main reads `model`,
    which main has rebound to the DDP wrapper before every call of it."""
    assert [line for line, _ in findings(CLOSURE)] == [7]


def test_a_closure_called_before_the_wrapping_or_rebinding_its_name_is_not_judged():
    before = CLOSURE.replace("    evaluate(torch.ones(2))\n", "").replace(
        "    model = DDP(model)\n", "    evaluate(torch.ones(2))\n    model = DDP(model)\n"
    )
    assert findings(before) == []
    both = CLOSURE.replace(
        "    model = DDP(model)\n", "    evaluate(torch.ones(2))\n    model = DDP(model)\n"
    )
    assert findings(both) == []  # one call sees the bare model, one the wrapper
    own = CLOSURE.replace(
        "        return model.generate", "        model = make()\n        return model.generate"
    )
    assert findings(own) == []


CALLBACK = """
def main(estimator):
    model = DDP(nn.Linear(2, 2))

    def density(x):
        return model.query_density(x)

    estimator.update_every_n_steps(step=1, occ_eval_fn=density)
"""


def test_a_closure_handed_on_as_a_callback_reads_the_wrapper_it_runs_with():
    """Blind set cr's 01: an occupancy-grid callback nested in main reads `model`,
    the DDP wrapper from where main hands the callback on to the end of main."""
    assert [line for line, _ in findings(CALLBACK)] == [6]


def test_a_callback_whose_name_is_rebound_after_the_hand_over_is_not_judged():
    later = CALLBACK + "    model = model.module\n"
    assert findings(later) == []
    before = CALLBACK.replace("    model = DDP(nn.Linear(2, 2))\n", "    model = nn.Linear(2, 2)\n")
    assert findings(before + "    model = DDP(model)\n") == []


FLAG = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2, 2)
        self.deep_supervision = True

    def forward(self, x):
        return [x, self.head(x)] if self.deep_supervision else self.head(x)


def main():
    model = DDP(Net())
    model.deep_supervision = False
    model(torch.ones(2))
"""


def test_a_flag_of_the_models_forward_set_on_the_wrapper_is_reported():
    """Blind set af's 03: the wrapper gets a new attribute; the model keeps its own."""
    found = findings(FLAG)
    assert [line for line, _ in found] == [14]
    assert "model.module.deep_supervision" in found[0][1]


def test_a_flag_set_on_the_module_or_one_the_forward_never_reads_is_not_reported():
    assert (
        findings(FLAG.replace("model.deep_supervision =", "model.module.deep_supervision =")) == []
    )
    assert findings(FLAG.replace("model.deep_supervision = False", "model.tag = 'run-1'")) == []
    # the wrapper's own attributes are its to set
    assert (
        findings(
            FLAG.replace(
                "model.deep_supervision = False", "model.require_backward_grad_sync = False"
            )
        )
        == []
    )


def test_a_flag_set_on_a_field_that_only_ever_holds_the_wrapper_is_reported():
    trainer = FLAG.replace(
        "def main():\n    model = DDP(Net())\n    model.deep_supervision = False\n    model(torch.ones(2))\n",
        "class Trainer:\n    def __init__(self):\n        self.net = DDP(Net())\n"
        "    def validate(self):\n        self.net.deep_supervision = False\n",
    )
    assert [line for line, _ in findings(trainer)] == [16]


MIXED_CALLS = """
def energy(model, net, x):
    edges = radius(x, net.cutoff)
    return model(x, edges)


def main():
    model = DDP(nn.Linear(2, 2))
    energy(model, model, torch.ones(2))
    bare = model.module
    energy(bare, bare, torch.ones(2))
"""


def test_a_parameter_one_call_passes_the_wrapper_fails_at_that_call():
    """Blind set cy's 18: training passes the DDP wrapper as the model whose fields
    the helper reads, evaluation the bare model."""
    found = findings(MIXED_CALLS)
    assert [line for line, _ in found] == [3]
    assert re.search(
        r"the call on line \d+ passes the DistributedDataParallel wrapper as net", found[0][1]
    )


def test_a_function_that_tests_for_the_wrapper_unwraps_it_itself():
    tested = MIXED_CALLS.replace(
        "edges = radius(x, net.cutoff)",
        "edges = radius(x, net.module.cutoff if isinstance(net, DDP) else net.cutoff)",
    )
    assert findings(tested) == []
    probed = MIXED_CALLS.replace(
        "edges = radius(x, net.cutoff)",
        'edges = radius(x, net.module.cutoff if hasattr(net, "module") else net.cutoff)',
    )
    assert findings(probed) == []
