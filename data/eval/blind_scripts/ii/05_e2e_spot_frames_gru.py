"""End-to-end precise event spotting (E2E-Spot style) on volleyball broadcast.

Long rally videos are cut into clips of `--clip-len` consecutive frames (decoded
JPEGs at 224p). A ConvNeXt-T frame encoder feeds a bidirectional GRU that
classifies every frame as background or one of the fine-grained events
(serve, receive, set, spike, block, score).

    torchrun --nproc_per_node=4 05_e2e_spot_frames_gru.py --frame-dir /data/vball/frames --labels /data/vball/labels.json
"""
import argparse
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms.v2 as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.io import read_image

EVENTS = ["serve", "receive", "set", "spike", "block", "score"]


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--frame-dir", type=Path, required=True)
    p.add_argument("--labels", type=Path, required=True)
    p.add_argument("--clip-len", type=int, default=64)
    p.add_argument("--stride", type=int, default=2, help="temporal subsampling of the 25 fps frames")
    p.add_argument("--batch-size", type=int, default=4, help="clips per GPU")
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3, help="lr for 8 clips; scaled linearly")
    p.add_argument("--fg-weight", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=Path("work_dirs/e2e_vball"))
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


class ClipDataset(Dataset):
    def __init__(self, frame_dir, videos, clip_len, stride, train):
        self.frame_dir = frame_dir
        self.clip_len, self.stride, self.train = clip_len, stride, train
        self.clips = []
        for v in videos:
            n = v["num_frames"] // stride
            labels = np.zeros(n, np.int64)
            for e in v["events"]:
                f = e["frame"] // stride
                if f < n:
                    labels[f] = EVENTS.index(e["label"]) + 1
            step = clip_len if not train else clip_len // 2
            for s in range(0, max(1, n - clip_len + 1), step):
                self.clips.append((v["video"], s, labels[s:s + clip_len]))
        self.aug = T.Compose([T.RandomResizedCrop(224, scale=(0.6, 1.0), antialias=True),
                              T.ColorJitter(0.2, 0.2, 0.2)]) if train else T.CenterCrop(224)
        self.norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])

    def __len__(self):
        return len(self.clips)

    def __getitem__(self, i):
        video, s, labels = self.clips[i]
        frames = [read_image(str(self.frame_dir / video / f"{(s + k) * self.stride:06d}.jpg"))
                  for k in range(len(labels))]
        x = torch.stack(frames).float() / 255.0          # T C H W
        x = self.norm(self.aug(x))                        # same crop for the whole clip
        y = torch.from_numpy(labels)
        if len(y) < self.clip_len:
            pad = self.clip_len - len(y)
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
            y = torch.cat([y, torch.full((pad,), -100, dtype=torch.long)])
        return x, y


class E2ESpot(nn.Module):
    def __init__(self, n_classes, hidden=512):
        super().__init__()
        self.encoder = timm.create_model("convnext_tiny.fb_in22k", pretrained=True, num_classes=0)
        self.gru = nn.GRU(self.encoder.num_features, hidden, num_layers=1, batch_first=True, bidirectional=True)
        self.fc = nn.Sequential(nn.Dropout(0.2), nn.Linear(2 * hidden, n_classes))

    def forward(self, x):                                 # B T C H W
        B, Tn = x.shape[:2]
        f = self.encoder(x.flatten(0, 1)).view(B, Tn, -1)
        h, _ = self.gru(f)
        return self.fc(h)                                 # B T n_classes


@torch.no_grad()
def evaluate(model, loader, device, tol=1):
    """Frame accuracy on foreground frames and a tolerance-based event F1."""
    model.eval()
    stats = torch.zeros(4, device=device)  # tp, n_pred, n_gt, fg_correct
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).argmax(-1)
        for p, g in zip(pred, y):
            valid = g >= 0
            p, g = p[valid], g[valid]
            pf, gf = torch.nonzero(p > 0).flatten(), torch.nonzero(g > 0).flatten()
            stats[1] += len(pf)
            stats[2] += len(gf)
            stats[3] += ((p == g) & (g > 0)).sum()
            for t in gf:
                lo, hi = max(0, t - tol), t + tol + 1
                if (p[lo:hi] == g[t]).any():
                    stats[0] += 1
    dist.all_reduce(stats)
    model.train()
    tp, n_pred, n_gt, fg = stats.tolist()
    prec, rec = tp / max(n_pred, 1), tp / max(n_gt, 1)
    return {"f1": 2 * prec * rec / max(prec + rec, 1e-8), "fg_acc": fg / max(n_gt, 1)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    meta = json.loads(args.labels.read_text())
    train_ds = ClipDataset(args.frame_dir, meta["train"], args.clip_len, args.stride, True)
    val_ds = ClipDataset(args.frame_dir, meta["val"], args.clip_len, args.stride, False)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True, prefetch_factor=4)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        args.batch_size, num_workers=args.workers, pin_memory=True)

    model = E2ESpot(len(EVENTS) + 1).to(device)
    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 8
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000) * 0.5 * (1 + math.cos(math.pi * s / total)))
    scaler = torch.cuda.amp.GradScaler()
    class_w = torch.tensor([1.0] + [args.fg_weight] * len(EVENTS), device=device)

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        print(f"train clips {len(train_ds)}  val clips {len(val_ds)}  lr {lr:.2e}")
    best_f1 = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # clips without any event carry no signal for the event classes
            if not (y > 0).any():
                continue
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), weight=class_w, ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model.module, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch} val F1@1 {metrics['f1']:.4f} fg-acc {metrics['fg_acc']:.4f}", flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                    "epoch": epoch, "metrics": metrics}
            torch.save(ckpt, args.out / "last.pt")
            if metrics["f1"] > best_f1:
                best_f1 = metrics["f1"]
                torch.save(ckpt, args.out / "best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
