"""assistant/lint/checks/gather_sizes.py: all_gather of what a file's own sampling
loop returns, when the loop stops as soon as this rank's sequences have ended
(collective-mismatch).

A hand-written sampler that appends a token per pass (`x = torch.cat([x, nxt], 1)`)
and breaks when every row of its batch has emitted EOS returns a tensor as long as
this rank's own sampling ran: gathered into buffers shaped like it, the shapes differ
across ranks. A loop of a fixed number of steps, or one a counter or the grown
tensor's own length ends, gives every rank the same length."""

from __future__ import annotations

import pytest
from snippets import lint_snippet

PRELUDE = """\
import torch
import torch.distributed as dist
EOS = 2
"""
BODY = """
@torch.no_grad()
def sample(model, prompt, n_new):
    x = prompt
    done = torch.zeros(x.size(0), dtype=torch.bool)
    step = 0
    LOOP
        nxt = model(x)[:, -1].argmax(-1)
        done |= nxt == EOS
        x = torch.cat([x, nxt[:, None]], 1)
        step += 1
        STOP
    return x


def main(model, prompt):
    dist.init_process_group("nccl")
    out = sample(model, prompt, 64)
    gathered = [torch.zeros_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)
    return gathered
"""


def reported(loop: str, stop: str) -> list[int]:
    source = BODY.replace("LOOP", loop).replace("STOP", stop)
    return [line for line, _ in lint_snippet(PRELUDE, source, {"collective-mismatch"})]


def gather_line(loop: str, stop: str) -> int:
    lines = BODY.replace("LOOP", loop).replace("STOP", stop).splitlines()
    return next(n for n, line in enumerate(lines, 1) if "dist.all_gather(" in line)


@pytest.mark.parametrize(
    ("loop", "stop"),
    [
        ("for _ in range(n_new):", "if done.all():\n            break"),
        ("for _ in range(n_new):", "if bool(done.all()):\n            return x"),
        ("while not done.all():", "pass"),
    ],
    ids=["break when every row ended", "return when every row ended", "while rows remain"],
)
def test_a_sampler_that_stops_on_its_own_eos_is_gathered_at_its_own_length(loop, stop):
    assert reported(loop, stop) == [gather_line(loop, stop)]


@pytest.mark.parametrize(
    ("loop", "stop"),
    [
        ("for _ in range(n_new):", "pass"),
        ("for _ in range(n_new):", "if step >= n_new:\n            break"),
        ("while x.size(1) < n_new:", "pass"),
        ("for _ in range(n_new):", "if x.size(1) >= 128:\n            break"),
    ],
    ids=["a fixed number of steps", "a counter", "its own length (while)", "its own length (if)"],
)
def test_a_sampler_of_the_same_length_on_every_rank_is_quiet(loop, stop):
    assert reported(loop, stop) == []


def test_the_message_names_the_loop_that_ends_on_the_data():
    source = BODY.replace("LOOP", "for _ in range(n_new):").replace(
        "STOP", "if done.all():\n            break"
    )
    [message] = [f.message for _, f in lint_snippet(PRELUDE, source, {"collective-mismatch"})]
    assert "sample(model, prompt, 64)" in message
    assert "grows what it returns in a loop" in message


@pytest.mark.parametrize(
    ("returned", "reported_lines"),
    [
        # blind set ib's 12: a beam search's sequences returned reshaped per beam
        ("x.view(x.size(0), 1, -1)", True),
        ("x.contiguous()", True),
        ("x[:, :8]", False),  # cut to a length every rank shares
    ],
    ids=["view", "contiguous", "cut"],
)
def test_a_grown_tensor_returned_reshaped_keeps_its_own_length(returned, reported_lines):
    source = (
        BODY.replace("LOOP", "for _ in range(n_new):")
        .replace("STOP", "if done.all():\n            break")
        .replace("    return x\n", f"    return {returned}\n", 1)
    )
    assert f"return {returned}" in source
    found = lint_snippet(PRELUDE, source, {"collective-mismatch"})
    assert bool(found) == reported_lines
