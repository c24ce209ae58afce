"""Active learning on EuroSAT (RGB) land-cover tiles with margin sampling.

The backbone is fine-tuned from ImageNet weights every round; the pool is scored
by all GPUs and the smallest-margin tiles are sent for labelling.

    torchrun --standalone --nproc_per_node=4 07_al_eurosat_margin.py --data /data/eurosat/2750 --out /shared/al/eurosat
"""
import argparse
import csv
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def get_args():
    parser = argparse.ArgumentParser(description="EuroSAT margin AL")
    parser.add_argument("--data", required=True, help="ImageFolder root (one folder per class)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--val-frac", type=float, default=0.2)
    parser.add_argument("--init", type=int, default=200)
    parser.add_argument("--step", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class Indexed(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x, y, i


def build_model(num_classes):
    m = torchvision.models.resnet50(weights=torchvision.models.ResNet50_Weights.IMAGENET1K_V2)
    m.fc = torch.nn.Linear(m.fc.in_features, num_classes)
    return m


@torch.no_grad()
def pool_margins(model, ds, pool, device, workers):
    sub = Subset(Indexed(ds), pool.tolist())
    loader = DataLoader(sub, batch_size=256, sampler=DistributedSampler(sub, shuffle=False),
                        num_workers=workers, pin_memory=True)
    model.eval()
    m_list, i_list = [], []
    for x, _, i in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x.to(device, non_blocking=True))
        p = logits.float().softmax(1).topk(2, dim=1).values
        m_list.append(p[:, 0] - p[:, 1])
        i_list.append(i.to(device))
    margins, idx = torch.cat(m_list), torch.cat(i_list)
    world = dist.get_world_size()
    out_m = [torch.empty_like(margins) for _ in range(world)]
    out_i = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(out_m, margins)
    dist.all_gather(out_i, idx)
    margins, idx = torch.cat(out_m).cpu().numpy(), torch.cat(out_i).cpu().numpy()
    idx, first = np.unique(idx, return_index=True)
    return idx, margins[first]


@torch.no_grad()
def val_accuracy(model, ds, val_idx, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    part = val_idx[rank::world]
    loader = DataLoader(Subset(ds, part.tolist()), batch_size=256, num_workers=4)
    model.eval()
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        y = y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(x.to(device)).argmax(1)
        hits += torch.tensor([(pred == y).sum().item(), y.numel()], dtype=torch.float64, device=device)
    dist.all_reduce(hits)
    return (hits[0] / hits[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    mean, std = [0.344, 0.380, 0.408], [0.203, 0.137, 0.116]
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    eval_tf = transforms.Compose([transforms.Resize(224), transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_ds = torchvision.datasets.ImageFolder(args.data, transform=train_tf)
    eval_ds = torchvision.datasets.ImageFolder(args.data, transform=eval_tf)
    n_cls = len(train_ds.classes)

    rs = np.random.RandomState(args.seed)
    order = rs.permutation(len(train_ds))
    n_val = int(args.val_frac * len(order))
    val_idx, pool_all = np.sort(order[:n_val]), order[n_val:]
    labelled = np.sort(pool_all[: args.init])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        log_f = open(os.path.join(args.out, "curve.csv"), "w", newline="")
        log_w = csv.writer(log_f)
        log_w.writerow(["round", "n_labelled", "val_acc", "seconds"])

    lr = args.lr * world
    for rnd in range(args.rounds):
        t_start = time.time()
        model = build_model(n_cls).to(device)
        model = DDP(model, device_ids=[local_rank])
        params = [{"params": [p for n, p in model.named_parameters() if not n.startswith("module.fc")], "lr": lr * 0.1},
                  {"params": model.module.fc.parameters(), "lr": lr}]
        opt = torch.optim.AdamW(params, weight_decay=0.05)
        train_loader = DataLoader(Subset(train_ds, labelled.tolist()), batch_size=args.batch_size,
                                  shuffle=True, num_workers=args.workers, pin_memory=True, drop_last=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[lr * 0.1, lr],
                                                    total_steps=args.epochs * len(train_loader))
        for epoch in range(args.epochs):
            model.train()
            for x, y in train_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()

        acc = val_accuracy(model.module, eval_ds, val_idx, device)

        unlabelled = np.setdiff1d(pool_all, labelled)
        idx, margins = pool_margins(model.module, eval_ds, unlabelled, device, args.workers)
        new = idx[np.argsort(margins)[: args.step]]
        labelled = np.union1d(labelled, new)

        if rank == 0:
            secs = time.time() - t_start
            log_w.writerow([rnd, len(labelled) - len(new), f"{acc:.4f}", f"{secs:.0f}"])
            log_f.flush()
            torch.save({"state_dict": model.module.state_dict(), "labelled": labelled.tolist(), "round": rnd},
                       os.path.join(args.out, f"round{rnd}.pt"))
            print(f"[round {rnd}] labelled={len(labelled) - len(new)} val_acc={acc:.4f} ({secs:.0f}s)", flush=True)
        dist.barrier()

    if rank == 0:
        log_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
