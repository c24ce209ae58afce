"""IMPALA-style actor/learner on Atari.

One learner process per GPU (launched by torchrun, synchronised with DDP).
Every learner owns a pool of CPU actor processes that step the emulators and
push fixed-length unrolls through a queue. Actors pull fresh weights from a
shared-memory copy of the policy that the learner refreshes after every update.

    torchrun --nnodes=1 --nproc_per_node=8 impala_learner_actors.py --env-id ALE/Breakout-v5
"""
import argparse
import functools
import logging
import os
import queue
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("impala")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="ALE/Breakout-v5")
    p.add_argument("--num-actors", type=int, default=12, help="actor processes per learner")
    p.add_argument("--unroll-length", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=32, help="unrolls per learner step")
    p.add_argument("--total-frames", type=int, default=200_000_000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--discount", type=float, default=0.99)
    p.add_argument("--entropy-cost", type=float, default=0.01)
    p.add_argument("--baseline-cost", type=float, default=0.5)
    p.add_argument("--grad-norm-clip", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="/checkpoint/impala")
    p.add_argument("--log-every", type=int, default=20)
    return p.parse_args()


def make_env(env_id, seed):
    env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0, full_action_space=False)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, noop_max=30)
    env = gym.wrappers.FrameStack(env, 4)
    env.reset(seed=seed)
    return env


class AtariNet(nn.Module):
    def __init__(self, num_actions):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 32, 8, stride=4)
        self.conv2 = nn.Conv2d(32, 64, 4, stride=2)
        self.conv3 = nn.Conv2d(64, 64, 3, stride=1)
        self.fc = nn.Linear(3136, 512)
        self.policy = nn.Linear(512, num_actions)
        self.baseline = nn.Linear(512, 1)

    def forward(self, frames):
        x = frames.float() / 255.0
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        x = F.relu(self.fc(x.flatten(1)))
        return self.policy(x), self.baseline(x).squeeze(-1)


def actor_loop(actor_id, env_fn, seed, shared_model, unroll_length, out_queue, stop_event):
    """Runs on CPU only. Never touches CUDA."""
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    env = env_fn()
    model = AtariNet(env.action_space.n)
    model.eval()
    obs, _ = env.reset()
    episode_return = 0.0
    while not stop_event.is_set():
        model.load_state_dict(shared_model.state_dict())
        frames, actions, rewards, dones, logits_buf, finished = [], [], [], [], [], []
        for _ in range(unroll_length):
            obs_t = torch.from_numpy(np.asarray(obs)).unsqueeze(0)
            with torch.no_grad():
                logits, _ = model(obs_t)
            action = int(torch.multinomial(F.softmax(logits, dim=-1), 1).item())
            next_obs, reward, term, trunc, _ = env.step(action)
            episode_return += reward
            frames.append(np.asarray(obs))
            actions.append(action)
            rewards.append(reward)
            dones.append(term or trunc)
            logits_buf.append(logits.squeeze(0).numpy())
            if term or trunc:
                finished.append(episode_return)
                episode_return = 0.0
                next_obs, _ = env.reset()
            obs = next_obs
        frames.append(np.asarray(obs))  # bootstrap frame
        item = {
            "frames": np.stack(frames),
            "actions": np.asarray(actions, dtype=np.int64),
            "rewards": np.asarray(rewards, dtype=np.float32),
            "dones": np.asarray(dones, dtype=np.bool_),
            "behaviour_logits": np.stack(logits_buf),
            "episode_returns": finished,
        }
        while not stop_event.is_set():
            try:
                out_queue.put(item, timeout=1.0)
                break
            except queue.Full:
                continue
    env.close()


