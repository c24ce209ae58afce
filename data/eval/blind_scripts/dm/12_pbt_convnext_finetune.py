"""PBT fine-tuning of a pretrained ConvNeXt-T on an image-folder dataset.

One population member per GPU; members differ in lr, weight
decay, mixup strength and EMA decay.  Every ``--ready`` epochs: rank the
members by held-out accuracy, bottom 25% copy a top-25% member and perturb.

    torchrun --nproc_per_node=8 pbt_finetune.py --data /data/plantvillage --epochs 30
"""
import argparse
import copy
import json
import logging
import os
import random

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import resolve_data_config, create_transform
from torch.utils.data import DataLoader, random_split
from torchvision.datasets import ImageFolder

log = logging.getLogger("pbt")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--arch", default="convnext_tiny.fb_in22k")
    p.add_argument("--out", default="runs/pbt_finetune")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--ready", type=int, default=3)
    p.add_argument("--val-frac", type=float, default=0.15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class TransformSubset(torch.utils.data.Dataset):
    def __init__(self, subset, transform):
        self.subset, self.transform = subset, transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, y = self.subset[i]
        return self.transform(img), y


@torch.no_grad()
def ema_update(ema, model, decay):
    for e, p in zip(ema.state_dict().values(), model.state_dict().values()):
        if e.dtype.is_floating_point:
            e.mul_(decay).add_(p.detach(), alpha=1 - decay)
        else:
            e.copy_(p)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    hit = tot = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hit += (model(x).argmax(1) == y).sum().item()
        tot += y.numel()
    return hit / tot


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s m{rank} %(message)s")

    # different seed per member: different init of the new head, different
    # augmentation stream, different initial hyper-parameters
    seed_everything(args.seed * 1000 + rank)
    hp = {"lr": float(10 ** np.random.uniform(-4.5, -3)),
          "weight_decay": float(10 ** np.random.uniform(-3, -1)),
          "mixup": float(np.random.choice([0.0, 0.2, 0.4, 0.8])),
          "ema": float(np.random.choice([0.999, 0.9995, 0.9998]))}

    full = ImageFolder(args.data)
    n_val = int(len(full) * args.val_frac)
    train_sub, val_sub = random_split(full, [len(full) - n_val, n_val])

    if rank == 0:
        timm.create_model(args.arch, pretrained=True)  # populate the HF cache once
    dist.barrier()
    model = timm.create_model(args.arch, pretrained=True, num_classes=len(full.classes)).to(device)
    ema = copy.deepcopy(model).eval()
    cfg = resolve_data_config({}, model=model)
    train_ds = TransformSubset(train_sub, create_transform(**cfg, is_training=True,
                                                           auto_augment="rand-m7-mstd0.5"))
    val_ds = TransformSubset(val_sub, create_transform(**cfg, is_training=False))
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, num_workers=8, pin_memory=True)

    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    ck_dir = os.path.join(args.out, "members")
    os.makedirs(ck_dir, exist_ok=True)

    history = []
    for epoch in range(1, args.epochs + 1):
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            y1h = F.one_hot(y, len(full.classes)).float()
            if hp["mixup"] > 0:
                lam = float(np.random.beta(hp["mixup"], hp["mixup"]))
                perm = torch.randperm(x.size(0), device=device)
                x = lam * x + (1 - lam) * x[perm]
                y1h = lam * y1h + (1 - lam) * y1h[perm]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.sum(-y1h * F.log_softmax(model(x).float(), dim=-1), dim=-1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema_update(ema, model, hp["ema"])

        acc = evaluate(ema, val_loader, device)
        history.append({"epoch": epoch, "acc": acc, **hp})
        log.info("epoch %d ema-acc %.4f %s", epoch, acc, hp)

        if epoch % args.ready or epoch == args.epochs:
            continue
        accs = [None] * world
        dist.all_gather_object(accs, acc)
        order = sorted(range(world), key=lambda r: (-accs[r], r))
        q = max(1, world // 4)
        top, bottom = order[:q], order[-q:]
        if rank in top:
            torch.save({"model": model.state_dict(), "ema": ema.state_dict(),
                        "opt": opt.state_dict(), "hp": hp}, os.path.join(ck_dir, f"{rank}.pt"))
        dist.barrier()
        if rank in bottom:
            donor = random.choice(top)
            sd = torch.load(os.path.join(ck_dir, f"{donor}.pt"), map_location=device)
            model.load_state_dict(sd["model"])
            ema.load_state_dict(sd["ema"])
            opt.load_state_dict(sd["opt"])
            hp = dict(sd["hp"])
            hp["lr"] *= random.choice([0.8, 1.25])
            hp["weight_decay"] *= random.choice([0.8, 1.25])
            hp["mixup"] = random.choice([0.0, 0.2, 0.4, 0.8])
            for g in opt.param_groups:
                g["lr"], g["weight_decay"] = hp["lr"], hp["weight_decay"]
            log.info("exploit: copied member %d (acc %.4f)", donor, accs[donor])
        dist.barrier()

    finals = [None] * world
    dist.all_gather_object(finals, {"member": rank, "acc": acc, "hp": hp})
    best = max(finals, key=lambda d: d["acc"])
    if rank == best["member"]:
        torch.save({"ema": ema.state_dict(), "hp": hp, "classes": full.classes,
                    "history": history}, os.path.join(args.out, "best.pt"))
    if rank == 0:
        with open(os.path.join(args.out, "leaderboard.json"), "w") as f:
            json.dump(sorted(finals, key=lambda d: -d["acc"]), f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
