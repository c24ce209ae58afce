#!/usr/bin/env python3
"""Neural Fictitious Self-Play (NFSP) on Leduc poker, data parallel.

Each rank plays its own self-play episodes and keeps its own RL replay buffer
and SL reservoir; the best-response Q-net and the average-policy net are both
DDP models.  Small CPU-side bookkeeping (buffer sizes, episode counts) goes
through a separate gloo group so it never touches the NCCL stream.

    torchrun --nproc_per_node=4 leduc_nfsp.py --iterations 200000 --out runs/nfsp_leduc
"""
import argparse
import collections
import copy
import os
import random
import time

import numpy as np
import pyspiel
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from open_spiel.python import policy as os_policy
from open_spiel.python.algorithms import exploitability
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp(i, o, h=256):
    return nn.Sequential(nn.Linear(i, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, o))


class Reservoir:
    def __init__(self, cap):
        self.cap, self.data, self.seen = cap, [], 0

    def add(self, x):
        if len(self.data) < self.cap:
            self.data.append(x)
        else:
            j = random.randint(0, self.seen)
            if j < self.cap:
                self.data[j] = x
        self.seen += 1

    def sample(self, n):
        return random.sample(self.data, n)

    def __len__(self):
        return len(self.data)


def strip_prefix(sd):
    # checkpoints from before the DDP switch were saved from the wrapper
    return {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}


def masked(logits, mask):
    return logits.masked_fill(~mask, float("-inf"))


def run_episode(game, q_net, avg_net, eta, eps, device, rl_buf, sl_buf):
    state = game.new_initial_state()
    modes = [random.random() < eta for _ in range(game.num_players())]  # True -> best response
    pending = [None] * game.num_players()
    while not state.is_terminal():
        if state.is_chance_node():
            acts, probs = zip(*state.chance_outcomes())
            state.apply_action(int(np.random.choice(acts, p=probs)))
            continue
        p = state.current_player()
        obs = torch.tensor(state.information_state_tensor(p), dtype=torch.float32)
        mask = torch.tensor(state.legal_actions_mask(p), dtype=torch.bool)
        if pending[p] is not None:
            rl_buf.append(pending[p] + (0.0, obs, mask, 0.0))
        with torch.no_grad():
            if modes[p]:
                q = masked(q_net(obs[None].to(device))[0], mask.to(device))
                legal = mask.nonzero().flatten().tolist()
                a = random.choice(legal) if random.random() < eps else int(q.argmax())
                sl_buf.add((obs, a))
            else:
                probs = F.softmax(masked(avg_net(obs[None].to(device))[0], mask.to(device)), -1)
                a = int(torch.multinomial(probs, 1))
        pending[p] = (obs, a)
        state.apply_action(a)
    rets = state.returns()
    for p in range(game.num_players()):
        if pending[p] is not None:
            obs, a = pending[p]
            rl_buf.append((obs, a, rets[p], torch.zeros_like(obs), torch.zeros(game.num_distinct_actions(),
                                                                                 dtype=torch.bool), 1.0))


def to_device(batch, device):
    return [torch.stack(x).to(device) if torch.is_tensor(x[0]) else torch.tensor(x, device=device)
            for x in zip(*batch)]


def exploitability_of(avg_net, game, device):
    tab = os_policy.TabularPolicy(game)
    for idx, st in enumerate(tab.states):
        p = st.current_player()
        obs = torch.tensor(st.information_state_tensor(p), dtype=torch.float32, device=device)
        mask = torch.tensor(st.legal_actions_mask(p), dtype=torch.bool, device=device)
        with torch.no_grad():
            tab.action_probability_array[idx] = F.softmax(masked(avg_net(obs[None])[0], mask), -1).cpu().numpy()
    return exploitability.exploitability(game, tab)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=200_000)
    ap.add_argument("--episodes-per-iter", type=int, default=16)
    ap.add_argument("--rl-buffer", type=int, default=200_000)
    ap.add_argument("--sl-buffer", type=int, default=2_000_000)
    ap.add_argument("--min-buffer", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rl-lr", type=float, default=0.01)
    ap.add_argument("--sl-lr", type=float, default=0.005)
    ap.add_argument("--eta", type=float, default=0.1)
    ap.add_argument("--eps-start", type=float, default=0.06)
    ap.add_argument("--target-every", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=5000)
    ap.add_argument("--out", default="runs/nfsp_leduc")
    ap.add_argument("--init", default="", help="optional checkpoint to warm start from")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    cpu_group = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000)

    game = pyspiel.load_game("leduc_poker")
    d_in, n_act = game.information_state_tensor_size(), game.num_distinct_actions()
    q_net, avg_net = mlp(d_in, n_act).to(device), mlp(d_in, n_act).to(device)
    if args.init:
        ck = torch.load(args.init, map_location="cpu")
        q_net.load_state_dict(strip_prefix(ck["q_net"]))
        avg_net.load_state_dict(strip_prefix(ck["avg_net"]))
    target = copy.deepcopy(q_net).eval()
    q_ddp = DDP(q_net, device_ids=[local_rank])
    avg_ddp = DDP(avg_net, device_ids=[local_rank])
    q_opt = torch.optim.SGD(q_ddp.parameters(), lr=args.rl_lr)
    sl_opt = torch.optim.SGD(avg_ddp.parameters(), lr=args.sl_lr)
    rl_buf = collections.deque(maxlen=args.rl_buffer)
    sl_buf = Reservoir(args.sl_buffer)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.time()

    for it in range(1, args.iterations + 1):
        eps = args.eps_start / np.sqrt(it / 1000 + 1)
        q_net.eval()
        avg_net.eval()
        for _ in range(args.episodes_per_iter):
            run_episode(game, q_net, avg_net, args.eta, eps, device, rl_buf, sl_buf)

        # every rank has to agree on whether this iteration trains
        sizes = torch.tensor([len(rl_buf), len(sl_buf)], dtype=torch.int64)
        dist.all_reduce(sizes, op=dist.ReduceOp.MIN, group=cpu_group)
        if sizes.min().item() < max(args.min_buffer, args.batch):
            continue

        q_net.train()
        avg_net.train()
        obs, act, rew, nobs, nmask, done = to_device(random.sample(rl_buf, args.batch), device)
        with torch.no_grad():
            nq = masked(target(nobs), nmask).max(1).values
            nq = torch.where(done.bool(), torch.zeros_like(nq), nq)
        q = q_ddp(obs).gather(1, act[:, None]).squeeze(1)
        rl_loss = F.mse_loss(q, rew.float() + nq)
        q_opt.zero_grad(set_to_none=True)
        rl_loss.backward()
        q_opt.step()

        s_obs, s_act = to_device(sl_buf.sample(args.batch), device)
        sl_loss = F.cross_entropy(avg_ddp(s_obs), s_act)
        sl_opt.zero_grad(set_to_none=True)
        sl_loss.backward()
        sl_opt.step()

        if it % args.target_every == 0:
            target.load_state_dict(q_net.state_dict())

        if it % args.eval_every == 0:
            losses = torch.stack([rl_loss.detach(), sl_loss.detach()])
            dist.all_reduce(losses, op=dist.ReduceOp.AVG)
            if rank == 0:
                expl = exploitability_of(avg_net.eval(), game, device)
                print(f"it {it} | rl {losses[0]:.4f} sl {losses[1]:.4f} | exploitability {expl:.4f} "
                      f"| {time.time() - t0:.0f}s", flush=True)
                torch.save({"q_net": q_net.state_dict(), "avg_net": avg_net.state_dict(), "it": it},
                           os.path.join(args.out, f"nfsp_{it:07d}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