@torch.no_grad()
def vtrace(behaviour_logits, target_logits, actions, discounts, rewards, values, bootstrap_value,
           clip_rho=1.0, clip_pg_rho=1.0):
    target_logp = F.log_softmax(target_logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    behaviour_logp = F.log_softmax(behaviour_logits, -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    rhos = torch.exp(target_logp - behaviour_logp)
    clipped_rhos = torch.clamp(rhos, max=clip_rho)
    cs = torch.clamp(rhos, max=1.0)
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)
    acc = torch.zeros_like(bootstrap_value)
    result = []
    for t in reversed(range(discounts.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        result.append(acc)
    vs_minus_v = torch.stack(result[::-1])
    vs = vs_minus_v + values
    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    pg_adv = torch.clamp(rhos, max=clip_pg_rho) * (rewards + discounts * vs_t_plus_1 - values)
    return vs, pg_adv


def collate(items, device):
    # time-major: [T, B, ...]
    out = {}
    for k in ("frames", "actions", "rewards", "dones", "behaviour_logits"):
        out[k] = torch.from_numpy(np.stack([it[k] for it in items], axis=1)).to(device, non_blocking=True)
    returns = [r for it in items for r in it["episode_returns"]]
    return out, returns


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    probe = make_env(args.env_id, 0)
    num_actions = probe.action_space.n
    probe.close()

    torch.manual_seed(args.seed)
    learner = AtariNet(num_actions).to(device)
    learner = DDP(learner, device_ids=[local_rank])
    optimizer = torch.optim.RMSprop(learner.parameters(), lr=args.lr, momentum=0, eps=0.01, alpha=0.99)

    frames_per_update = args.unroll_length * args.batch_size * world
    num_updates = args.total_frames // frames_per_update
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1 - min(u, num_updates) / num_updates)

    # CPU copy the actors read from; refreshed in place after each update.
    shared_model = AtariNet(num_actions)
    shared_model.load_state_dict(learner.module.state_dict())
    shared_model.share_memory()

    ctx = mp.get_context("spawn")
    rollout_queue = ctx.Queue(maxsize=2 * args.batch_size)
    stop_event = ctx.Event()
    actors = []
    for i in range(args.num_actors):
        actor_seed = args.seed + 10_000 * rank + i
        env_fn = functools.partial(make_env, args.env_id, actor_seed)
        proc = ctx.Process(
            target=actor_loop,
            args=(i, env_fn, actor_seed, shared_model, args.unroll_length, rollout_queue, stop_event),
            daemon=True,
        )
        proc.start()
        actors.append(proc)

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        log.info("world=%d actors/learner=%d updates=%d", world, args.num_actors, num_updates)

    t0 = time.time()
    ret_sum, ret_cnt = 0.0, 0
    for update in range(1, num_updates + 1):
        items = [rollout_queue.get() for _ in range(args.batch_size)]
        batch, finished = collate(items, device)
        ret_sum += sum(finished)
        ret_cnt += len(finished)

        frames = batch["frames"]
        T, B = batch["actions"].shape
        logits, values = learner(frames.flatten(0, 1))
        logits = logits.view(T + 1, B, num_actions)
        values = values.view(T + 1, B)
        bootstrap_value = values[-1].detach()
        logits, values = logits[:-1], values[:-1]

        rewards = batch["rewards"].clamp(-1, 1)
        discounts = (~batch["dones"]).float() * args.discount
        vs, pg_adv = vtrace(batch["behaviour_logits"], logits.detach(), batch["actions"],
                            discounts, rewards, values.detach(), bootstrap_value)

        logp = F.log_softmax(logits, -1)
        action_logp = logp.gather(-1, batch["actions"].unsqueeze(-1)).squeeze(-1)
        pg_loss = -(action_logp * pg_adv).sum()
        baseline_loss = 0.5 * ((vs - values) ** 2).sum()
        entropy_loss = (F.softmax(logits, -1) * logp).sum()
        loss = pg_loss + args.baseline_cost * baseline_loss + args.entropy_cost * entropy_loss

        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(learner.parameters(), args.grad_norm_clip)
        optimizer.step()
        scheduler.step()
        shared_model.load_state_dict(learner.module.state_dict())

        if update % args.log_every == 0:
            stats = torch.tensor([ret_sum, ret_cnt, loss.item()], device=device, dtype=torch.float64)
            dist.all_reduce(stats)
            ret_sum, ret_cnt = 0.0, 0
            if rank == 0:
                fps = update * frames_per_update / (time.time() - t0)
                mean_ret = (stats[0] / stats[1]).item() if stats[1] > 0 else float("nan")
                log.info("update %d frames %d fps %.0f loss %.3f return %.2f (%d eps)",
                         update, update * frames_per_update, fps, (stats[2] / world).item(),
                         mean_ret, int(stats[1].item()))

        if rank == 0 and (update % 1000 == 0 or update == num_updates):
            torch.save({"model": learner.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "update": update}, os.path.join(args.out_dir, "latest.pt"))

    stop_event.set()
    for proc in actors:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
