"""Behavior Transformer (k-means action bins + residual offsets) on multimodal block-pushing demos, DDP.

Data layout as released with BeT: multimodal_push_observations.npy (N, T, 16),
multimodal_push_actions.npy (N, T, 2), multimodal_push_masks.npy (N, T) - episodes are padded to T.

    torchrun --nproc_per_node=4 20_bet_blockpush_kmeans.py --data_dir data/multimodal_push_fixed_target
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.cluster import KMeans
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", required=True)
    p.add_argument("--out", default="runs/bet_blockpush")
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--n_bins", type=int, default=64)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=256)
    p.add_argument("--global_batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=350)
    p.add_argument("--offset_weight", type=float, default=100.0)
    p.add_argument("--gamma", type=float, default=2.0, help="focal loss gamma")
    p.add_argument("--val_frac", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=42)
    return p.parse_args()


class WindowedEpisodes(Dataset):
    def __init__(self, obs, act, lengths, episodes, window):
        self.obs, self.act, self.window = obs, act, window
        self.slices = [(e, s) for e in episodes for s in range(max(1, lengths[e] - window + 1))]

    def __len__(self):
        return len(self.slices)

    def __getitem__(self, i):
        e, s = self.slices[i]
        sl = slice(s, s + self.window)
        return torch.from_numpy(self.obs[e, sl]), torch.from_numpy(self.act[e, sl])


class BeT(nn.Module):
    def __init__(self, obs_dim, act_dim, window, n_bins, n_layer, n_embd, n_head=4):
        super().__init__()
        self.inp = nn.Linear(obs_dim, n_embd)
        self.pos = nn.Parameter(torch.zeros(1, window, n_embd))
        layer = nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, 0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.gpt = nn.TransformerEncoder(layer, n_layer)
        self.ln = nn.LayerNorm(n_embd)
        self.bin_head = nn.Linear(n_embd, n_bins)
        self.offset_head = nn.Linear(n_embd, n_bins * act_dim)
        self.register_buffer("mask", torch.triu(torch.ones(window, window, dtype=torch.bool), 1), persistent=False)
        self.n_bins, self.act_dim = n_bins, act_dim

    def forward(self, obs):
        T = obs.shape[1]
        h = self.ln(self.gpt(self.inp(obs) + self.pos[:, :T], mask=self.mask[:T, :T]))
        return self.bin_head(h), self.offset_head(h).view(*h.shape[:2], self.n_bins, self.act_dim)


def focal_loss(logits, target, gamma):
    logp = F.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return (-(1 - logp.exp()) ** gamma * logp).mean()


def bet_loss(model, obs, act, centers, args):
    logits, offsets = model(obs)
    bins = torch.cdist(act, centers.expand(act.shape[0], -1, -1)).argmin(-1)  # (B, T)
    residual = act - centers[bins]
    chosen = offsets.gather(2, bins[..., None, None].expand(-1, -1, 1, act.shape[-1])).squeeze(2)
    cls = focal_loss(logits.flatten(0, 1), bins.flatten(), args.gamma)
    off = F.mse_loss(chosen, residual)
    return cls + args.offset_weight * off, cls.detach(), off.detach()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    obs = np.load(os.path.join(args.data_dir, "multimodal_push_observations.npy")).astype(np.float32)
    act = np.load(os.path.join(args.data_dir, "multimodal_push_actions.npy")).astype(np.float32)
    masks = np.load(os.path.join(args.data_dir, "multimodal_push_masks.npy"))
    lengths = masks.sum(1).astype(int)

    perm = np.random.default_rng(args.seed).permutation(len(obs))
    n_val = max(1, int(args.val_frac * len(obs)))
    val_eps, train_eps = perm[:n_val], perm[n_val:]

    # action bins: fitted once on rank 0 over all valid training actions, then shared
    centers = torch.empty(args.n_bins, act.shape[-1], device=device)
    if rank == 0:
        flat = np.concatenate([act[e, : lengths[e]] for e in train_eps])
        km = KMeans(n_clusters=args.n_bins, n_init=10, random_state=args.seed).fit(flat)
        centers.copy_(torch.from_numpy(km.cluster_centers_.astype(np.float32)))
    dist.broadcast(centers, src=0)
    torch.manual_seed(args.seed + rank)

    train_set = WindowedEpisodes(obs, act, lengths, train_eps, args.window)
    val_set = WindowedEpisodes(obs, act, lengths, val_eps, args.window)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.global_batch // world, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=512, num_workers=2)

    net = BeT(obs.shape[-1], act.shape[-1], args.window, args.n_bins, args.n_layer, args.n_embd).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(centers.cpu(), os.path.join(args.out, "action_bins.pt"))
        print(f"train windows {len(train_set)}, val windows {len(val_set)}, {len(loader)} it/epoch per GPU")

    for epoch in range(args.epochs):
        model.train()
        t0, tr = time.time(), torch.zeros(3, device=device)
        for o, a in loader:
            o, a = o.to(device, non_blocking=True), a.to(device, non_blocking=True)
            loss, cls, off = bet_loss(model, o, a, centers, args)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tr += torch.stack([cls, off, torch.ones((), device=device)])

        net.eval()
        va = torch.zeros(3, device=device)
        with torch.no_grad():
            for o, a in val_loader:
                o, a = o.to(device), a.to(device)
                _, cls, off = bet_loss(net, o, a, centers, args)
                va += torch.stack([cls, off, torch.ones((), device=device)]) * torch.tensor([o.shape[0]] * 3, device=device)
        dist.all_reduce(tr)
        dist.all_reduce(va)
        if rank == 0:
            print(f"epoch {epoch}: train cls {tr[0] / tr[2]:.4f} off {tr[1] / tr[2]:.5f} | "
                  f"val cls {va[0] / va[2]:.4f} off {va[1] / va[2]:.5f} ({time.time() - t0:.1f}s)")
            if (epoch + 1) % 50 == 0:
                torch.save({"model": net.state_dict(), "centers": centers.cpu(), "opt": opt.state_dict(),
                            "epoch": epoch}, os.path.join(args.out, f"bet_epoch{epoch + 1}.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
