"""Ice-hockey event recognition + team attribution from broadcast clips.

Single-node trainer started with `python 06_hockey_event_r2plus1d_spawn.py ...`;
it spawns one worker per visible GPU. R(2+1)D-18 (Kinetics-400 init) with two
heads: the event type and which team (home/away) it belongs to. Team labels
are missing for some events (e.g. stoppages) and are ignored in the loss.
"""
import argparse
import csv
import os
import socket
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.io import read_video
from torchvision.models.video import R2Plus1D_18_Weights, r2plus1d_18

EVENTS = ["faceoff", "shot", "goal", "hit", "penalty", "icing", "offside", "save"]
TEAM = {"home": 0, "away": 1}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--clips-csv", type=Path, required=True, help="clip_path,split,event,team")
    p.add_argument("--out", type=Path, default=Path("out/hockey_r2p1d"))
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8, help="per GPU")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=0.01, help="SGD lr for a global batch of 64")
    p.add_argument("--team-loss-weight", type=float, default=0.5)
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--resume", type=Path, default=None)
    return p.parse_args()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class HockeyClips(Dataset):
    mean = torch.tensor([0.43216, 0.394666, 0.37645]).view(3, 1, 1, 1)
    std = torch.tensor([0.22803, 0.22145, 0.216989]).view(3, 1, 1, 1)

    def __init__(self, rows, frames, train):
        self.rows, self.frames, self.train = rows, frames, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        video, _, _ = read_video(r["clip_path"], pts_unit="sec", output_format="TCHW")
        n = video.shape[0]
        if self.train:
            start = np.random.randint(0, max(1, n - 2 * self.frames))
            idx = np.arange(start, start + 2 * self.frames, 2).clip(max=n - 1)
        else:
            idx = np.linspace(0, n - 1, self.frames).round().astype(int)
        x = video[idx].float().div(255)
        x = F.interpolate(x, size=(128, 228), mode="bilinear", align_corners=False)
        if self.train:
            off = np.random.randint(0, 228 - 112 + 1)
            top = np.random.randint(0, 128 - 112 + 1)
        else:
            off, top = (228 - 112) // 2, (128 - 112) // 2
        x = x[..., top:top + 112, off:off + 112].permute(1, 0, 2, 3)  # C T H W
        x = (x - self.mean) / self.std
        team = TEAM.get(r["team"], -100)
        return x, EVENTS.index(r["event"]), team


class EventTeamNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = r2plus1d_18(weights=R2Plus1D_18_Weights.KINETICS400_V1)
        dim = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.event_head = nn.Linear(dim, len(EVENTS))
        self.team_head = nn.Linear(dim, 2)

    def forward(self, x):
        f = self.backbone(x)
        return self.event_head(f), self.team_head(f)


def load_rows(csv_path):
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if r["split"] == "train"], [r for r in rows if r["split"] == "val"]


def worker(gpu, world_size, port, args):
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=gpu)
    device = torch.device("cuda", gpu)
    is_main = gpu == 0

    train_rows, val_rows = load_rows(args.clips_csv)
    train_ds, val_ds = HockeyClips(train_rows, args.frames, True), HockeyClips(val_rows, args.frames, False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=gpu, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, list(range(gpu, len(val_ds), world_size))),
                        batch_size=args.batch_size, num_workers=args.workers)

    model = EventTeamNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DDP(model, device_ids=[gpu], output_device=gpu)

    lr = args.lr * args.batch_size * world_size / 64
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(args.epochs * 0.6), int(args.epochs * 0.85)])
    start_epoch = 0
    if args.resume is not None:
        state = torch.load(args.resume, map_location={"cuda:0": f"cuda:{gpu}"})
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1

    if is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"{world_size} GPUs, {len(train_ds)} train / {len(val_ds)} val clips, lr={lr}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for x, ev, team in train_dl:
            x, ev, team = x.to(device, non_blocking=True), ev.to(device), team.to(device)
            ev_logits, team_logits = model(x)
            loss = F.cross_entropy(ev_logits, ev)
            if (team >= 0).any():
                loss = loss + args.team_loss_weight * F.cross_entropy(team_logits, team, ignore_index=-100)
            else:
                loss = loss + 0.0 * team_logits.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach() * x.size(0), torch.tensor(float(x.size(0)), device=device)])
        sched.step()
        dist.all_reduce(running)

        # validation on the unwrapped model; SyncBN uses running stats in eval mode
        model.eval()
        conf = torch.zeros(len(EVENTS), len(EVENTS), device=device)
        team_hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, ev, team in val_dl:
                x, ev, team = x.to(device), ev.to(device), team.to(device)
                ev_logits, team_logits = model.module(x)
                conf.index_put_((ev, ev_logits.argmax(1)), torch.ones_like(ev, dtype=conf.dtype), accumulate=True)
                m = team >= 0
                team_hits += torch.stack([(team_logits.argmax(1)[m] == team[m]).sum().float(), m.sum().float()])
        dist.all_reduce(conf)
        dist.all_reduce(team_hits)
        if is_main:
            acc = (conf.diag().sum() / conf.sum()).item()
            recall = (conf.diag() / conf.sum(1).clamp(min=1)).mean().item()
            t_acc = (team_hits[0] / team_hits[1].clamp(min=1)).item()
            print(f"epoch {epoch}: loss {(running[0] / running[1]).item():.4f} | event acc {acc:.4f} "
                  f"mean recall {recall:.4f} | team acc {t_acc:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, args.out / f"epoch_{epoch:03d}.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    n_gpus = torch.cuda.device_count()
    port = free_port()
    mp.spawn(worker, args=(n_gpus, port, args), nprocs=n_gpus, join=True)
