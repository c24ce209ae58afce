"""Fine-tuning sweep for EfficientNet-B0 (timm) on Oxford-IIIT Pets.

Each trial keeps its best-on-val weights in <out>/trial_XX/best.pt; after the
sweep the winning trial is reloaded and scored once on the test split.

    torchrun --standalone --nproc_per_node=4 13_pets_finetune_sweep.py --out /shared/sweeps/pets
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from timm.data import Mixup, resolve_data_config, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import OxfordIIITPet

SPACE = [
    dict(lr=5e-4, drop_rate=0.2, mixup=0.0, smoothing=0.1),
    dict(lr=1e-3, drop_rate=0.2, mixup=0.0, smoothing=0.1),
    dict(lr=1e-3, drop_rate=0.3, mixup=0.2, smoothing=0.1),
    dict(lr=2e-3, drop_rate=0.3, mixup=0.2, smoothing=0.1),
    dict(lr=2e-3, drop_rate=0.4, mixup=0.4, smoothing=0.0),
    dict(lr=4e-3, drop_rate=0.4, mixup=0.4, smoothing=0.0),
]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="/data/pets")
    p.add_argument("--out", default="/shared/sweeps/pets")
    p.add_argument("--arch", default="efficientnet_b0")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--bs", type=int, default=64, help="per-GPU batch size")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--val-frac", type=float, default=0.15)
    return p.parse_args()


def build_datasets(args, cfg):
    train_tf = create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    eval_tf = create_transform(**cfg, is_training=False)
    trainval_aug = OxfordIIITPet(args.root, split="trainval", transform=train_tf, download=False)
    trainval_plain = OxfordIIITPet(args.root, split="trainval", transform=eval_tf, download=False)
    test = OxfordIIITPet(args.root, split="test", transform=eval_tf, download=False)
    n = len(trainval_aug)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1234)).tolist()
    n_val = int(args.val_frac * n)
    return Subset(trainval_aug, perm[n_val:]), Subset(trainval_plain, perm[:n_val]), test


@torch.no_grad()
def accuracy(model, ds, device, rank, world, bs=128):
    model.eval()
    loader = DataLoader(Subset(ds, range(rank, len(ds), world)), bs, num_workers=4, pin_memory=True)
    c = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            c[0] += (model(x).argmax(-1) == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def train_one(tid, hp, args, sets, device, local_rank, rank, world):
    train_set, val_set, _ = sets
    trial_dir = os.path.join(args.out, f"trial_{tid:02d}")
    os.makedirs(trial_dir, exist_ok=True)
    model = timm.create_model(args.arch, pretrained=True, num_classes=37, drop_rate=hp["drop_rate"],
                              drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    sampler = DistributedSampler(train_set, shuffle=True, seed=tid, drop_last=True)
    loader = DataLoader(train_set, args.bs, sampler=sampler, num_workers=args.workers, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    mixup = Mixup(mixup_alpha=hp["mixup"], label_smoothing=hp["smoothing"], num_classes=37) if hp["mixup"] else None
    crit = SoftTargetCrossEntropy() if mixup else nn.CrossEntropyLoss(label_smoothing=hp["smoothing"])
    lr = hp["lr"] * args.bs * world / 256
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=args.epochs * len(loader), pct_start=0.1)

    best = -1.0
    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if mixup is not None:
                x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = crit(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc = accuracy(model, val_set, device, rank, world)
        if acc > best:
            best = acc
            torch.save({"epoch": epoch, "hp": hp, "val_acc": acc, "model": model.module.state_dict()},
                       os.path.join(trial_dir, "best.pt"))
        if rank == 0:
            print(f"  trial {tid} epoch {epoch}: val {acc:.4f} (best {best:.4f})", flush=True)
    del model, opt, loader
    torch.cuda.empty_cache()
    return best


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # rank 0 fetches the pretrained weights into the hub cache before the others ask for them
    probe = timm.create_model(args.arch, pretrained=(rank == 0))
    dist.barrier()
    cfg = resolve_data_config({}, model=probe)
    del probe
    sets = build_datasets(args, cfg)

    scores = {}
    for tid, hp in enumerate(SPACE):
        t0 = time.time()
        scores[tid] = train_one(tid, hp, args, sets, device, local_rank, rank, world)
        if rank == 0:
            print(f"trial {tid} {hp}: best val {scores[tid]:.4f} ({(time.time() - t0) / 60:.1f} min)", flush=True)

    dist.barrier()
    winner = max(scores, key=scores.get)
    ckpt = torch.load(os.path.join(args.out, f"trial_{winner:02d}", "best.pt"), map_location=device)
    model = timm.create_model(args.arch, pretrained=False, num_classes=37, drop_rate=ckpt["hp"]["drop_rate"]).to(device)
    model.load_state_dict(ckpt["model"])
    test_acc = accuracy(model, sets[2], device, rank, world)
    if rank == 0:
        summary = {"winner": winner, "hp": SPACE[winner], "val": scores[winner], "test": test_acc,
                   "all_val": scores}
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary, indent=2))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
