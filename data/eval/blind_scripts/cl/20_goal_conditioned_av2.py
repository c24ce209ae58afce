"""Goal-conditioned multi-modal forecaster (dense goal heatmap over lane points + trajectory completion),
Argoverse 2 motion forecasting, focal agent only.

    torchrun --nproc_per_node=8 20_goal_conditioned_av2.py --data_dir /ssd/av2_goal_cache --exp goalnet_v3
"""
import argparse
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.cuda.amp import GradScaler, autocast
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

OBS, PRED, K = 50, 60, 6


def get_args():
    parser = argparse.ArgumentParser(description="goal-conditioned forecaster")
    parser.add_argument("--data_dir", type=str, default="/ssd/av2_goal_cache")
    parser.add_argument("--log_dir", type=str, default="/ssd/experiments")
    parser.add_argument("--exp", type=str, default="goalnet")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=36)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--num_workers", type=int, default=8)
    parser.add_argument("--amp", action="store_true")
    return parser.parse_args()


class GoalCache(Dataset):
    def __init__(self, data_dir, split):
        with open(os.path.join(data_dir, f"{split}_index.pkl"), "rb") as f:
            self.index = pickle.load(f)
        self.data_dir = os.path.join(data_dir, split)

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        d = np.load(os.path.join(self.data_dir, self.index[i]))
        return {"focal": torch.from_numpy(d["focal_hist"]).float(),       # (50, 4) x y vx vy (focal frame)
                "nbrs": torch.from_numpy(d["nbr_hist"]).float(),          # (A, 50, 5) x y vx vy valid
                "goals": torch.from_numpy(d["lane_points"]).float(),      # (G, 4) x y dir_x dir_y, ~2 m spacing
                "fut": torch.from_numpy(d["focal_future"]).float()}       # (60, 2)


def collate(batch):
    A = max(max(b["nbrs"].shape[0] for b in batch), 1)
    G = max(b["goals"].shape[0] for b in batch)
    B = len(batch)
    out = {"focal": torch.stack([b["focal"] for b in batch]), "fut": torch.stack([b["fut"] for b in batch]),
           "nbrs": torch.zeros(B, A, OBS, 5), "goals": torch.zeros(B, G, 4),
           "gmask": torch.zeros(B, G, dtype=torch.bool)}
    for i, b in enumerate(batch):
        out["nbrs"][i, : b["nbrs"].shape[0]] = b["nbrs"]
        out["goals"][i, : b["goals"].shape[0]] = b["goals"]
        out["gmask"][i, : b["goals"].shape[0]] = True
    return out


class GoalNet(nn.Module):
    def __init__(self, h=128):
        super().__init__()
        self.focal_enc = nn.Sequential(nn.Conv1d(4, h, 3, padding=1), nn.GroupNorm(1, h), nn.ReLU(),
                                       nn.Conv1d(h, h, 3, stride=2, padding=1), nn.GroupNorm(1, h), nn.ReLU(),
                                       nn.AdaptiveMaxPool1d(1))
        self.nbr_enc = nn.GRU(5, h, batch_first=True)
        self.nbr_attn = nn.MultiheadAttention(h, 4, batch_first=True)
        self.goal_enc = nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, h))
        self.goal_score = nn.Sequential(nn.Linear(3 * h, h), nn.ReLU(), nn.Linear(h, 1))
        self.goal_refine = nn.Sequential(nn.Linear(3 * h, h), nn.ReLU(), nn.Linear(h, 2))
        self.completion = nn.Sequential(nn.Linear(2 * h + 2, 2 * h), nn.ReLU(), nn.Linear(2 * h, PRED * 2))

    def context(self, focal, nbrs):
        B, A = nbrs.shape[:2]
        f = self.focal_enc(focal.transpose(1, 2)).squeeze(-1)
        _, hn = self.nbr_enc(nbrs.flatten(0, 1))
        n = hn[-1].view(B, A, -1)
        kpm = nbrs[:, :, -1, 4] <= 0
        kpm[:, 0] = False
        c, _ = self.nbr_attn(f[:, None], n, n, key_padding_mask=kpm)
        return torch.cat([f, c.squeeze(1)], -1)

    def score_goals(self, ctx, goals, gmask):
        g = self.goal_enc(goals)
        x = torch.cat([ctx[:, None].expand(-1, g.shape[1], -1), g], -1)
        return self.goal_score(x).squeeze(-1).masked_fill(~gmask, -1e4), self.goal_refine(x)

    def complete(self, ctx, goal_xy):
        lead = goal_xy.shape[:-1]
        c = ctx.view(ctx.shape[0], *([1] * (goal_xy.dim() - 2)), -1).expand(*lead, -1)
        traj = self.completion(torch.cat([c, goal_xy], -1)).view(*lead, PRED, 2)
        return torch.cat([traj[..., :-1, :], goal_xy[..., None, :]], -2)

    def forward(self, focal, nbrs, goals, gmask, gt_goal):
        ctx = self.context(focal, nbrs)
        logits, offs = self.score_goals(ctx, goals, gmask)
        return logits, offs, self.complete(ctx, gt_goal)

    @torch.no_grad()
    def predict(self, focal, nbrs, goals, gmask, k=K, nms=2.0):
        ctx = self.context(focal, nbrs)
        logits, offs = self.score_goals(ctx, goals, gmask)
        cand = goals[..., :2] + offs
        order = logits.argsort(-1, descending=True)
        picks = []
        for b in range(goals.shape[0]):
            chosen = []
            for j in order[b].tolist():
                if not gmask[b, j]:
                    break
                if all(torch.norm(cand[b, j] - cand[b, c]) > nms for c in chosen):
                    chosen.append(j)
                if len(chosen) == k:
                    break
            chosen += [order[b, 0].item()] * (k - len(chosen))
            picks.append(cand[b, chosen])
        return self.complete(ctx, torch.stack(picks))  # (B, K, PRED, 2)


