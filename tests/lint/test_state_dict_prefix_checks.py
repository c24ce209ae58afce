"""state-dict-module-prefix: the DDP wrapper's state_dict() ("module." keys) saved, then
loaded strictly into the plain model (assistant/lint/checks/state_dict.py); the
torchrun evidence is the fixture state_dict_saved_from_wrapper.py's expectations."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

PRELUDE = """
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def save_on_master(*args, **kwargs):
    if dist.get_rank() == 0:
        torch.save(*args, **kwargs)
"""

BODY = """
def main():
    model = build()
    model_without_ddp = model
    model = DDP(model)
    model_without_ddp = model.module
    if os.path.isfile("last.pt"):
        checkpoint = torch.load("last.pt", map_location="cpu")
        model_without_ddp.load_state_dict(checkpoint["model"])
    for epoch in range(3):
        train_one_epoch(model)
        save_on_master({"model": SAVED.state_dict(), "epoch": epoch}, "last.pt")
"""


@pytest.mark.parametrize(
    "saved, reported",
    [
        # blind set ai's 15: DeiT / MAE's save_on_master hands its arguments to torch.save
        ("model", [9]),  # the strict load of that file
        ("model_without_ddp", []),
        ("model.module", []),
    ],
)
def test_a_save_helper_that_forwards_to_torch_save_saves_like_it(saved, reported):
    body = BODY.replace("SAVED", saved)
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["state-dict-module-prefix"])] == (
        reported
    )


EXPORT = """
def shrink(net, ranks):
    return net, sum(ranks)


def main():
    model = DDP(build())
    torch.save(model.state_dict(), "best.pth")
    fresh = build()
    fresh, _ = shrink(fresh, [1, 2])
    fresh.load_state_dict(torch.load("best.pth", map_location="cpu"))
"""


def test_a_model_unpacked_from_a_same_file_helpers_return_is_judged_like_its_build():
    # blind set at 20: a fresh model factorised by the file's own helper, which hands it
    # back in a tuple, then loaded strictly from the wrapper's checkpoint
    assert [line for line, _ in lint_snippet(PRELUDE, EXPORT, ["state-dict-module-prefix"])] == [11]
    # a helper that wraps what it returns: the load goes into a wrapper
    wrapping = EXPORT.replace("return net, sum(ranks)", "return DDP(net), sum(ranks)")
    assert lint_snippet(PRELUDE, wrapping, ["state-dict-module-prefix"]) == []
    # unpacked from a call the file does not show: not known
    imported = EXPORT.replace("fresh, _ = shrink(", "fresh, _ = tools.shrink(")
    assert lint_snippet(PRELUDE, imported, ["state-dict-module-prefix"]) == []


RESUME = """
def main():
    model = build()
    resume = torch.load("last.pt", map_location="cpu") if os.path.exists("last.pt") else None
    if resume is not None:
        model.load_state_dict(resume["model"])
    model = DDP(model)
    for epoch in range(3):
        train_one_epoch(model)
        torch.save({"model": SAVED.state_dict(), "epoch": epoch}, "last.pt.tmp")
        os.replace("last.pt.tmp", "last.pt")
"""


@pytest.mark.parametrize("saved, reported", [("model", [6]), ("model.module", [])])
def test_a_checkpoint_loaded_only_when_it_exists_is_paired_with_its_save(saved, reported):
    # blind set bc's 16: `torch.load(...) if os.path.exists(...) else None` resumes the
    # plain model before the wrap from the wrapper's own state_dict
    body = RESUME.replace("SAVED", saved)
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["state-dict-module-prefix"])] == (
        reported
    )


DICT_CALL = """
def main(args):
    model = build()
    if args.resume_from:
        ckpt = torch.load(args.resume_from, map_location="cpu")
        model.load_state_dict(ckpt["model"])
    model = DDP(model)
    for step in range(3):
        train_one_epoch(model)
        state = dict(model=SAVED.state_dict(), step=step)
        torch.save(state, os.path.join(args.ckpt_dir, f"step_{step:06d}.pt"))
"""


@pytest.mark.parametrize("saved, reported", [("model", [6]), ("model.module", [])])
def test_a_checkpoint_built_with_dict_keywords_has_its_entries_read(saved, reported):
    # blind set gk's 08: `state = dict(model=model.state_dict(), ...)`, the keyword
    # spelling of {"model": ...}, resumed into the plain model before the wrap
    body = DICT_CALL.replace("SAVED", saved)
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["state-dict-module-prefix"])] == (
        reported
    )


RESUMED_BEFORE_THE_WRAP = """
import open_clip


def main(args):
    model, preprocess, _ = open_clip.create_model_and_transforms(args.model)
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
    {wrap}

    def save(tag):
        if dist.get_rank() != 0:
            return
        state = {{"state_dict": {saved}.state_dict(), "step": 0}}
        torch.save(state, os.path.join(args.out, f"{{tag}}.pt"))

    for epoch in range(3):
        train_one_epoch(model)
        save("last")
