# Monobeast-style IMPALA, multi-GPU.
#
# Each torchrun process is a learner on its own GPU; learners average gradients
# with DDP. Every learner forks a set of actor processes that write unrolls into
# pre-allocated shared-memory buffers (free_queue / full_queue protocol as in
# torchbeast). Actors run the policy on the learner's GPU so that the conv net
# forward is not the bottleneck on the CPU-poor nodes.
#
#   torchrun --nproc_per_node=4 impala_torchbeast_style.py --env PongNoFrameskip-v4
import argparse
import copy
import os
import threading
import time
import timeit

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--env", default="PongNoFrameskip-v4")
parser.add_argument("--num_actors", type=int, default=8)
parser.add_argument("--num_buffers", type=int, default=32)
parser.add_argument("--unroll_length", type=int, default=80)
parser.add_argument("--batch_size", type=int, default=8)
parser.add_argument("--total_steps", type=int, default=50_000_000)
parser.add_argument("--learning_rate", type=float, default=4.8e-4)
parser.add_argument("--discounting", type=float, default=0.99)
parser.add_argument("--entropy_cost", type=float, default=0.0006)
parser.add_argument("--baseline_cost", type=float, default=0.5)
parser.add_argument("--grad_norm_clipping", type=float, default=40.0)
parser.add_argument("--savedir", default="~/logs/torchbeast")
parser.add_argument("--xpid", default=None)


def create_env(name, seed):
    env = gym.wrappers.AtariPreprocessing(gym.make(name), noop_max=30, frame_skip=4, screen_size=84)
    env = gym.wrappers.FrameStack(env, 4)
    env.reset(seed=seed)
    return env


class Net(nn.Module):
    def __init__(self, num_actions):
        super().__init__()
        self.num_actions = num_actions
        self.conv1 = nn.Conv2d(4, 32, 8, 4)
        self.conv2 = nn.Conv2d(32, 64, 4, 2)
        self.conv3 = nn.Conv2d(64, 64, 3, 1)
        self.fc = nn.Linear(3136 + num_actions + 1, 512)
        self.policy = nn.Linear(512, num_actions)
        self.baseline = nn.Linear(512, 1)

    def forward(self, frame, last_action, reward):
        T, B = frame.shape[:2]
        x = frame.flatten(0, 1).float() / 255.0
        x = F.relu(self.conv3(F.relu(self.conv2(F.relu(self.conv1(x))))))
        one_hot = F.one_hot(last_action.flatten(0, 1), self.num_actions).float()
        r = reward.flatten(0, 1).clamp(-1, 1).unsqueeze(-1)
        x = F.relu(self.fc(torch.cat([x.flatten(1), one_hot, r], -1)))
        return self.policy(x).view(T, B, -1), self.baseline(x).view(T, B)


def create_buffers(flags, obs_shape, num_actions):
    T = flags.unroll_length
    specs = dict(
        frame=dict(size=(T + 1, *obs_shape), dtype=torch.uint8),
        reward=dict(size=(T + 1,), dtype=torch.float32),
        done=dict(size=(T + 1,), dtype=torch.bool),
        episode_return=dict(size=(T + 1,), dtype=torch.float32),
        policy_logits=dict(size=(T + 1, num_actions), dtype=torch.float32),
        last_action=dict(size=(T + 1,), dtype=torch.int64),
        action=dict(size=(T + 1,), dtype=torch.int64),
    )
    buffers = {key: [] for key in specs}
    for _ in range(flags.num_buffers):
        for key, spec in specs.items():
            buffers[key].append(torch.empty(**spec).share_memory_())
    return buffers


def act(flags, actor_index, free_queue, full_queue, shared_model, buffers, seed, device):
    torch.manual_seed(seed)
    env = create_env(flags.env, seed)
    model = copy.deepcopy(shared_model).to(device)
    obs, _ = env.reset()
    reward, done, ep_return, last_action = 0.0, False, 0.0, 0
    while True:
        index = free_queue.get()
        if index is None:
            break
        model.load_state_dict(shared_model.state_dict())
        for t in range(flags.unroll_length + 1):
            frame = torch.from_numpy(np.asarray(obs)).view(1, 1, *buffers["frame"][index].shape[1:])
            with torch.no_grad():
                logits, _ = model(frame.to(device), torch.tensor([[last_action]], device=device),
                                  torch.tensor([[reward]], device=device))
            action = int(torch.multinomial(F.softmax(logits[0, 0], -1), 1).item())
            buffers["frame"][index][t] = frame[0, 0]
            buffers["reward"][index][t] = reward
            buffers["done"][index][t] = done
            buffers["episode_return"][index][t] = ep_return
            if done:
                ep_return = 0.0
            buffers["policy_logits"][index][t] = logits[0, 0].cpu()
            buffers["last_action"][index][t] = last_action
            buffers["action"][index][t] = action
            obs, reward, term, trunc, _ = env.step(action)
            done = term or trunc
            ep_return += reward
            last_action = action
            if done:
                obs, _ = env.reset()
                last_action = 0
        full_queue.put(index)


