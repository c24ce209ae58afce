"""PPO learner for our Unity game build (ML-Agents gym wrapper), multi-GPU.

Every rank launches its own headless Unity instances (unique worker_id -> unique
port) and trains on their experience; DDP keeps the policy replicas in sync.
At the end, rank 0 exports a TorchScript policy for the in-game inference runtime.

    torchrun --nproc_per_node=4 learner_policy_export.py --build /opt/builds/arena_linux/Arena.x86_64
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from mlagents_envs.environment import UnityEnvironment
from mlagents_envs.envs.unity_gym_env import UnityToGymWrapper
from mlagents_envs.side_channel.engine_configuration_channel import EngineConfigurationChannel
from torch.distributions import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--instances", type=int, default=8, help="Unity instances per rank")
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--horizon", type=int, default=256)
    ap.add_argument("--iterations", type=int, default=4000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--gamma", type=float, default=0.995)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--minibatches", type=int, default=4)
    ap.add_argument("--ent-coef", type=float, default=5e-3)
    ap.add_argument("--out", default="exports/arena")
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def launch_unity(build, worker_id, seed, time_scale):
    channel = EngineConfigurationChannel()
    uenv = UnityEnvironment(file_name=build, worker_id=worker_id, seed=seed, no_graphics=True,
                            side_channels=[channel])
    channel.set_configuration_parameters(time_scale=time_scale)
    return UnityToGymWrapper(uenv, allow_multiple_obs=False)


class PolicyNet(nn.Module):
    def __init__(self, obs_dim, n_actions):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.logits = nn.Linear(256, n_actions)
        self.value = nn.Linear(256, 1)

    def forward(self, obs):
        h = self.body(obs)
        return self.logits(h), self.value(h).squeeze(-1)


class InferencePolicy(nn.Module):
    """What ships in the game: observation -> greedy action index."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, obs):
        logits, _ = self.net(obs)
        return logits.argmax(-1)


def export_policy(ckpt_path, obs_dim, n_actions, out_dir):
    net = PolicyNet(obs_dim, n_actions)
    net.load_state_dict(torch.load(ckpt_path, map_location="cpu"))
    net.eval()
    scripted = torch.jit.trace(InferencePolicy(net), torch.zeros(1, obs_dim))
    scripted.save(os.path.join(out_dir, "policy_ts.pt"))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    envs = [launch_unity(args.build, rank * args.instances + i, args.seed + rank * args.instances + i, args.time_scale)
            for i in range(args.instances)]
    obs_dim = envs[0].observation_space.shape[0]
    n_actions = envs[0].action_space.n

    torch.manual_seed(args.seed)
    model = DDP(PolicyNet(obs_dim, n_actions).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    torch.manual_seed(args.seed + 1 + rank)
    ckpt_path = os.path.join(args.out, "policy_state.pt")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    T, N = args.horizon, args.instances
    obs = torch.as_tensor(np.stack([e.reset() for e in envs]), dtype=torch.float32, device=device)
    ep_ret = np.zeros(N)
    t0 = time.time()
    for it in range(args.iterations):
        o_b = torch.zeros(T, N, obs_dim, device=device)
        a_b = torch.zeros(T, N, dtype=torch.long, device=device)
        lp_b = torch.zeros(T, N, device=device)
        v_b = torch.zeros(T, N, device=device)
        r_b = torch.zeros(T, N, device=device)
        d_b = torch.zeros(T, N, device=device)
        done_returns = []
        for t in range(T):
            with torch.no_grad():
                logits, v = model.module(obs)
                dist_ = Categorical(logits=logits)
                a = dist_.sample()
            o_b[t], a_b[t], lp_b[t], v_b[t] = obs, a, dist_.log_prob(a), v
            next_obs = []
            for i, (env, act) in enumerate(zip(envs, a.tolist())):
                o, r, done, _ = env.step(act)
                ep_ret[i] += r
                r_b[t, i], d_b[t, i] = r, float(done)
                if done:
                    done_returns.append(ep_ret[i])
                    ep_ret[i] = 0.0
                    o = env.reset()
                next_obs.append(o)
            obs = torch.as_tensor(np.stack(next_obs), dtype=torch.float32, device=device)

        with torch.no_grad():
            _, last_v = model.module(obs)
            adv = torch.zeros_like(r_b)
            g = torch.zeros(N, device=device)
            for t in reversed(range(T)):
                nv = last_v if t == T - 1 else v_b[t + 1]
                nt = 1.0 - d_b[t]
                g = r_b[t] + args.gamma * nv * nt - v_b[t] + args.gamma * args.lam * nt * g
                adv[t] = g
            ret = adv + v_b

        fo, fa, fl, fadv, fret = (x.flatten(0, 1) for x in (o_b, a_b, lp_b, adv, ret))
        mb = T * N // args.minibatches
        for _ in range(args.epochs):
            perm = torch.randperm(T * N, device=device)
            for k in range(args.minibatches):
                idx = perm[k * mb:(k + 1) * mb]
                logits, v = model(fo[idx])
                d = Categorical(logits=logits)
                ratio = (d.log_prob(fa[idx]) - fl[idx]).exp()
                na = (fadv[idx] - fadv[idx].mean()) / (fadv[idx].std() + 1e-8)
                pg = -torch.min(ratio * na, ratio.clamp(1 - args.clip, 1 + args.clip) * na).mean()
                vl = 0.5 * (v - fret[idx]).pow(2).mean()
                loss = pg + 0.5 * vl - args.ent_coef * d.entropy().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()

        st = torch.tensor([float(sum(done_returns)), float(len(done_returns))], device=device)
        dist.all_reduce(st)
        if rank == 0:
            if st[1] > 0:
                print(f"it {it} return {(st[0] / st[1]).item():.2f} eps {int(st[1].item())} "
                      f"sps {(it + 1) * T * N * world / (time.time() - t0):.0f}", flush=True)
            if (it + 1) % 100 == 0:
                torch.save(model.state_dict(), ckpt_path)

    for env in envs:
        env.close()
    if rank == 0:
        torch.save(model.state_dict(), ckpt_path)
        export_policy(ckpt_path, obs_dim, n_actions, args.out)
        print(f"exported TorchScript policy to {args.out}/policy_ts.pt", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
