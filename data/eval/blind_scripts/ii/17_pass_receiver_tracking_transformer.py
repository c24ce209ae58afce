"""Pass-receiver prediction from broadcast-derived tracking data.

Input: for the 2 s before a pass, the pitch coordinates of up to 22 players and
the ball (from the broadcast tracking + homography pipeline), plus team side
and whether each player is visible in the broadcast frame. A set transformer
encodes every agent trajectory; heads predict
  * the receiver (pointer over the players of the passer's team)
  * the team that controls the ball 2 s later (team-level head: passer's team / opponent)

    torchrun --nproc_per_node=4 17_pass_receiver_tracking_transformer.py --data /data/tracking/passes.h5
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

PITCH = np.array([105.0, 68.0], np.float32)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--hist", type=int, default=20, help="timesteps of history (10 Hz)")
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=4e-4, help="for a global batch of 1024")
    p.add_argument("--ckpt", default="ckpt/pass_receiver.pt")
    return p.parse_args()


class Passes(Dataset):
    """h5 groups train/val: traj (N, 23, H, 2), team (N, 23), visible (N, 23, H), passer (N,),
    receiver (N,), possession_after (N,) [1 = passer's team keeps the ball]"""

    def __init__(self, path, split, hist, augment):
        with h5py.File(path, "r") as f:
            g = f[split]
            self.traj = g["traj"][:, :, -hist:].astype(np.float32)
            self.team = g["team"][:].astype(np.int64)
            self.vis = g["visible"][:, :, -hist:].astype(np.float32)
            self.passer = g["passer"][:].astype(np.int64)
            self.receiver = g["receiver"][:].astype(np.int64)
            self.poss = g["possession_after"][:].astype(np.int64)
        self.augment = augment

    def __len__(self):
        return len(self.passer)

    def __getitem__(self, i):
        traj = self.traj[i].copy()
        if self.augment:
            if np.random.rand() < 0.5:                     # mirror along the long axis
                traj[..., 1] = PITCH[1] - traj[..., 1]
            traj += np.random.normal(0, 0.15, traj.shape).astype(np.float32)
        traj = traj / PITCH - 0.5
        vel = np.diff(traj, axis=1, prepend=traj[:, :1])
        passer = self.passer[i]
        same_team = (self.team[i] == self.team[i, passer]).astype(np.float32)
        feat = np.concatenate([traj, vel * 10, self.vis[i][..., None]], -1)      # (23, H, 5)
        return (torch.from_numpy(feat), torch.from_numpy(same_team), torch.tensor(passer),
                torch.tensor(self.receiver[i]), torch.tensor(self.poss[i]))


class SetTransformer(nn.Module):
    def __init__(self, hist, dim, layers):
        super().__init__()
        self.traj_enc = nn.Sequential(nn.Linear(hist * 5, dim), nn.GELU(), nn.Linear(dim, dim))
        self.role = nn.Embedding(4, dim)   # (same team, is passer) combinations
        layer = nn.TransformerEncoderLayer(dim, 6, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.receiver_head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 1))
        self.team_head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 2))

    def forward(self, feat, same_team, passer):
        B, A = feat.shape[:2]
        h = self.traj_enc(feat.flatten(2))
        is_passer = F.one_hot(passer, A).float()
        h = h + self.role((same_team * 2 + is_passer).long())
        h = self.encoder(h)
        recv_logits = self.receiver_head(h).squeeze(-1)
        # only team-mates (excluding the passer) can be receivers; index 22 is the ball
        valid = (same_team > 0) & (is_passer == 0)
        valid[:, -1] = False
        recv_logits = recv_logits.masked_fill(~valid, -1e4)
        team_logits = self.team_head(h.mean(1))
        return recv_logits, team_logits


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    top1 = top3 = team_ok = n = 0
    nll = 0.0
    for feat, same_team, passer, receiver, poss in loader:
        feat, same_team, passer = feat.to(device), same_team.to(device), passer.to(device)
        receiver, poss = receiver.to(device), poss.to(device)
        recv_logits, team_logits = model(feat, same_team, passer)
        nll += F.cross_entropy(recv_logits, receiver, reduction="sum").item()
        top = recv_logits.topk(3, dim=1).indices
        top1 += (top[:, 0] == receiver).sum().item()
        top3 += (top == receiver[:, None]).any(1).sum().item()
        team_ok += (team_logits.argmax(1) == poss).sum().item()
        n += len(receiver)
    stats = torch.tensor([top1, top3, team_ok, nll, n], dtype=torch.float64)
    dist.all_reduce(stats)
    model.train()
    top1, top3, team_ok, nll, n = stats.tolist()
    return {"top1": top1 / n, "top3": top3 / n, "team_acc": team_ok / n, "nll": nll / n}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_ds = Passes(args.data, "train", args.hist, augment=True)
    val_ds = Passes(args.data, "val", args.hist, augment=False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=1024, num_workers=2)

    model = DDP(SetTransformer(args.hist, args.dim, args.layers).to(device), device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 1024
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / 500) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))

    if rank == 0:
        os.makedirs(os.path.dirname(args.ckpt) or ".", exist_ok=True)
        print(f"{len(train_ds)} train / {len(val_ds)} val passes, lr {lr:.2e}", flush=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for feat, same_team, passer, receiver, poss in train_dl:
            feat, same_team, passer = feat.to(device, non_blocking=True), same_team.to(device), passer.to(device)
            receiver, poss = receiver.to(device), poss.to(device)
            recv_logits, team_logits = model(feat, same_team, passer)
            loss = F.cross_entropy(recv_logits, receiver) + 0.5 * F.cross_entropy(team_logits, poss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()

        m = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): top1 {m['top1']:.4f} top3 {m['top3']:.4f} "
                  f"team {m['team_acc']:.4f} nll {m['nll']:.4f}", flush=True)
            if m["top1"] > best:
                best = m["top1"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "metrics": m, "args": vars(args)},
                           args.ckpt)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
