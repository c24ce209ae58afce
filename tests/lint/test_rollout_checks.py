"""uneven-inputs: a backward per minibatch of an RL rollout each rank collects until
its own episodes end (assistant/lint/checks/rollouts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from snippets import RANKS_STOPPED_MATCHING, assert_broken_fails_and_twin_runs, lint_snippet

SCRIPTS = Path(__file__).parents[1] / "data" / "scripts"
BROKEN = SCRIPTS / "ppo_minibatches_of_episode_rollouts.py"
FIXED = SCRIPTS / "correct_ppo_minibatches_of_an_agreed_rollout_size.py"

PRELUDE = """
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def collect(env, model, episodes):
    buf = {"obs": [], "act": []}
    for _ in range(episodes):
        obs, done = env.reset(), False
        while not done:
            act = model(obs)
            obs2, reward, terminated, truncated, info = env.step(act)
            buf["obs"].append(obs)
            buf["act"].append(act)
            obs, done = obs2, terminated or truncated
    return {k: torch.stack(v) for k, v in buf.items()}


def fixed_steps(env, model, steps):
    obs, rows = env.reset(), []
    for _ in range(steps):
        obs2, reward, terminated, truncated, info = env.step(model(obs))
        rows.append(obs)
        obs = env.reset() if terminated or truncated else obs2
    return torch.stack(rows)


model = DDP(net)
"""


def reported(body: str) -> list[int]:
    return [line for line, _ in lint_snippet(PRELUDE, body, ["uneven-inputs"])]


@pytest.mark.parametrize(
    "size",
    [
        'n = batch["obs"].shape[0]',
        'n = len(batch["obs"])',
        'n = batch["obs"].size(0)',
    ],
)
def test_minibatches_of_a_rollout_of_whole_episodes(size):
    body = f"""
for update in range(100):
    batch = collect(env, model, 4)
    {size}
    for start in range(0, n, 64):
        loss = model(batch["obs"][start:start + 64]).mean()
        loss.backward()
"""
    assert reported(body) == [5]


def test_a_backward_through_lightning_manual_optimisation_counts_too():
    body = """
batch = collect(env, model, 4)
n = len(batch["obs"])
for start in range(0, n, 64):
    self.manual_backward(model(batch["obs"][start:start + 64]).mean())
"""
    assert reported(body) == [4]


def test_a_size_logged_through_a_collective_after_the_loop_agrees_on_nothing():
    body = """
batch = collect(env, model, 4)
n = batch["obs"].shape[0]
for start in range(0, n, 64):
    model(batch["obs"][start:start + 64]).mean().backward()
stats = torch.tensor([float(n)])
dist.all_reduce(stats)
"""
    assert reported(body) == [4]


EPISODES = """
def episodes(env, model, count, max_steps):
    rows = []
    for _ in range(count):
        obs = env.reset()
        for t in range(max_steps):
            obs, reward, term, trunc, info = env.step(model(obs))
            rows.append(obs)
            last = term or trunc or t == max_steps - 1
            if {ended}:
                {then}
    return torch.stack(rows)


class RunningMean:
    def update(self, x):
        n = x.shape[0]
        packed = torch.tensor([n, x.sum()])
        dist.all_reduce(packed)


rollout = episodes(env, model, 4, 1000)
n = rollout.shape[0]
for start in range(0, n, 64):
    model(rollout[start:start + 64]).mean().backward()
"""


@pytest.mark.parametrize(
    "ended, then, found",
    [
        # blind set bl's 05: whole episodes, each left when the environment ends it
        ("last", "break", [24]),
        ("term or trunc", "break", [24]),
        # episodes reset as they end: a fixed number of steps
        ("term or trunc", "obs = env.reset()", []),
    ],
    ids=["through-a-name", "on-the-step", "reset"],
)
def test_episodes_left_by_a_break_when_the_step_ends_them(ended, then, found):
    # A running mean's own collective, in another function, agrees on its own `n` only.
    assert reported(EPISODES.format(ended=ended, then=then)) == found


@pytest.mark.parametrize(
    "body",
    [
        # the ranks agree on the smallest rollout first
        """
batch = collect(env, model, 4)
n = batch["obs"].shape[0]
size = torch.tensor([n])
dist.all_reduce(size, op=dist.ReduceOp.MIN)
n = int(size.item())
for start in range(0, n, 64):
    model(batch["obs"][start:start + 64]).mean().backward()
""",
        # a fixed number of steps per rank, episodes reset as they end
        """
obs = fixed_steps(env, model, 2048)
n = obs.shape[0]
for start in range(0, n, 64):
    model(obs[start:start + 64]).mean().backward()
""",
        # a fixed number of minibatches, whatever the rollout's length
        """
batch = collect(env, model, 4)
for k in range(8):
    model(batch["obs"][k::8]).mean().backward()
""",
        # no backward in the loop (an evaluation of the rollout)
        """
batch = collect(env, model, 4)
n = batch["obs"].shape[0]
for start in range(0, n, 64):
    print(model(batch["obs"][start:start + 64]).mean())
""",
    ],
)
def test_agreed_or_fixed_counts_are_quiet(body):
    assert reported(body) == []


def test_without_ddp_each_process_trains_alone():
    body = """
batch = collect(env, model, 4)
n = batch["obs"].shape[0]
for start in range(0, n, 64):
    model(batch["obs"][start:start + 64]).mean().backward()
"""
    prelude = PRELUDE.replace("model = DDP(net)", "model = net")
    assert lint_snippet(prelude, body, ["uneven-inputs"]) == []


@pytest.mark.slow
def test_one_rank_runs_a_backward_more_and_fails_while_the_twin_agrees(torchrun):
    assert_broken_fails_and_twin_runs(torchrun, BROKEN, RANKS_STOPPED_MATCHING, FIXED, "finished")


def test_a_size_named_alike_in_another_function_is_not_the_rollouts():
    body = """
def update(env):
    batch = collect(env, model, 4)
    n = batch["obs"].shape[0]
    return n


def finetune(loader):
    n = len(loader)
    for step in range(n):
        model(next(loader)).mean().backward()
"""
    assert reported(body) == []
