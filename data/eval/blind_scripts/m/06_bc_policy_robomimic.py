"""
Behaviour cloning (BC-RNN-free, plain MLP + GMM head) on robomimic-style low-dim demos.

demos.hdf5 layout:
    data/demo_i/obs/{robot0_eef_pos, robot0_eef_quat, robot0_gripper_qpos, object}
    data/demo_i/actions    (T, 7)
    mask/train, mask/valid (lists of demo keys)

    torchrun --nproc_per_node=2 06_bc_policy_robomimic.py --dataset data/lift/ph/low_dim.hdf5
"""
import argparse
import json
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

OBS_KEYS = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object"]


def load_demos(path, split):
    obs, act = [], []
    with h5py.File(path, "r") as f:
        keys = [k.decode() for k in f[f"mask/{split}"][:]]
        for k in keys:
            g = f[f"data/{k}"]
            o = np.concatenate([g[f"obs/{ok}"][:] for ok in OBS_KEYS], axis=-1)
            obs.append(o.astype(np.float32))
            act.append(g["actions"][:].astype(np.float32))
    return np.concatenate(obs), np.concatenate(act)


class TransitionDataset(Dataset):
    def __init__(self, obs, act):
        self.obs = torch.from_numpy(obs)
        self.act = torch.from_numpy(act)

    def __len__(self):
        return len(self.obs)

    def __getitem__(self, i):
        return self.obs[i], self.act[i]


class Normalizer(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("std", torch.ones(dim))

    def fit(self, x):
        self.mean.copy_(torch.as_tensor(x.mean(0)))
        self.std.copy_(torch.as_tensor(x.std(0) + 1e-6))

    def forward(self, x):
        return (x - self.mean) / self.std


class GMMPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim, hidden=1024, n_modes=5):
        super().__init__()
        self.act_dim = act_dim
        self.n_modes = n_modes
        self.obs_norm = Normalizer(obs_dim)
        self.trunk = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
        )
        self.mean_head = nn.Linear(hidden, n_modes * act_dim)
        self.logstd_head = nn.Linear(hidden, n_modes * act_dim)
        self.logit_head = nn.Linear(hidden, n_modes)

    def forward(self, obs):
        h = self.trunk(self.obs_norm(obs))
        B = obs.shape[0]
        means = torch.tanh(self.mean_head(h)).view(B, self.n_modes, self.act_dim)
        log_std = self.logstd_head(h).view(B, self.n_modes, self.act_dim).clamp(-5, 2)
        logits = self.logit_head(h)
        return means, log_std, logits

    def log_prob(self, means, log_std, logits, act):
        comp = torch.distributions.Independent(torch.distributions.Normal(means, log_std.exp()), 1)
        mix = torch.distributions.Categorical(logits=logits)
        gmm = torch.distributions.MixtureSameFamily(mix, comp)
        return gmm.log_prob(act)

    @torch.no_grad()
    def predict_action(self, obs):
        """Deterministic action: mean of the most likely mode."""
        means, _, logits = self.forward(obs)
        k = logits.argmax(-1)
        return means[torch.arange(obs.shape[0], device=obs.device), k]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--epochs", type=int, default=600)
    ap.add_argument("--batch_size", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval_every", type=int, default=50)
    ap.add_argument("--out", default="bc_runs/lift_ph")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1 + rank)

    tr_obs, tr_act = load_demos(args.dataset, "train")
    va_obs, va_act = load_demos(args.dataset, "valid")
    if rank == 0:
        print(f"train transitions {len(tr_obs)}, valid {len(va_obs)}, obs dim {tr_obs.shape[1]}")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)

    train_ds = TransitionDataset(tr_obs, tr_act)
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=2, drop_last=True)

    policy = GMMPolicy(tr_obs.shape[1], tr_act.shape[1])
    policy.obs_norm.fit(tr_obs)
    policy = policy.to(device)
    model = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    va_obs_t = torch.from_numpy(va_obs)
    va_act_t = torch.from_numpy(va_act)
    my_idx = torch.arange(rank, len(va_obs_t), world)

    log_rows = []
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        acc = torch.zeros(2, device=device)
        for obs, act in loader:
            obs, act = obs.to(device), act.to(device)
            means, log_std, logits = model(obs)
            nll = -model.module.log_prob(means, log_std, logits, act).mean()
            opt.zero_grad()
            nll.backward()
            opt.step()
            acc += torch.stack([nll.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        train_nll = (acc[0] / acc[1]).item()

        row = {"epoch": epoch, "train_nll": train_nll, "sec": round(time.time() - t0, 2)}
        if epoch % args.eval_every == 0:
            model.eval()
            obs_v = va_obs_t[my_idx].to(device)
            act_v = va_act_t[my_idx].to(device)
            pred = model.predict_action(obs_v)
            err = torch.stack([((pred - act_v) ** 2).sum(), torch.tensor(float(act_v.numel()), device=device)])
            dist.all_reduce(err)
            row["val_action_mse"] = (err[0] / err[1]).item()
            if rank == 0:
                torch.save({"policy": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.out, f"model_epoch_{epoch}.pth"))
        if rank == 0:
            log_rows.append(row)
            print(row, flush=True)
            with open(os.path.join(args.out, "log.json"), "w") as f:
                json.dump(log_rows, f)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
