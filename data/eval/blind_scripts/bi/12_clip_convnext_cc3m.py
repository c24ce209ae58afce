"""CLIP with a ConvNeXt-Base image tower on CC3M, holding out 1% of the pairs for validation.

    torchrun --nproc_per_node 8 12_clip_convnext_cc3m.py --csv /data/cc3m/cc3m_train.csv --root /data/cc3m
"""
import argparse
import math
import os
import random
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler

import open_clip


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--model", default="convnext_base_w")
    ap.add_argument("--val-fraction", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=192)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=3000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=3407)
    ap.add_argument("--out", default="/shared/runs/clip_convnext_cc3m")
    return ap.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CC3M(Dataset):
    def __init__(self, csv_path, root):
        df = pd.read_csv(csv_path, sep="\t")
        self.paths = df["filepath"].tolist()
        self.captions = df["title"].astype(str).tolist()
        self.root = root

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.paths[i])).convert("RGB")
        return img, self.captions[i]


class Transformed(Dataset):
    """Applies a split-specific image transform on top of a Subset."""

    def __init__(self, subset, transform, tokenizer):
        self.subset, self.transform, self.tokenizer = subset, transform, tokenizer

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, cap = self.subset[i]
        return self.transform(img), self.tokenizer([cap])[0]


def gather_with_local_grad(x):
    world, rank = dist.get_world_size(), dist.get_rank()
    out = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(out, x)
    out[rank] = x
    return torch.cat(out)


def clip_loss(img, txt, scale):
    all_img, all_txt = gather_with_local_grad(img), gather_with_local_grad(txt)
    logits = scale * all_img @ all_txt.t()
    labels = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    sums = torch.zeros(3, device=device)
    for images, texts in loader:
        images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            img, txt, scale = model(images, texts)
            loss = clip_loss(img.float(), txt.float(), scale.float())
        logits = img.float() @ txt.float().t()
        target = torch.arange(images.shape[0], device=device)
        sums[0] += loss * images.shape[0]
        sums[1] += (logits.argmax(1) == target).sum()
        sums[2] += images.shape[0]
    dist.all_reduce(sums)
    model.train()
    return {"val_loss": (sums[0] / sums[2]).item(), "val_batch_i2t_acc": (sums[1] / sums[2]).item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    # different augmentation streams on every rank
    seed_everything(args.seed + rank)

    model, train_tf, val_tf = open_clip.create_model_and_transforms(args.model)
    tokenizer = open_clip.get_tokenizer(args.model)
    model = DDP(model.to(device), device_ids=[local_rank])

    full = CC3M(args.csv, args.root)
    n_val = int(len(full) * args.val_fraction)
    train_sub, val_sub = random_split(full, [len(full) - n_val, n_val])
    train_set = Transformed(train_sub, train_tf, tokenizer)
    val_set = Transformed(val_sub, val_tf, tokenizer)

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "logit_scale" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or "logit_scale" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98), eps=1e-6)
    total = args.epochs * len(train_loader)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return 0.5 * args.lr * (1 + math.cos(math.pi * (step - args.warmup) / (total - args.warmup)))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"train {len(train_set)} / val {len(val_set)} pairs on {world} GPUs", flush=True)

    step, best = 0, float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (images, texts) in enumerate(train_loader):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            images, texts = images.to(device, non_blocking=True), texts.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                img, txt, scale = model(images, texts)
            loss = clip_loss(img.float(), txt.float(), scale.float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                model.module.logit_scale.clamp_(0, math.log(100))
            step += 1
            if rank == 0 and i % 100 == 0:
                print(f"epoch {epoch} {i}/{len(train_loader)} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        metrics = validate(model.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: {metrics}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, **metrics},
                       os.path.join(args.out, "last.pt"))
            if metrics["val_loss"] < best:
                best = metrics["val_loss"]
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
