"""Tennis stroke classification from broadcast clips (MViTv2-S, Kinetics init).

Stroke segments come from annotations/strokes.csv (match_id, video, start, end,
player, stroke). Matches are split into train/val by match so that the same
players/court/broadcast never appear on both sides.

    torchrun --standalone --nproc_per_node=8 04_tennis_stroke_mvit.py --video-root /data/tennis/videos
"""
import argparse
import os
import random
import time
from collections import Counter

import decord
import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models.video import MViT_V2_S_Weights, mvit_v2_s

decord.bridge.set_bridge("torch")
STROKES = ["serve", "forehand", "backhand", "forehand_volley", "backhand_volley", "smash", "lob", "drop_shot"]


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--video-root", required=True)
    ap.add_argument("--ann", default="annotations/strokes.csv")
    ap.add_argument("--val-frac", type=float, default=0.15)
    ap.add_argument("--num-frames", type=int, default=16)
    ap.add_argument("--bs", type=int, default=8, help="clips per GPU")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1.6e-3, help="lr for global batch 512")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-dir", default="ckpt/tennis_mvit")
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def split_by_match(df, val_frac):
    matches = sorted(df.match_id.unique())
    random.shuffle(matches)
    n_val = max(1, int(len(matches) * val_frac))
    val = set(matches[:n_val])
    return df[~df.match_id.isin(val)].reset_index(drop=True), df[df.match_id.isin(val)].reset_index(drop=True)


class StrokeClips(Dataset):
    def __init__(self, df, video_root, num_frames, train):
        self.df = df
        self.root = video_root
        self.T = num_frames
        self.train = train
        w = MViT_V2_S_Weights.KINETICS400_V1
        self.mean = torch.tensor(w.transforms().mean).view(3, 1, 1, 1)
        self.std = torch.tensor(w.transforms().std).view(3, 1, 1, 1)

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        vr = decord.VideoReader(os.path.join(self.root, r.video), width=398, height=224, num_threads=1)
        start, end = int(r.start), min(int(r.end), len(vr) - 1)
        if self.train:
            jitter = max(1, (end - start) // 8)
            start = max(0, start + random.randint(-jitter, jitter))
            end = min(len(vr) - 1, end + random.randint(-jitter, jitter))
        idx = np.linspace(start, max(start, end), self.T).round().astype(int)
        frames = vr.get_batch(list(idx)).permute(3, 0, 1, 2).float() / 255.0  # C T H W
        if self.train:
            x0 = random.randint(0, frames.shape[-1] - 224)
            if random.random() < 0.5:
                frames = frames.flip(-1)
        else:
            x0 = (frames.shape[-1] - 224) // 2
        frames = frames[..., x0:x0 + 224]
        label = STROKES.index(r.stroke)
        return (frames - self.mean) / self.std, label


def build_model():
    m = mvit_v2_s(weights=MViT_V2_S_Weights.KINETICS400_V1)
    m.head[1] = nn.Linear(m.head[1].in_features, len(STROKES))
    return m


def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(len(STROKES), device=device)
    count = torch.zeros(len(STROKES), device=device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            pred = model(x).argmax(1)
            count += torch.bincount(y, minlength=len(STROKES)).float()
            correct += torch.bincount(y[pred == y], minlength=len(STROKES)).float()
    dist.all_reduce(correct)
    dist.all_reduce(count)
    model.train()
    per_class = correct / count.clamp(min=1)
    return (correct.sum() / count.sum()).item(), per_class[count > 0].mean().item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_everything(args.seed + rank)

    df = pd.read_csv(args.ann)
    train_df, val_df = split_by_match(df, args.val_frac)
    if rank == 0:
        print(f"{train_df.match_id.nunique()} train matches / {val_df.match_id.nunique()} val matches")
        print("train strokes:", dict(Counter(train_df.stroke)))

    train_ds = StrokeClips(train_df, args.video_root, args.num_frames, train=True)
    val_ds = StrokeClips(val_df, args.video_root, args.num_frames, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.bs, num_workers=8)

    model = build_model().to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.bs * world / 512
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or "pos" in n or "rel_pos" in n else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=lr)
    steps = len(train_dl)
    warm = args.warmup * steps
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.01, 1.0, total_iters=warm),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * steps - warm)], milestones=[warm])

    os.makedirs(args.ckpt_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"[{epoch}:{it}/{steps}] loss={loss.item():.3f} lr={sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)

        acc, mca = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: val acc {acc:.4f} mean class acc {mca:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "opt": opt.state_dict()},
                       os.path.join(args.ckpt_dir, "last.pth"))
            if mca > best:
                best = mca
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "best.pth"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
