#!/usr/bin/env python3
"""
Food-101-ish fine-grained classifier on 2 nodes, EMA snapshots every epoch, then a greedy
model soup over the snapshots (Wortsman et al. 2022) scored on the held-out fold.

node 0:  torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \
            --rdzv_endpoint=gpu-node-01:29400 --rdzv_id=soup42 18_multinode_soup.py --fold 0
node 1:  same with --node_rank=1
"""
import os
import json
import time
import argparse

import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from PIL import Image
import timm
from timm.data import create_transform
from timm.utils import ModelEmaV3


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--csv", default="/nfs/food/train_folds.csv")
    p.add_argument("--img_dir", default="/nfs/food/images")
    p.add_argument("--fold", type=int, default=0)
    p.add_argument("--model", default="eva02_base_patch14_224.mim_in22k")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--bs", type=int, default=48)
    p.add_argument("--base_lr", type=float, default=5e-4, help="for a global batch of 512")
    p.add_argument("--ema_decay", type=float, default=0.9998)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="/nfs/exp/food_soup")
    return p.parse_args()


class FoodDS(Dataset):
    def __init__(self, df, img_dir, tfm):
        self.files = df.path.values
        self.y = df.label.values
        self.img_dir = img_dir
        self.tfm = tfm

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.img_dir, self.files[i])).convert("RGB")
        return self.tfm(img), int(self.y[i]), i


@torch.no_grad()
def accuracy_dist(net, loader, n_total, device):
    """top-1 over the whole validation fold; padded duplicates from the sampler are masked out"""
    net.eval()
    correct = torch.zeros(n_total, device=device)
    seen = torch.zeros(n_total, device=device)
    for x, y, i in loader:
        x, y, i = x.to(device, non_blocking=True), y.to(device), i.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(x).argmax(1)
        correct[i] = (pred == y).float()
        seen[i] = 1.0
    dist.all_reduce(correct, op=dist.ReduceOp.MAX)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return (correct.sum() / seen.sum()).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3407)
    ckpt_dir = os.path.join(args.out, f"fold{args.fold}")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    df = pd.read_csv(args.csv)
    n_classes = int(df.label.max()) + 1
    tr, va = df[df.fold != args.fold], df[df.fold == args.fold]
    ds_tr = FoodDS(tr, args.img_dir, create_transform(224, is_training=True,
                                                      auto_augment="rand-m9-mstd0.5-inc1"))
    ds_va = FoodDS(va, args.img_dir, create_transform(224, is_training=False))
    s_tr = DistributedSampler(ds_tr, shuffle=True, drop_last=True)
    s_va = DistributedSampler(ds_va, shuffle=False)
    dl_tr = DataLoader(ds_tr, args.bs, sampler=s_tr, num_workers=args.workers, pin_memory=True,
                       drop_last=True, persistent_workers=True)
    dl_va = DataLoader(ds_va, args.bs * 2, sampler=s_va, num_workers=args.workers, pin_memory=True)

    model = timm.create_model(args.model, pretrained=True, num_classes=n_classes,
                              drop_path_rate=0.1).to(device)
    ema = ModelEmaV3(model, decay=args.ema_decay)
    model = DDP(model, device_ids=[local_rank])

    global_bs = args.bs * world
    lr = args.base_lr * global_bs / 512
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = args.epochs * len(dl_tr)
    warm = len(dl_tr)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=warm),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - warm, eta_min=lr * 0.01),
    ], milestones=[warm])
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    if rank == 0:
        print(f"world {world}, global batch {global_bs}, lr {lr:.2e}, {len(dl_tr)} it/epoch")

    history = []
    for ep in range(args.epochs):
        s_tr.set_epoch(ep)
        model.train()
        t0 = time.time()
        for x, y, _ in dl_tr:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            ema.update(model.module)
        acc = accuracy_dist(ema.module, dl_va, len(ds_va), device)
        if rank == 0:
            path = os.path.join(ckpt_dir, f"ema_ep{ep:02d}.pth")
            torch.save(ema.module.state_dict(), path)
            history.append({"epoch": ep, "acc": acc, "path": path})
            print(f"ep {ep} ema acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
            pd.DataFrame(history).to_csv(os.path.join(ckpt_dir, "history.csv"), index=False)
        dist.barrier()

    # ---------------- greedy soup ----------------
    hist = [None]
    if rank == 0:
        hist[0] = sorted(history, key=lambda r: -r["acc"])
    dist.broadcast_object_list(hist, src=0)
    ranked = hist[0]

    soup_net = ema.module
    load = lambda p: torch.load(p, map_location="cpu")
    ingredients = [ranked[0]["path"]]
    soup = load(ranked[0]["path"])
    best_acc = ranked[0]["acc"]
    for cand in ranked[1:]:
        sd = load(cand["path"])
        n = len(ingredients)
        trial = {k: (v * n + sd[k]) / (n + 1) if v.is_floating_point() else v
                 for k, v in soup.items()}
        soup_net.load_state_dict(trial)
        acc = accuracy_dist(soup_net, dl_va, len(ds_va), device)
        if acc >= best_acc:
            soup, best_acc = trial, acc
            ingredients.append(cand["path"])
        if rank == 0:
            print(f"soup try {os.path.basename(cand['path'])}: {acc:.4f} "
                  f"(best {best_acc:.4f}, {len(ingredients)} in soup)", flush=True)

    if rank == 0:
        torch.save(soup, os.path.join(ckpt_dir, "greedy_soup.pth"))
        with open(os.path.join(ckpt_dir, "soup.json"), "w") as f:
            json.dump({"ingredients": ingredients, "acc": best_acc}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
