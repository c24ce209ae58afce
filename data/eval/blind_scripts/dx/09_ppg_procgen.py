"""Phasic Policy Gradient (PPG) on Procgen, data parallel across GPUs.

Policy phase: N_pi iterations of clipped PPO on the policy + value networks.
Auxiliary phase: distil the value function into the policy network's auxiliary
value head while a KL term keeps the policy fixed.

    torchrun --nproc_per_node=8 ppg_procgen.py --env-name starpilot --distribution-mode hard
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from procgen import ProcgenEnv
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter


def arguments():
    p = argparse.ArgumentParser()
    p.add_argument("--env-name", default="starpilot")
    p.add_argument("--distribution-mode", default="hard")
    p.add_argument("--num-envs", type=int, default=64, help="per GPU")
    p.add_argument("--n-steps", type=int, default=256)
    p.add_argument("--total-timesteps", type=int, default=200_000_000)
    p.add_argument("--n-pi", type=int, default=32, help="policy iterations per phase")
    p.add_argument("--e-pi", type=int, default=1)
    p.add_argument("--e-aux", type=int, default=6)
    p.add_argument("--beta-clone", type=float, default=1.0)
    p.add_argument("--nminibatch", type=int, default=8)
    p.add_argument("--aux-mbsize", type=int, default=4, help="envs per aux minibatch")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--gamma", type=float, default=0.999)
    p.add_argument("--lam", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--ent-coef", type=float, default=0.01)
    p.add_argument("--vf-coef", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logdir", default="runs/ppg")
    return p.parse_args()


def impala_cnn(chans=(16, 32, 32), out=256):
    layers, cin = [], 3
    for c in chans:
        layers += [nn.Conv2d(cin, c, 3, padding=1), nn.MaxPool2d(3, 2, padding=1), nn.ReLU(),
                   nn.Conv2d(c, c, 3, padding=1), nn.ReLU()]
        cin = c
    layers += [nn.Flatten(), nn.Linear(cin * 8 * 8, out), nn.ReLU()]
    return nn.Sequential(*layers)


class PPGNet(nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.pi_body = impala_cnn()
        self.pi_head = nn.Linear(256, n_actions)
        self.aux_v_head = nn.Linear(256, 1)
        self.v_body = impala_cnn()
        self.v_head = nn.Linear(256, 1)

    def forward(self, obs):
        x = obs.permute(0, 3, 1, 2).float() / 255.0
        h_pi = self.pi_body(x)
        logits = self.pi_head(h_pi)
        aux_value = self.aux_v_head(h_pi).squeeze(-1)
        value = self.v_head(self.v_body(x)).squeeze(-1)
        return logits, value, aux_value


def gae(rews, vals, dones, last_val, gamma, lam):
    T = rews.shape[0]
    adv = torch.zeros_like(rews)
    lastgaelam = 0.0
    for t in reversed(range(T)):
        nv = last_val if t == T - 1 else vals[t + 1]
        nonterm = 1.0 - dones[t]
        delta = rews[t] + gamma * nv * nonterm - vals[t]
        lastgaelam = delta + gamma * lam * nonterm * lastgaelam
        adv[t] = lastgaelam
    return adv


def main():
    args = arguments()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    venv = ProcgenEnv(num_envs=args.num_envs, env_name=args.env_name, num_levels=0, start_level=0,
                      distribution_mode=args.distribution_mode, rand_seed=args.seed * 1000 + rank)
    n_actions = venv.action_space.n

    torch.manual_seed(args.seed)
    net = PPGNet(n_actions).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, eps=1e-5)
    torch.manual_seed(args.seed + 1 + rank)
    writer = SummaryWriter(args.logdir) if rank == 0 else None

    T, N = args.n_steps, args.num_envs
    steps_per_phase = T * N * world * args.n_pi
    n_phases = args.total_timesteps // steps_per_phase
    obs = torch.from_numpy(venv.reset()["rgb"]).to(device)
    ep_ret = np.zeros(N)
    global_step, t0 = 0, time.time()

    for phase in range(n_phases):
        aux_obs, aux_returns = [], []

        # ---------------- policy phase ----------------
        for it in range(args.n_pi):
            obs_b = torch.zeros((T, N) + obs.shape[1:], dtype=torch.uint8, device=device)
            act_b = torch.zeros(T, N, dtype=torch.long, device=device)
            logp_b = torch.zeros(T, N, device=device)
            val_b = torch.zeros(T, N, device=device)
            rew_b = torch.zeros(T, N, device=device)
            done_b = torch.zeros(T, N, device=device)
            finished = []
            for t in range(T):
                with torch.no_grad():
                    logits, value, _ = net(obs)
                    d = torch.distributions.Categorical(logits=logits)
                    a = d.sample()
                obs_b[t], act_b[t], logp_b[t], val_b[t] = obs, a, d.log_prob(a), value
                o, r, done, _ = venv.step(a.cpu().numpy())
                ep_ret += r
                finished += ep_ret[done].tolist()
                ep_ret[done] = 0.0
                rew_b[t] = torch.as_tensor(r, dtype=torch.float32, device=device)
                done_b[t] = torch.as_tensor(done, dtype=torch.float32, device=device)
                obs = torch.from_numpy(o["rgb"]).to(device)
            global_step += T * N * world

            with torch.no_grad():
                _, last_v, _ = net(obs)
            adv = gae(rew_b, val_b, done_b, last_v, args.gamma, args.lam)
            ret = adv + val_b
            aux_obs.append(obs_b.cpu())
            aux_returns.append(ret.cpu())

            fo, fa, fl, fadv, fret = (x.reshape(T * N, *x.shape[2:]) for x in (obs_b, act_b, logp_b, adv, ret))
            mb = T * N // args.nminibatch
            for _ in range(args.e_pi):
                perm = torch.randperm(T * N, device=device)
                for i in range(args.nminibatch):
                    idx = perm[i * mb:(i + 1) * mb]
                    logits, value, _ = model(fo[idx])
                    d = torch.distributions.Categorical(logits=logits)
                    ratio = torch.exp(d.log_prob(fa[idx]) - fl[idx])
                    a_ = (fadv[idx] - fadv[idx].mean()) / (fadv[idx].std() + 1e-8)
                    pg = -torch.min(ratio * a_, ratio.clamp(1 - args.clip, 1 + args.clip) * a_).mean()
                    vloss = 0.5 * (value - fret[idx]).pow(2).mean()
                    loss = pg + args.vf_coef * vloss - args.ent_coef * d.entropy().mean()
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()

            stats = torch.tensor([sum(finished), len(finished)], dtype=torch.float32, device=device)
            dist.all_reduce(stats)
            if writer is not None:
                writer.add_scalar("loss/pg", pg.item(), global_step)
                writer.add_scalar("loss/v", vloss.item(), global_step)
                writer.add_scalar("perf/sps", global_step / (time.time() - t0), global_step)
                if stats[1] > 0:
                    writer.add_scalar("return/train", (stats[0] / stats[1]).item(), global_step)

        # ---------------- auxiliary phase ----------------
        a_obs = torch.cat(aux_obs, dim=1)        # [T, N * n_pi, ...] on CPU
        a_ret = torch.cat(aux_returns, dim=1)
        n_seg = a_obs.shape[1]
        with torch.no_grad():
            old_logits = torch.cat([net(a_obs[:, j:j + args.aux_mbsize].flatten(0, 1).to(device))[0].cpu()
                                    for j in range(0, n_seg, args.aux_mbsize)], 0)
        old_logits = old_logits.view(T, n_seg, -1)
        for _ in range(args.e_aux):
            perm = torch.randperm(n_seg)
            for j in range(0, n_seg, args.aux_mbsize):
                cols = perm[j:j + args.aux_mbsize]
                o_mb = a_obs[:, cols].flatten(0, 1).to(device, non_blocking=True)
                r_mb = a_ret[:, cols].flatten(0, 1).to(device, non_blocking=True)
                ol_mb = old_logits[:, cols].flatten(0, 1).to(device, non_blocking=True)
                logits, value, aux_value = model(o_mb)
                kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(ol_mb, -1), log_target=True,
                              reduction="batchmean")
                aux_loss = 0.5 * (aux_value - r_mb).pow(2).mean()
                v_loss = 0.5 * (value - r_mb).pow(2).mean()
                loss = aux_loss + args.beta_clone * kl + v_loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        if writer is not None:
            writer.add_scalar("loss/aux", aux_loss.item(), global_step)
            writer.add_scalar("loss/clone_kl", kl.item(), global_step)
        if rank == 0:
            torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "phase": phase},
                       os.path.join(args.logdir, "ppg_last.pt"))

    venv.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
