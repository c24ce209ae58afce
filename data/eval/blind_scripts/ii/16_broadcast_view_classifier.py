"""Broadcast camera-view classification for soccer video (frame level).

Classes: main-camera wide, main-camera medium, close-up player, close-up
coach/bench, spectators, replay (slow motion), graphics/logo transition. The
wide/medium views are what the downstream player tracker and pitch
registration run on, so per-class recall on those two is what we watch.

Frames are sampled at 1 fps from the annotated matches; splits are per match.

    torchrun --nproc_per_node=4 16_broadcast_view_classifier.py --frames /data/views/frames --labels /data/views/labels.csv
"""
import argparse
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

VIEWS = ["main_wide", "main_medium", "closeup_player", "closeup_bench", "spectators", "replay", "graphics"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", required=True)
    ap.add_argument("--labels", required=True, help="csv: match_id,frame_file,view,split")
    ap.add_argument("--arch", default="convnext_small.fb_in22k_ft_in1k")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4, help="for a global batch of 256")
    ap.add_argument("--out", default="checkpoints/views")
    return ap.parse_args()


class ViewFrames(Dataset):
    def __init__(self, root, df, transform):
        self.root, self.df, self.tf = root, df.reset_index(drop=True), transform

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = Image.open(os.path.join(self.root, r.match_id, r.frame_file)).convert("RGB")
        return self.tf(img), VIEWS.index(r.view)


def build_model(arch, pretrained):
    return timm.create_model(arch, pretrained=pretrained, num_classes=len(VIEWS), drop_path_rate=0.2)


@torch.no_grad()
def confusion(model, loader, device):
    model.eval()
    cm = torch.zeros(len(VIEWS), len(VIEWS), device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        cm += torch.bincount(y * len(VIEWS) + pred, minlength=len(VIEWS) ** 2).view(len(VIEWS), len(VIEWS))
    dist.all_reduce(cm)
    return cm


def summarize(cm):
    recall = cm.diag().float() / cm.sum(1).clamp(min=1).float()
    acc = cm.diag().sum().item() / max(cm.sum().item(), 1)
    return acc, {v: round(recall[i].item(), 4) for i, v in enumerate(VIEWS)}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    model = build_model(args.arch, pretrained=True).to(device)
    cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**cfg, is_training=True, auto_augment="rand-m7-mstd0.5", re_prob=0.1)
    eval_tf = create_transform(**cfg, is_training=False)

    df = pd.read_csv(args.labels)
    shards = {}
    for split in ("train", "val", "test"):
        ds = ViewFrames(args.frames, df[df.split == split], train_tf if split == "train" else eval_tf)
        shards[split] = ds if split == "train" else torch.utils.data.Subset(ds, range(rank, len(ds), world))
    sampler = DistributedSampler(shards["train"], shuffle=True)
    train_dl = DataLoader(shards["train"], batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(shards["val"], batch_size=2 * args.batch_size, num_workers=8, pin_memory=True)
    test_dl = DataLoader(shards["test"], batch_size=2 * args.batch_size, num_workers=8, pin_memory=True)

    model = DDP(model, device_ids=[local_rank])
    lr = args.lr * args.batch_size * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=args.epochs * len(train_dl),
                                                pct_start=0.1, anneal_strategy="cos")
    best_path = os.path.join(args.out, "best.pth")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(shards['train'])} frames, lr {lr:.2e}", flush=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        acc, recall = summarize(confusion(model.module, val_dl, device))
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) val acc {acc:.4f} recall {recall}", flush=True)
            if acc > best_acc:
                torch.save(model.state_dict(), best_path)
        best_acc = max(best_acc, acc)
        dist.barrier()

    # final test with the best weights
    best = build_model(args.arch, pretrained=False).to(device)
    best.load_state_dict(torch.load(best_path, map_location=device))
    acc, recall = summarize(confusion(best, test_dl, device))
    if rank == 0:
        print(f"TEST acc {acc:.4f} recall {recall}", flush=True)
        pd.Series(recall).to_json(os.path.join(args.out, "test_recall.json"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
