"""BC-Transformer (GPT over an observation history) on robomimic tool_hang/ph low-dim, DDP.

Train/valid split comes from the dataset's own filter keys (mask/train, mask/valid).

    torchrun --nproc_per_node=4 14_robomimic_bc_transformer_history.py \
        --hdf5 datasets/tool_hang/ph/low_dim_v141.hdf5 --save_dir runs/bct_tool_hang
"""
import argparse
import math
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
from torch.utils.tensorboard import SummaryWriter

LOWDIM = ["robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object"]


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdf5", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--context", type=int, default=10)
    ap.add_argument("--n_layer", type=int, default=6)
    ap.add_argument("--n_head", type=int, default=8)
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def read_demos(path, filter_key):
    with h5py.File(path, "r") as f:
        names = [n.decode() for n in f[f"mask/{filter_key}"][()]]
        demos = []
        for n in names:
            g = f[f"data/{n}"]
            demos.append((np.concatenate([g[f"obs/{k}"][()] for k in LOWDIM], -1).astype(np.float32),
                          g["actions"][()].astype(np.float32)))
    return demos


class HistoryDataset(Dataset):
    """Windows of `context` consecutive steps; the start of an episode is padded with its first frame."""

    def __init__(self, demos, context, mean, std):
        self.demos = [((o - mean) / std, a) for o, a in demos]
        self.context = context
        self.index = [(d, t) for d, (o, _) in enumerate(self.demos) for t in range(len(o))]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        d, t = self.index[i]
        obs, act = self.demos[d]
        idx = np.clip(np.arange(t - self.context + 1, t + 1), 0, None)
        valid = np.arange(t - self.context + 1, t + 1) >= 0
        return torch.from_numpy(obs[idx]), torch.from_numpy(act[idx]), torch.from_numpy(valid)


class GPTPolicy(nn.Module):
    def __init__(self, obs_dim, act_dim, context, d_model, n_layer, n_head, dropout):
        super().__init__()
        self.embed = nn.Linear(obs_dim, d_model)
        self.pos = nn.Parameter(torch.zeros(1, context, d_model))
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, n_layer)
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, act_dim)
        self.register_buffer("causal", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)

    def forward(self, obs):
        x = self.embed(obs) + self.pos[:, : obs.shape[1]]
        x = self.blocks(x, mask=self.causal[: obs.shape[1], : obs.shape[1]])
        return torch.tanh(self.head(self.ln(x)))


def masked_mse(pred, act, valid):
    err = ((pred - act) ** 2).mean(-1)
    return (err * valid).sum() / valid.sum()


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    losses = []
    for obs, act, valid in loader:
        obs, act, valid = obs.to(device), act.to(device), valid.to(device).float()
        losses.append(masked_mse(model(obs), act, valid).item())
    model.train()
    return float(np.mean(losses))


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    train_demos, valid_demos = read_demos(args.hdf5, "train"), read_demos(args.hdf5, "valid")
    all_obs = np.concatenate([o for o, _ in train_demos])
    mean, std = all_obs.mean(0), all_obs.std(0) + 1e-3
    train_set = HistoryDataset(train_demos, args.context, mean, std)
    valid_set = HistoryDataset(valid_demos, args.context, mean, std)

    per_gpu = args.global_batch // world
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    valid_sampler = DistributedSampler(valid_set, shuffle=False)
    train_loader = DataLoader(train_set, per_gpu, sampler=train_sampler, num_workers=4, drop_last=True,
                              pin_memory=True, persistent_workers=True)
    valid_loader = DataLoader(valid_set, per_gpu, sampler=valid_sampler, num_workers=2)

    net = GPTPolicy(mean.shape[0], train_demos[0][1].shape[1], args.context, args.d_model, args.n_layer,
                    args.n_head, args.dropout).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))

    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.save_dir, "logs"))
        np.savez(os.path.join(args.save_dir, "obs_norm.npz"), mean=mean, std=std)

    best_val = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start, tr = time.time(), torch.zeros(2, device=device)
        for obs, act, valid in train_loader:
            obs, act = obs.to(device, non_blocking=True), act.to(device, non_blocking=True)
            valid = valid.to(device, non_blocking=True).float()
            loss = masked_mse(model(obs), act, valid)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tr += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tr)
        val_loss = validate(net, valid_loader, device)

        if rank == 0:
            train_loss = (tr[0] / tr[1]).item()
            writer.add_scalar("loss/train", train_loss, epoch)
            writer.add_scalar("loss/valid", val_loss, epoch)
            writer.add_scalar("lr", sched.get_last_lr()[0], epoch)
            print(f"epoch {epoch:3d} | train {train_loss:.5f} | valid {val_loss:.5f} | {time.time() - start:.1f}s")
            state = {"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "val_loss": val_loss, "obs_mean": mean, "obs_std": std}
            torch.save(state, os.path.join(args.save_dir, "last.pt"))
            if val_loss < best_val:
                best_val = val_loss
                torch.save(state, os.path.join(args.save_dir, "best.pt"))
                print(f"  new best valid loss {best_val:.5f}")

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
