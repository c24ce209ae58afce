"""AlphaZero for checkers (OpenSpiel game), multi-GPU.

Every GPU runs its own self-play, keeps its own replay buffer of recent
iterations and makes a few passes over it; gradients are averaged by DDP.

  torchrun --nproc_per_node=8 checkers_az.py --iters 500 --games 32 --epochs 2
"""
import argparse
import json
import math
import os
import random
import time
from collections import deque

import numpy as np
import pyspiel
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

GAME = pyspiel.load_game("checkers")
OBS_SHAPE = GAME.observation_tensor_shape()  # [planes, 8, 8]
N_ACT = GAME.num_distinct_actions()
MAX_PLIES = 200


class Net(nn.Module):
    def __init__(self, ch=128, n_blocks=8):
        super().__init__()
        c_in = OBS_SHAPE[0]
        self.head = nn.Sequential(nn.Conv2d(c_in, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU())
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.ReLU(),
                          nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch))
            for _ in range(n_blocks)])
        self.pol = nn.Sequential(nn.Conv2d(ch, 8, 1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, N_ACT))
        self.val = nn.Sequential(nn.Conv2d(ch, 4, 1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 128),
                                 nn.ReLU(), nn.Linear(128, 1), nn.Tanh())

    def forward(self, x):
        x = self.head(x)
        for b in self.blocks:
            x = F.relu(x + b(x))
        return self.pol(x), self.val(x).squeeze(1)


class MCTS:
    def __init__(self, net, device, sims, c_puct=1.5, alpha=0.5):
        self.net, self.device, self.sims, self.c, self.alpha = net, device, sims, c_puct, alpha

    @torch.no_grad()
    def expand(self, state):
        p = state.current_player()
        x = torch.tensor(state.observation_tensor(p), dtype=torch.float32, device=self.device).view(1, *OBS_SHAPE)
        logits, v = self.net(x)
        legal = state.legal_actions()
        pri = torch.softmax(logits[0, legal], 0).cpu().numpy()
        return {"a": legal, "P": pri, "N": np.zeros(len(legal)), "W": np.zeros(len(legal)),
                "ch": {}, "player": p}, v.item()

    def search(self, root_state, add_noise=True):
        root, _ = self.expand(root_state)
        if add_noise:
            root["P"] = 0.75 * root["P"] + 0.25 * np.random.dirichlet([self.alpha] * len(root["a"]))
        for _ in range(self.sims):
            node, st, path = root, root_state.clone(), []
            while True:
                q = np.divide(node["W"], node["N"], out=np.zeros(len(node["N"])), where=node["N"] > 0)
                u = self.c * node["P"] * math.sqrt(node["N"].sum() + 1) / (1 + node["N"])
                i = int(np.argmax(q + u))
                path.append((node, i))
                st.apply_action(node["a"][i])
                if st.is_terminal():
                    returns = st.returns()
                    break
                if i not in node["ch"]:
                    node["ch"][i], v = self.expand(st)
                    leaf_p = st.current_player()
                    returns = [v if pl == leaf_p else -v for pl in range(2)]
                    break
                node = node["ch"][i]
            for nd, i in path:
                nd["N"][i] += 1
                nd["W"][i] += returns[nd["player"]]
        return root["a"], root["N"]


def self_play(mcts, temp_plies):
    st, hist = GAME.new_initial_state(), []
    while not st.is_terminal() and len(hist) < MAX_PLIES:
        acts, n = mcts.search(st)
        pi = np.zeros(N_ACT, np.float32)
        pi[acts] = n / n.sum()
        p = st.current_player()
        hist.append((np.asarray(st.observation_tensor(p), np.float32).reshape(OBS_SHAPE), pi, p))
        j = np.random.choice(len(acts), p=n / n.sum()) if len(hist) <= temp_plies else int(n.argmax())
        st.apply_action(acts[j])
    ret = st.returns() if st.is_terminal() else [0.0, 0.0]
    return [(o, pi, ret[p]) for o, pi, p in hist]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--games", type=int, default=32, help="self-play games per GPU per iteration")
    ap.add_argument("--sims", type=int, default=160)
    ap.add_argument("--temp-plies", type=int, default=16)
    ap.add_argument("--keep-iters", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--out", default="exp/checkers")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)
    np.random.seed(42 + rank)
    random.seed(42 + rank)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(Net()).to(device)
    ddp = DDP(net, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    mcts = MCTS(net, device, args.sims)
    history = deque(maxlen=args.keep_iters)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        json.dump(vars(args), open(os.path.join(args.out, "args.json"), "w"), indent=2)

    for it in range(args.iters):
        t0 = time.time()
        net.eval()
        fresh = []
        for _ in range(args.games):
            fresh += self_play(mcts, args.temp_plies)
        history.append(fresh)
        t_play = time.time() - t0

        data = [x for chunk in history for x in chunk]
        ds = TensorDataset(torch.from_numpy(np.stack([d[0] for d in data])),
                           torch.from_numpy(np.stack([d[1] for d in data])),
                           torch.tensor([d[2] for d in data], dtype=torch.float32))
        loader = DataLoader(ds, batch_size=args.bs, shuffle=True, drop_last=True, pin_memory=True)

        ddp.train()
        sums = torch.zeros(3, device=device)
        for ep in range(args.epochs):
            for x, pi, z in loader:
                x, pi, z = x.to(device, non_blocking=True), pi.to(device, non_blocking=True), z.to(device)
                logits, v = ddp(x)
                lp = -(pi * F.log_softmax(logits, 1)).sum(1).mean()
                lv = F.mse_loss(v, z)
                opt.zero_grad(set_to_none=True)
                (lp + lv).backward()
                opt.step()
                sums += torch.stack([lp.detach(), lv.detach(), torch.ones((), device=device)])
        dist.all_reduce(sums)

        if rank == 0:
            n = sums[2].item()
            print(f"it {it:4d} | positions {len(ds)} (+{len(fresh)}) | lp {sums[0].item() / n:.3f} "
                  f"lv {sums[1].item() / n:.3f} | play {t_play:.0f}s train {time.time() - t0 - t_play:.0f}s",
                  flush=True)
            if it % 10 == 9:
                torch.save({"net": net.state_dict(), "opt": opt.state_dict(), "it": it},
                           os.path.join(args.out, f"ckpt_{it + 1:04d}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