"""


@pytest.mark.parametrize(
    "wrap, saved, reported",
    [
        # blind set bi's 20: a CoCa model from open_clip's factory, resumed before the wrap
        # from checkpoints a helper nested in main writes from the wrapper
        ("model = DDP(model)", "model", [9]),
        # the helper saves the module inside the wrapper
        ("model = DDP(model)", "model.module", []),
        # no wrap: the model saved is the plain one
        ("pass", "model", []),
    ],
    ids=["wrapper-saved", "module-saved", "never-wrapped"],
)
def test_a_save_nested_in_main_after_the_wrap_saves_the_wrapper(wrap, saved, reported):
    body = RESUMED_BEFORE_THE_WRAP.format(wrap=wrap, saved=saved)
    assert [
        line for line, _ in lint_snippet(PRELUDE, body, ["state-dict-module-prefix"])
    ] == reported


def test_names_unpacked_from_torch_load_are_not_read_as_a_model_factorys():
    # torch.load returns whatever was pickled: `model, opt = torch.load(p)` is not known
    body = RESUMED_BEFORE_THE_WRAP.format(wrap="model = DDP(model)", saved="model").replace(
        "model, preprocess, _ = open_clip.create_model_and_transforms(args.model)",
        "model, preprocess, _ = torch.load(args.whole_objects)",
    )
    assert lint_snippet(PRELUDE, body, ["state-dict-module-prefix"]) == []


AVERAGED = """
def average(paths):
    total = None
    for p in paths:
        state = torch.load(p, map_location="cpu")["model"]
        if total is None:
            total = {k: v.clone().double() for k, v in state.items()}
        else:
            for k, v in state.items():
                total[k] += v.double()
    return RETURNED


def main():
    model = DDP(build())
    for step in range(1000):
        train_step(model)
        if dist.get_rank() == 0 and step % 100 == 0:
            torch.save({"model": model.state_dict()}, f"checkpoint_{step}.pt")
    net = build()
    net.load_state_dict(average(last_paths()))
"""


@pytest.mark.parametrize(
    "returned, reported",
    [
        # blind set bu's 18: the last checkpoints averaged key by key keep "module."
        ("{k: (v / len(paths)).float() for k, v in total.items()}", [21]),
        ("fresh_model().state_dict()", []),  # made from something else
    ],
)
def test_a_state_dict_a_helper_makes_from_loaded_checkpoints_keeps_their_keys(returned, reported):
    body = AVERAGED.replace("RETURNED", returned)
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["state-dict-module-prefix"])] == (
        reported
    )


TWO_LOADS = """
def main():
    net = build()
    if args.resume:
        state = torch.load("last.pt", map_location="cpu")
        net.load_state_dict(state["model"])
    elif args.loadckpt:
        state = torch.load(args.loadckpt, map_location="cpu")
        net.load_state_dict(SECOND)
    model = DDP(net)
    for epoch in range(3):
        train_one_epoch(model)
        torch.save({"model": model.state_dict()}, "last.pt")
"""


@pytest.mark.parametrize(
    "second, reported",
    [
        # blind set cf's 19: the prefix stripped inside another load's own argument
        # serves that load only; the resume above it still loads "module." keys
        ('{k.replace("module.", "", 1): v for k, v in state["model"].items()}, strict=False', [6]),
        ('state["model"], strict=False', [6]),
    ],
)
def test_a_prefix_stripped_inside_another_loads_argument_serves_that_load_only(second, reported):
    body = TWO_LOADS.replace("SECOND", second)
    assert [line for line, _ in lint_snippet(PRELUDE, body, ["state-dict-module-prefix"])] == (
        reported
    )


def test_a_prefix_stripped_outside_any_load_quiets_every_load():
    body = TWO_LOADS.replace("SECOND", 'state["model"], strict=False').replace(
        '        net.load_state_dict(state["model"])',
        '        state["model"] = {k.replace("module.", ""): v for k, v in state["model"].items()}\n'
        '        net.load_state_dict(state["model"])',
    )
    assert lint_snippet(PRELUDE, body, ["state-dict-module-prefix"]) == []


FOLDS = """
import glob


def train_fold(fold, net, out):
    model = DDP(net)
    torch.save(model.state_dict(), os.path.join(out, f"resnet_fold{fold}.pth"))


def ensemble(out):
    for path in sorted(glob.glob(os.path.join(out, PATTERN))):
        model = build()
        model.load_state_dict(torch.load(path, map_location="cpu"))
"""


@pytest.mark.parametrize(
    ("pattern", "reported"),
    [
        # blind set fu's 07: each fold's wrapper checkpoint, read back through a glob
        ('f"resnet_fold*.pth"', [13]),
        ('"resnet_fold*.pth"', [13]),
        # another model's files
        ('"teacher_*.pth"', []),
    ],
    ids=["f-string", "plain", "other-files"],
)
def test_files_saved_per_fold_are_paired_with_the_glob_that_reads_them(pattern, reported):
    source = FOLDS.replace("PATTERN", pattern)
    found = lint_snippet(PRELUDE, source, ["state-dict-module-prefix"])
    assert [line for line, _ in found] == reported
