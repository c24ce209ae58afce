"""Full-episode recurrent BC on robomimic multi-human (mh) low-dim data with timestep-budget batching.

Whole demonstrations are fed to a GRU (packed sequences). Batches are built by a timestep budget,
so the number of batches differs between GPUs; DDP's Join context manager handles the uneven ends.

    torchrun --nproc_per_node=4 17_full_episode_gru_bc_join.py --data datasets/can/mh/low_dim_v141.hdf5
"""
import argparse
import os
import random
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence

KEYS = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object"]


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/gru_bc_can_mh")
    ap.add_argument("--timesteps_per_batch", type=int, default=16384, help="padded timesteps per step, all GPUs")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def load(path):
    with h5py.File(path, "r") as f:
        train = [n.decode() for n in f["mask/train"][()]]
        valid = [n.decode() for n in f["mask/valid"][()]]
        read = lambda d: (np.concatenate([f[f"data/{d}/obs/{k}"][()] for k in KEYS], -1).astype(np.float32),
                          f[f"data/{d}/actions"][()].astype(np.float32))
        return [read(d) for d in train], [read(d) for d in valid]


def shard_by_length(episodes, rank, world_size):
    """Greedy longest-first assignment so every rank gets roughly the same number of timesteps.
    Deterministic: every rank computes the same assignment."""
    order = sorted(range(len(episodes)), key=lambda i: (-len(episodes[i][1]), i))
    loads, owner = [0] * world_size, {}
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        owner[i] = r
        loads[r] += len(episodes[i][1])
    return [episodes[i] for i in sorted(owner) if owner[i] == rank]


def budget_batches(episodes, budget, rng):
    idx = list(range(len(episodes)))
    rng.shuffle(idx)
    batches, cur, cur_max = [], [], 0
    for i in idx:
        L = len(episodes[i][1])
        if cur and max(cur_max, L) * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        batches.append(cur)
    return batches


def collate(episodes, ids, mean, std, device):
    obs = [torch.from_numpy((episodes[i][0] - mean) / std) for i in ids]
    act = [torch.from_numpy(episodes[i][1]) for i in ids]
    lengths = torch.tensor([len(a) for a in act])
    return (pad_sequence(obs, batch_first=True).to(device, non_blocking=True),
            pad_sequence(act, batch_first=True).to(device, non_blocking=True), lengths)


class GRUPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(obs_dim, hidden), nn.LayerNorm(hidden), nn.GELU())
        self.gru = nn.GRU(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, act_dim), nn.Tanh())

    def forward(self, obs, lengths):
        packed = pack_padded_sequence(self.enc(obs), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.gru(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=obs.shape[1])
        return self.head(out)


def seq_loss(pred, act, lengths):
    mask = (torch.arange(act.shape[1])[None] < lengths[:, None]).to(act.device).float()
    return (((pred - act) ** 2).mean(-1) * mask).sum(), mask.sum()


def main():
    a = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(a.seed)

    train_eps, valid_eps = load(a.data)
    all_obs = np.concatenate([o for o, _ in train_eps])
    mean, std = all_obs.mean(0), all_obs.std(0) + 1e-3
    my_train = shard_by_length(train_eps, rank, world_size)
    my_valid = valid_eps[rank::world_size]

    net = GRUPolicy(all_obs.shape[1], train_eps[0][1].shape[1], a.hidden).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=1e-4)
    rng = random.Random(a.seed * 1000 + rank)
    budget = a.timesteps_per_batch // world_size

    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        np.savez(os.path.join(a.out, "obs_norm.npz"), mean=mean, std=std)
    best = float("inf")
    for epoch in range(a.epochs):
        t0 = time.time()
        batches = budget_batches(my_train, budget, rng)
        sums = torch.zeros(3, device=device)  # loss sum, timesteps, batches
        model.train()
        with Join([model]):
            for ids in batches:
                obs, act, lengths = collate(my_train, ids, mean, std, device)
                loss_sum, n = seq_loss(model(obs, lengths), act, lengths)
                loss = loss_sum / n
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sums += torch.stack([loss_sum.detach(), n, torch.ones((), device=device)])

        net.eval()
        val = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids in budget_batches(my_valid, budget, random.Random(0)):
                obs, act, lengths = collate(my_valid, ids, mean, std, device)
                ls, n = seq_loss(net(obs, lengths), act, lengths)
                val += torch.stack([ls, n])
        dist.all_reduce(sums)
        dist.all_reduce(val)
        val_loss = (val[0] / val[1]).item()
        if rank == 0:
            print(f"epoch {epoch}: train {(sums[0] / sums[1]).item():.5f} over {int(sums[2])} batches, "
                  f"valid {val_loss:.5f} ({time.time() - t0:.1f}s)")
            ckpt = {"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                    "obs_mean": mean, "obs_std": std}
            torch.save(ckpt, os.path.join(a.out, "last.pt"))
            if val_loss < best:
                torch.save(ckpt, os.path.join(a.out, "best.pt"))
        best = min(best, val_loss)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
