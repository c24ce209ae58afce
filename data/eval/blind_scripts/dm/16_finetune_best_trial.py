"""Continue the best trial of the HPO run with DDP on the full training set.

The search (``hpo_cars.py``) ran each Optuna trial on one GPU and saved, for
every completed trial, ``trials/trial_<n>.pt`` with the model and optimizer
state at the end of its budget.  Here the best trial is picked from
``study_summary.json``, its weights and AdamW state are restored on every
rank, and training continues with the trial's hyper-parameters on all GPUs
with a fresh cosine schedule.

    torchrun --nproc_per_node=8 continue_best.py --hpo-dir runs/hpo_cars --epochs 40
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--hpo-dir", default="runs/hpo_cars")
    p.add_argument("--data", default="/data/stanford_cars")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=2)
    return p.parse_args()


def best_trial(hpo_dir):
    with open(os.path.join(hpo_dir, "study_summary.json")) as f:
        summary = json.load(f)
    done = [t for t in summary["trials"] if t["state"] == "COMPLETE"]
    best = max(done, key=lambda t: t["value"])
    best["checkpoint"] = os.path.join(hpo_dir, "trials", f"trial_{best['number']}.pt")
    return best


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    model = model.module  # shards differ in length; no DDP hooks during eval
    c = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x).argmax(1)
        c[0] += (pred == y).sum()
        c[1] += y.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    out_dir = os.path.join(args.hpo_dir, "continued")

    trial = best_trial(args.hpo_dir)
    params = trial["params"]
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        print(f"continuing trial {trial['number']} (val acc {trial['value']:.4f}) {params}", flush=True)

    train_ds = ImageFolder(os.path.join(args.data, "train"),
                           create_transform(params["img_size"], is_training=True,
                                            auto_augment=params.get("auto_augment"),
                                            re_prob=params.get("re_prob", 0.0)))
    val_ds = ImageFolder(os.path.join(args.data, "test"),
                         create_transform(params["img_size"], is_training=False))
    per_gpu = args.global_batch // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=trial["number"])
    train_loader = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    # every rank scores a disjoint strided slice; no padded duplicates
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=128,
                            num_workers=args.workers, pin_memory=True)

    model = timm.create_model(params["arch"], pretrained=False, num_classes=len(train_ds.classes),
                              drop_rate=params["dropout"], drop_path_rate=params["drop_path"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"],
                                  weight_decay=params["weight_decay"])
    state = torch.load(trial["checkpoint"])
    model.load_state_dict(state["model"])
    model.to(device)
    optimizer.load_state_dict(state["optimizer"])
    del state

    model = DDP(model, device_ids=[local_rank])
    for g in optimizer.param_groups:
        g["lr"] = params["lr"]
        g["initial_lr"] = params["lr"]
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * len(train_loader), eta_min=params["lr"] * 0.01)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y, label_smoothing=params.get("smoothing", 0.1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_acc[0] += loss.detach().float()
            loss_acc[1] += 1
        dist.all_reduce(loss_acc)

        if (epoch + 1) % args.eval_every == 0 or epoch == args.epochs - 1:
            acc = evaluate(model, val_loader, device)
            if rank == 0:
                print(f"epoch {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                      f"acc {acc:.4f} ({time.time() - t0:.0f}s)", flush=True)
                if acc > best_acc:
                    best_acc = acc
                    torch.save({"model": model.module.state_dict(), "params": params,
                                "epoch": epoch, "acc": acc},
                               os.path.join(out_dir, "best_continued.pt"))

    if rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"trial": trial["number"], "search_acc": trial["value"],
                       "continued_acc": best_acc, "world_size": world}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
