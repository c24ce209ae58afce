"""Active learning with margin sampling and warm-started rounds.

Data: an ImageFolder tree (e.g. a 100-class subset of ImageNet) with train/ and
val/.  Each round fine-tunes the best model of the previous round on the grown
labelled set, keeps the best epoch by validation accuracy, then scores the
unlabelled pool (smallest top-1/top-2 margin first) across all GPUs.

    torchrun --nproc_per_node=8 al_margin_warmstart.py --data /mnt/datasets/imagenet100
"""
import argparse
import json
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work-dir", default="/mnt/exp/al_margin")
    p.add_argument("--arch", default="resnet50")
    p.add_argument("--init-frac", type=float, default=0.05)
    p.add_argument("--query-frac", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def transforms_for(train):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    return transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                               transforms.ToTensor(), norm])


@torch.no_grad()
def validate(net, loader, device):
    net.eval()
    s = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(x)
        s[0] += (out.argmax(1) == y).sum()
        s[1] += y.numel()
    dist.all_reduce(s)
    return (s[0] / s[1]).item()


@torch.no_grad()
def margin_scores(net, dataset, pool, device, world):
    """Returns (pool indices, margins) over the whole pool, on every rank."""
    subset = Subset(dataset, pool)
    sampler = DistributedSampler(subset, shuffle=False)
    loader = DataLoader(subset, batch_size=256, sampler=sampler, num_workers=8, pin_memory=True)
    pos = torch.tensor(list(sampler), device=device)
    net.eval()
    margins = []
    for x, _ in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = net(x.to(device, non_blocking=True)).float().softmax(1)
        top2 = p.topk(2, dim=1).values
        margins.append(top2[:, 0] - top2[:, 1])
    margins = torch.cat(margins)
    g_pos = [torch.empty_like(pos) for _ in range(world)]
    g_m = [torch.empty_like(margins) for _ in range(world)]
    dist.all_gather(g_pos, pos)
    dist.all_gather(g_m, margins)
    full = torch.full((len(pool),), float("inf"), device=device)
    full[torch.cat(g_pos)] = torch.cat(g_m)
    return full.cpu()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_aug = datasets.ImageFolder(os.path.join(args.data, "train"), transforms_for(True))
    train_plain = datasets.ImageFolder(os.path.join(args.data, "train"), transforms_for(False))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms_for(False))
    val_loader = DataLoader(val_set, batch_size=256, num_workers=args.workers,
                            sampler=DistributedSampler(val_set, shuffle=False), pin_memory=True)

    n = len(train_aug)
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(n)
    n_init, n_query = int(args.init_frac * n), int(args.query_frac * n)
    labeled = np.sort(perm[:n_init]).tolist()
    pool = np.sort(perm[n_init:]).tolist()

    if rank == 0:
        os.makedirs(args.work_dir, exist_ok=True)
        timm.create_model(args.arch, pretrained=True)  # fill the hub cache once
    dist.barrier()

    net = timm.create_model(args.arch, pretrained=True, num_classes=len(train_aug.classes))
    net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    log = []

    for rnd in range(args.rounds):
        best_path = os.path.join(args.work_dir, f"round{rnd}_best.pth")
        lab_set = Subset(train_aug, labeled)
        sampler = DistributedSampler(lab_set, shuffle=True, seed=args.seed + rnd)
        loader = DataLoader(lab_set, batch_size=args.batch_size, sampler=sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(loader))
        best_acc, t0 = -1.0, time.time()
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
            acc = validate(model.module, val_loader, device)
            if acc > best_acc:
                best_acc = acc
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "epoch": epoch,
                                "acc": acc, "labeled": labeled}, best_path)
            if rank == 0:
                print(f"r{rnd} ep{epoch} loss {loss.item():.3f} val {acc:.4f}", flush=True)
        dist.barrier()

        # continue from the best epoch of this round
        ckpt = torch.load(best_path)
        model.module.load_state_dict(ckpt["model"])
        del ckpt

        if rank == 0:
            log.append({"round": rnd, "n_labeled": len(labeled), "best_val": best_acc,
                        "minutes": (time.time() - t0) / 60})
            with open(os.path.join(args.work_dir, "log.json"), "w") as f:
                json.dump(log, f, indent=1)

        if rnd == args.rounds - 1:
            break
        margins = margin_scores(model.module, train_plain, pool, device, world)
        order = torch.argsort(margins)[:n_query].tolist()
        chosen = set(pool[i] for i in order)
        labeled = sorted(labeled + list(chosen))
        pool = [i for i in pool if i not in chosen]
        if rank == 0:
            print(f"round {rnd}: queried {len(chosen)}, labeled now {len(labeled)}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