def get_batch(flags, free_queue, full_queue, buffers, lock, device):
    with lock:
        indices = [full_queue.get() for _ in range(flags.batch_size)]
    batch = {key: torch.stack([buffers[key][m] for m in indices], dim=1) for key in buffers}
    for m in indices:
        free_queue.put(m)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def vtrace_from_logits(behavior_logits, target_logits, actions, discounts, rewards, values, bootstrap_value):
    with torch.no_grad():
        target_lp = -F.cross_entropy(target_logits.flatten(0, 1), actions.flatten(), reduction="none").view_as(actions)
        behavior_lp = -F.cross_entropy(behavior_logits.flatten(0, 1), actions.flatten(), reduction="none").view_as(actions)
        rhos = torch.exp(target_lp - behavior_lp)
        clipped = rhos.clamp(max=1.0)
        cs = rhos.clamp(max=1.0)
        values_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], 0)
        deltas = clipped * (rewards + discounts * values_tp1 - values)
        acc = torch.zeros_like(bootstrap_value)
        out = []
        for t in reversed(range(discounts.shape[0])):
            acc = deltas[t] + discounts[t] * cs[t] * acc
            out.append(acc)
        vs = torch.stack(out[::-1]) + values
        vs_tp1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], 0)
        return vs, clipped * (rewards + discounts * vs_tp1 - values)


def main():
    flags = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    flags.xpid = flags.xpid or f"impala-{time.strftime('%Y%m%d-%H%M%S')}"
    ckpt_path = os.path.expanduser(os.path.join(flags.savedir, flags.xpid, "model.tar"))

    env = create_env(flags.env, 0)
    obs_shape, num_actions = env.observation_space.shape, env.action_space.n
    env.close()

    torch.manual_seed(0)
    shared_model = Net(num_actions)
    shared_model.share_memory()
    learner_model = DDP(copy.deepcopy(shared_model).to(device), device_ids=[local_rank])
    optimizer = torch.optim.RMSprop(learner_model.parameters(), lr=flags.learning_rate, momentum=0, eps=0.01, alpha=0.99)
    buffers = create_buffers(flags, obs_shape, num_actions)

    ctx = mp.get_context("fork")
    free_queue, full_queue = ctx.SimpleQueue(), ctx.SimpleQueue()
    actors = []
    for i in range(flags.num_actors):
        p = ctx.Process(target=act, args=(flags, i, free_queue, full_queue, shared_model, buffers,
                                          1000 * rank + i, device))
        p.start()
        actors.append(p)
    for m in range(flags.num_buffers):
        free_queue.put(m)

    steps_per_update = flags.unroll_length * flags.batch_size * world
    num_updates = flags.total_steps // steps_per_update
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1 - min(e, num_updates) / num_updates)
    lock = threading.Lock()
    start = timeit.default_timer()

    for update in range(num_updates):
        batch = get_batch(flags, free_queue, full_queue, buffers, lock, device)
        logits, baseline = learner_model(batch["frame"], batch["last_action"], batch["reward"])
        bootstrap_value = baseline[-1].detach()
        logits, baseline = logits[:-1], baseline[:-1]
        # row t holds the frame, the action chosen on it and the reward that led to it
        actions = batch["action"][:-1]
        rewards = batch["reward"][1:].clamp(-1, 1)
        dones = batch["done"][1:]

        discounts = (~dones).float() * flags.discounting
        vs, pg_adv = vtrace_from_logits(batch["policy_logits"][:-1], logits.detach(), actions, discounts,
                                        rewards, baseline.detach(), bootstrap_value)
        ce = F.cross_entropy(logits.flatten(0, 1), actions.flatten(), reduction="none").view_as(pg_adv)
        pg_loss = (ce * pg_adv).sum()
        baseline_loss = 0.5 * ((vs - baseline) ** 2).sum()
        probs = F.softmax(logits, -1)
        entropy_loss = (probs * F.log_softmax(logits, -1)).sum()
        loss = pg_loss + flags.baseline_cost * baseline_loss + flags.entropy_cost * entropy_loss

        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(learner_model.parameters(), flags.grad_norm_clipping)
        optimizer.step()
        scheduler.step()
        shared_model.load_state_dict(learner_model.module.state_dict())

        done_returns = batch["episode_return"][1:][dones]
        stat = torch.stack([done_returns.sum(), torch.tensor(float(done_returns.numel()), device=device)])
        dist.all_reduce(stat)
        if rank == 0 and update % 50 == 0:
            sps = (update + 1) * steps_per_update / (timeit.default_timer() - start)
            mean_ret = (stat[0] / stat[1]).item() if stat[1] > 0 else float("nan")
            print(f"update {update} steps {(update + 1) * steps_per_update} sps {sps:.0f} "
                  f"loss {loss.item():.2f} return {mean_ret:.2f}", flush=True)
        if rank == 0 and update % 2000 == 0:
            os.makedirs(os.path.dirname(ckpt_path), exist_ok=True)
            torch.save({"model_state_dict": learner_model.module.state_dict(),
                        "optimizer_state_dict": optimizer.state_dict(), "flags": vars(flags)}, ckpt_path)

    for _ in range(flags.num_actors):
        free_queue.put(None)
    for p in actors:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
