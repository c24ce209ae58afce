"""
Ape-X style distributed DQN.

Every torchrun rank is one learner (one GPU, DDP over learners) that owns
`--actors-per-rank` actor processes. Actors step their environments, act with
a periodically refreshed copy of the Q-network on the learner's GPU, and push
n-step transitions through a queue into the learner's local replay memory.

    torchrun --nproc_per_node=4 13_apex_actors.py --env ALE/Seaquest-v5 --actors-per-rank 6
"""
import argparse
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


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="ALE/Seaquest-v5")
    ap.add_argument("--actors-per-rank", type=int, default=6)
    ap.add_argument("--updates", type=int, default=500_000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--replay", type=int, default=500_000)
    ap.add_argument("--learning-starts", type=int, default=50_000)
    ap.add_argument("--n-step", type=int, default=3)
    ap.add_argument("--gamma", type=float, default=0.99)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--target-every", type=int, default=2_500)
    ap.add_argument("--publish-every", type=int, default=400, help="learner updates between weight pushes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default="apex_ckpt")
    return ap.parse_args()


class QNet(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(),
            nn.Linear(3136, 512), nn.ReLU(), nn.Linear(512, n_actions))

    def forward(self, x):
        return self.net(x.float() / 255.0)


def make_env(env_id, seed):
    env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0, full_action_space=False)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, noop_max=30)
    env = gym.wrappers.FrameStack(env, 4)
    env.reset(seed=seed)
    return env


def actor_loop(actor_id, eps, args, n_actions, shared_weights, version, out_q, stop, device):
    torch.set_num_threads(1)
    env = make_env(args.env, args.seed + 7777 * actor_id)
    rng = np.random.default_rng(args.seed + actor_id)
    net = QNet(n_actions).to(device).eval()
    local_version = -1
    obs, _ = env.reset()
    window, ep_ret = [], 0.0
    while not stop.is_set():
        if version.value != local_version:
            net.load_state_dict(shared_weights.state_dict())
            local_version = version.value
        if rng.random() < eps:
            a = int(rng.integers(n_actions))
        else:
            with torch.no_grad():
                a = int(net(torch.as_tensor(np.asarray(obs), device=device)[None]).argmax(1).item())
        nxt, r, term, trunc, _ = env.step(a)
        ep_ret += r
        window.append((np.asarray(obs), a, float(np.sign(r))))
        if len(window) == args.n_step or term or trunc:
            while window:
                R = sum(w[2] * args.gamma ** k for k, w in enumerate(window))
                disc = 0.0 if term else args.gamma ** len(window)
                out_q.put((window[0][0], window[0][1], R, np.asarray(nxt), disc))
                window.pop(0)
                if not (term or trunc):
                    break
        obs = nxt
        if term or trunc:
            out_q.put(("episode", ep_ret))
            ep_ret = 0.0
            obs, _ = env.reset()
    env.close()


class Memory:
    def __init__(self, cap, shape):
        self.s = np.zeros((cap, *shape), np.uint8)
        self.s2 = np.zeros((cap, *shape), np.uint8)
        self.a = np.zeros(cap, np.int64)
        self.r = np.zeros(cap, np.float32)
        self.d = np.zeros(cap, np.float32)
        self.cap, self.i, self.n = cap, 0, 0

    def push(self, s, a, r, s2, d):
        self.s[self.i], self.a[self.i], self.r[self.i], self.s2[self.i], self.d[self.i] = s, a, r, s2, d
        self.i = (self.i + 1) % self.cap
        self.n = min(self.n + 1, self.cap)

    def sample(self, k, device):
        j = np.random.randint(0, self.n, k)
        return [torch.from_numpy(x[j]).to(device, non_blocking=True) for x in (self.s, self.a, self.r, self.s2, self.d)]


def drain(q, mem, episodes, limit=20_000):
    for _ in range(limit):
        try:
            item = q.get_nowait()
        except queue.Empty:
            break
        if item[0] == "episode":
            episodes.append(item[1])
        else:
            mem.push(*item)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed + rank)

    probe = make_env(args.env, 0)
    n_actions, obs_shape = probe.action_space.n, probe.observation_space.shape
    probe.close()

    learner = DDP(QNet(n_actions).to(device), device_ids=[local_rank])
    target = QNet(n_actions).to(device)
    target.load_state_dict(learner.module.state_dict())
    opt = torch.optim.Adam(learner.parameters(), lr=args.lr, eps=1.5e-4)

    # CPU copy of the weights in shared memory; actors reload it when `version` changes
    shared = QNet(n_actions)
    shared.load_state_dict(learner.module.state_dict())
    shared.share_memory()
    version = mp.Value("i", 0)
    stop = mp.Event()
    out_q = mp.Queue(maxsize=50_000)

    total_actors = world * args.actors_per_rank
    actors = []
    for i in range(args.actors_per_rank):
        gid = rank * args.actors_per_rank + i
        eps = 0.4 ** (1 + 7 * gid / max(1, total_actors - 1))
        p = mp.Process(target=actor_loop,
                       args=(gid, eps, args, n_actions, shared, version, out_q, stop, device), daemon=True)
        p.start()
        actors.append(p)

    mem = Memory(args.replay // world, obs_shape)
    episodes = []
    while mem.n < args.learning_starts:
        drain(out_q, mem, episodes)
        time.sleep(0.05)
    dist.barrier()

    tic = time.time()
    for update in range(1, args.updates + 1):
        drain(out_q, mem, episodes, limit=2_000)
        s, a, r, s2, d = mem.sample(args.batch_size, device)
        with torch.no_grad():
            a2 = learner.module(s2).argmax(1, keepdim=True)
            y = r + d * target(s2).gather(1, a2).squeeze(1)
        q = learner(s).gather(1, a[:, None]).squeeze(1)
        loss = F.smooth_l1_loss(q, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(learner.parameters(), 40.0)
        opt.step()

        if update % args.target_every == 0:
            target.load_state_dict(learner.module.state_dict())
        if update % args.publish_every == 0:
            with torch.no_grad():
                for ps, pl in zip(shared.parameters(), learner.module.parameters()):
                    ps.copy_(pl.detach().cpu())
            version.value += 1

        if update % 1000 == 0:
            st = torch.tensor([loss.item(), float(sum(episodes)), float(len(episodes)), float(mem.n)], device=device)
            dist.all_reduce(st)
            episodes.clear()
            if rank == 0:
                ret = (st[1] / st[2]).item() if st[2] > 0 else float("nan")
                print(f"update {update} loss {st[0].item() / world:.4f} return {ret:.1f} "
                      f"replay {int(st[3].item())} ups {update / (time.time() - tic):.1f}", flush=True)
        if update % 50_000 == 0 and rank == 0:
            os.makedirs(args.save, exist_ok=True)
            torch.save({"model": learner.module.state_dict(), "opt": opt.state_dict(), "update": update},
                       os.path.join(args.save, f"apex_{update}.pt"))

    stop.set()
    for p in actors:
        p.join(timeout=10)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