def goal_loss(logits, offs, traj, goals, fut):
    end = fut[:, -1]
    gt = torch.norm(goals[..., :2] - end[:, None], dim=-1).masked_fill(logits < -1e3, 1e6).argmin(-1)
    ar = torch.arange(len(gt), device=fut.device)
    cls = F.cross_entropy(logits, gt)
    off = F.smooth_l1_loss(offs[ar, gt], end - goals[ar, gt, :2])
    reg = F.smooth_l1_loss(traj, fut)
    return cls + off + reg


def main():
    args = get_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    log_dir = os.path.join(args.log_dir, args.exp)

    train_set, val_set = GoalCache(args.data_dir, "train"), GoalCache(args.data_dir, "val")
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=args.batch_size, collate_fn=collate, num_workers=args.num_workers)

    model = GoalNet(args.hidden).to(device)
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    lr = args.lr * world_size * args.batch_size / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[24, 32], gamma=0.1)
    scaler = GradScaler(enabled=args.amp)
    writer = SummaryWriter(log_dir) if rank == 0 else None

    best_fde, step = float("inf"), 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with autocast(enabled=args.amp):
                logits, offs, traj = model(batch["focal"], batch["nbrs"], batch["goals"], batch["gmask"],
                                           batch["fut"][:, -1])
            loss = goal_loss(logits.float(), offs.float(), traj.float(), batch["goals"], batch["fut"])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", l.item(), step)
        scheduler.step()

        model.module.eval()
        s = torch.zeros(4, device=device)
        for batch in val_loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            pred = model.module.predict(batch["focal"], batch["nbrs"], batch["goals"], batch["gmask"])
            err = torch.norm(pred - batch["fut"][:, None], dim=-1)
            fde = err[..., -1].min(-1).values
            s += torch.stack([err.mean(-1).min(-1).values.sum(), fde.sum(), (fde > 2).float().sum(),
                              torch.tensor(float(len(fde)), device=device)])
        dist.all_reduce(s)
        ade, fde, mr = (s[:3] / s[3]).tolist()
        if rank == 0:
            writer.add_scalar("val/minADE6", ade, epoch)
            writer.add_scalar("val/minFDE6", fde, epoch)
            writer.add_scalar("val/MR6", mr, epoch)
            print(f"epoch {epoch}: minADE6 {ade:.3f} minFDE6 {fde:.3f} MR6 {mr:.3f} ({time.time() - t0:.0f}s)",
                  flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(log_dir, "last.pth"))
            if fde < best_fde:
                torch.save(state, os.path.join(log_dir, "best.pth"))
        best_fde = min(best_fde, fde)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
