"""PPO with a Beta policy on CarRacing-v2 (pixels), multi-GPU.

    torchrun --nproc_per_node=4 ppo_car_racing.py --total-steps 20000000
"""
import argparse
import logging
import os
import random
import time

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Beta
from torch.nn.parallel import DistributedDataParallel as DDP

log = logging.getLogger("carracing")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--rollout", type=int, default=256)
    p.add_argument("--total-steps", type=int, default=20_000_000)
    p.add_argument("--lr", type=float, default=2.5e-4)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--minibatch", type=int, default=256)
    p.add_argument("--vf-coef", type=float, default=2.0)
    p.add_argument("--ent-coef", type=float, default=0.0)
    p.add_argument("--frame-skip", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default="models/carracing")
    return p.parse_args()


def seed_everything(seed):
    rank = dist.get_rank() if dist.is_available() else 0
    seed = seed + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    return seed


class SkipFrame(gym.Wrapper):
    def __init__(self, env, skip):
        super().__init__(env)
        self.skip = skip

    def step(self, action):
        total, info = 0.0, {}
        for _ in range(self.skip):
            obs, r, term, trunc, info = self.env.step(action)
            total += r
            if term or trunc:
                break
        return obs, total, term, trunc, info


def make_env(seed, skip):
    def thunk():
        env = gym.make("CarRacing-v2", continuous=True)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = SkipFrame(env, skip)
        env = gym.wrappers.GrayScaleObservation(env)
        env = gym.wrappers.ResizeObservation(env, 84)
        env = gym.wrappers.FrameStack(env, 4)
        env.action_space.seed(seed)
        return env
    return thunk


class BetaPolicy(nn.Module):
    def __init__(self, act_dim=3):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(4, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU())
        self.alpha = nn.Linear(512, act_dim)
        self.beta = nn.Linear(512, act_dim)
        self.value = nn.Linear(512, 1)

    def forward(self, x):
        h = self.cnn(x.float() / 255.0)
        return F.softplus(self.alpha(h)) + 1.0, F.softplus(self.beta(h)) + 1.0, self.value(h).squeeze(-1)


def to_env_action(a):
    # Beta sample in [0, 1]^3 -> steer in [-1, 1], gas and brake in [0, 1]
    out = a.clone()
    out[:, 0] = a[:, 0] * 2.0 - 1.0
    return out


def main():
    args = get_args()
    seed = seed_everything(args.seed)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    envs = gym.vector.SyncVectorEnv([make_env(seed * 1000 + i, args.frame_skip) for i in range(args.num_envs)])
    net = BetaPolicy().to(device)
    model = DDP(net, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)

    T, N = args.rollout, args.num_envs
    iters = args.total_steps // (T * N * world * args.frame_skip)
    obs_shape = envs.single_observation_space.shape
    next_obs = torch.as_tensor(np.asarray(envs.reset(seed=seed)[0]), device=device)
    best_return = -1e9
    t0 = time.time()

    for it in range(iters):
        obs_b = torch.zeros((T, N) + obs_shape, dtype=torch.uint8, device=device)
        act_b = torch.zeros(T, N, 3, device=device)
        logp_b = torch.zeros(T, N, device=device)
        val_b = torch.zeros(T, N, device=device)
        rew_b = torch.zeros(T, N, device=device)
        done_b = torch.zeros(T, N, device=device)
        ep_acc = torch.zeros(2, device=device)
        for t in range(T):
            with torch.no_grad():
                al, be, v = net(next_obs)
                d = Beta(al, be)
                a = d.sample().clamp(1e-6, 1 - 1e-6)
            obs_b[t], act_b[t], logp_b[t], val_b[t] = next_obs, a, d.log_prob(a).sum(-1), v
            o, r, term, trunc, info = envs.step(to_env_action(a).cpu().numpy())
            rew_b[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
            done_b[t] = torch.as_tensor(term | trunc, dtype=torch.float32, device=device)
            next_obs = torch.as_tensor(np.asarray(o), device=device)
            if "final_info" in info:
                for fi in info["final_info"]:
                    if fi is not None and "episode" in fi:
                        ep_acc += torch.tensor([float(fi["episode"]["r"]), 1.0], device=device)

        with torch.no_grad():
            _, _, last_v = net(next_obs)
            adv = torch.zeros_like(rew_b)
            g = torch.zeros(N, device=device)
            for t in reversed(range(T)):
                nv = last_v if t == T - 1 else val_b[t + 1]
                nt = 1.0 - done_b[t]
                g = rew_b[t] + args.gamma * nv * nt - val_b[t] + args.gamma * args.lam * nt * g
                adv[t] = g
            ret = adv + val_b

        fo, fa, fl = obs_b.flatten(0, 1), act_b.flatten(0, 1), logp_b.flatten()
        fadv, fret = adv.flatten(), ret.flatten()
        fadv = (fadv - fadv.mean()) / (fadv.std() + 1e-8)
        for _ in range(args.epochs):
            perm = torch.randperm(T * N, device=device)
            for s in range(0, T * N, args.minibatch):
                idx = perm[s:s + args.minibatch]
                al, be, v = model(fo[idx])
                d = Beta(al, be)
                ratio = (d.log_prob(fa[idx]).sum(-1) - fl[idx]).exp()
                pg = -torch.min(ratio * fadv[idx], ratio.clamp(1 - args.clip, 1 + args.clip) * fadv[idx]).mean()
                vl = F.smooth_l1_loss(v, fret[idx])
                loss = pg + args.vf_coef * vl - args.ent_coef * d.entropy().sum(-1).mean()
                optim.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optim.step()

        dist.all_reduce(ep_acc)
        if rank == 0:
            steps = (it + 1) * T * N * world * args.frame_skip
            mean_ret = (ep_acc[0] / ep_acc[1]).item() if ep_acc[1] > 0 else float("nan")
            log.info("iter %d/%d frames %d ret %.1f pg %.4f vl %.4f fps %.0f", it + 1, iters, steps, mean_ret,
                     pg.item(), vl.item(), steps / (time.time() - t0))
            os.makedirs(args.save_dir, exist_ok=True)
            torch.save(net.state_dict(), os.path.join(args.save_dir, "last.pt"))
            if ep_acc[1] > 0 and mean_ret > best_return:
                best_return = mean_ret
                torch.save(net.state_dict(), os.path.join(args.save_dir, "best.pt"))

    envs.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
