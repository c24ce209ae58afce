"""Mahjong (RLCard) policy-gradient self-play against a pool of past selves.

The learner takes one seat, the other three seats are filled with snapshots
drawn from the opponent pool (recent snapshots more likely).  Snapshots are
added to the pool every --snapshot-every updates.

    torchrun --nproc_per_node=8 mahjong_pool.py --pool-dir /shared/mahjong/pool --run-dir /shared/mahjong/run4
"""
import argparse
import glob
import os
import random
import time

import numpy as np
import rlcard
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class MahjongPolicy(nn.Module):
    def __init__(self, in_ch, n_actions, ch=64):
        super().__init__()
        # obs is (planes, 34 tiles, 4 copies) -> treat the tile axis as a 1-D sequence
        self.conv = nn.Sequential(nn.Conv1d(in_ch * 4, ch, 3, padding=1), nn.ReLU(),
                                  nn.Conv1d(ch, ch, 3, padding=1), nn.ReLU(),
                                  nn.Conv1d(ch, ch, 3, padding=1), nn.ReLU())
        self.pi = nn.Sequential(nn.Flatten(), nn.Linear(ch * 34, 512), nn.ReLU(), nn.Linear(512, n_actions))
        self.v = nn.Sequential(nn.Flatten(), nn.Linear(ch * 34, 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, obs, mask):
        b = obs.shape[0]
        h = self.conv(obs.permute(0, 1, 3, 2).reshape(b, -1, 34))
        return self.pi(h).masked_fill(~mask, -1e9), self.v(h).squeeze(-1)


def state_tensors(state, n_actions):
    obs = torch.from_numpy(np.asarray(state["obs"], dtype=np.float32))
    mask = torch.zeros(n_actions, dtype=torch.bool)
    mask[list(state["legal_actions"].keys())] = True
    return obs, mask


class OpponentPool:
    def __init__(self, pool_dir, make_net, device, recent_bias=2.0, cache_size=6):
        self.dir, self.make_net, self.device = pool_dir, make_net, device
        self.recent_bias, self.cache, self.cache_size = recent_bias, {}, cache_size

    def paths(self):
        return sorted(glob.glob(os.path.join(self.dir, "snap_*.pt")))

    def draw(self):
        ps = self.paths()
        if not ps:
            return None
        w = np.arange(1, len(ps) + 1, dtype=np.float64) ** self.recent_bias
        path = ps[np.random.choice(len(ps), p=w / w.sum())]
        if path not in self.cache:
            if len(self.cache) >= self.cache_size:
                self.cache.pop(next(iter(self.cache)))
            net = self.make_net().to(self.device).eval()
            net.load_state_dict(torch.load(path)["model"])
            self.cache[path] = net
        return self.cache[path]


@torch.no_grad()
def sample_action(net, obs, mask, device):
    logits, v = net(obs[None].to(device), mask[None].to(device))
    d = torch.distributions.Categorical(logits=logits[0])
    a = d.sample()
    return int(a), float(d.log_prob(a)), float(v[0])


def rollout(env, learner, pool, n_actions, device, n_steps):
    obs_l, mask_l, act_l, ret_l, val_l, wins, games = [], [], [], [], [], 0, 0
    while len(act_l) < n_steps:
        seat = random.randrange(env.num_players)
        opps = [pool.draw() or learner for _ in range(env.num_players)]
        state, pid = env.reset()
        ep = []
        while not env.is_over():
            obs, mask = state_tensors(state, n_actions)
            if pid == seat:
                a, _, v = sample_action(learner, obs, mask, device)
                ep.append((obs, mask, a, v))
            else:
                a = sample_action(opps[pid], obs, mask, device)[0]
            state, pid = env.step(a)
        payoff = float(env.get_payoffs()[seat])
        for obs, mask, a, v in ep:
            obs_l.append(obs)
            mask_l.append(mask)
            act_l.append(a)
            val_l.append(v)
            ret_l.append(payoff)
        wins += payoff > 0
        games += 1
    n = n_steps
    return (torch.stack(obs_l[:n]), torch.stack(mask_l[:n]), torch.tensor(act_l[:n]),
            torch.tensor(ret_l[:n]), torch.tensor(val_l[:n]), wins, games)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool-dir", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--updates", type=int, default=50_000)
    ap.add_argument("--steps-per-rank", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--ent", type=float, default=0.01)
    ap.add_argument("--vf", type=float, default=0.5)
    ap.add_argument("--snapshot-every", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100)

    env = rlcard.make("mahjong", config={"seed": 100 + rank})
    in_ch = env.state_shape[0][0]
    n_actions = env.num_actions
    make_net = lambda: MahjongPolicy(in_ch, n_actions)
    net = make_net().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    pool = OpponentPool(args.pool_dir, make_net, device)
    ckpt = os.path.join(args.run_dir, "learner.pt")
    start = 0
    if os.path.exists(ckpt):
        ck = torch.load(ckpt, map_location=device)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        start = ck["update"] + 1
    if rank == 0:
        os.makedirs(args.pool_dir, exist_ok=True)
        os.makedirs(args.run_dir, exist_ok=True)
    dist.barrier()

    t0 = time.time()
    for upd in range(start, args.updates):
        net.eval()
        obs, mask, act, ret, val, wins, games = rollout(env, net, pool, n_actions, device, args.steps_per_rank)
        obs, mask, act = obs.to(device), mask.to(device), act.to(device)
        ret, val = ret.float().to(device), val.float().to(device)
        adv = ret - val
        adv = (adv - adv.mean()) / (adv.std() + 1e-6)

        model.train()
        logits, v = model(obs, mask)
        logp = F.log_softmax(logits, -1)
        pg = -(logp.gather(1, act[:, None]).squeeze(1) * adv).mean()
        vl = F.mse_loss(v, ret)
        ent = -(logp.exp() * logp).sum(-1).mean()
        loss = pg + args.vf * vl - args.ent * ent
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

        if upd % args.log_every == 0:
            s = torch.tensor([pg.item(), vl.item(), ent.item(), wins, games], device=device, dtype=torch.float64)
            dist.all_reduce(s)
            if rank == 0:
                print(f"upd {upd} | pg {s[0] / world:+.4f} vf {s[1] / world:.4f} ent {s[2] / world:.3f} "
                      f"| learner win rate {s[3] / s[4]:.3f} over {int(s[4])} games "
                      f"| pool {len(pool.paths())} | {time.time() - t0:.0f}s", flush=True)
        if rank == 0 and upd % args.snapshot_every == 0:
            tmp = os.path.join(args.pool_dir, f".snap_{upd:06d}.tmp")
            torch.save({"model": net.state_dict(), "update": upd}, tmp)
            os.replace(tmp, os.path.join(args.pool_dir, f"snap_{upd:06d}.pt"))
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "update": upd}, ckpt)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
