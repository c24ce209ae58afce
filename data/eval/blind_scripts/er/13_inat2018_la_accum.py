"""iNaturalist 2018, ResNet-152 with logit-adjusted loss and gradient accumulation.

The high-resolution recipe does not fit a large per-GPU batch, so gradients are
accumulated over `--accum` micro-batches; DDP's all-reduce only runs on the last one.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        inat2018_la_accum.py --root /shared/inat2018 --out /shared/exp/inat18_r152_la
"""
import argparse
import contextlib
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True, help="must be on storage shared by all nodes")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--micro-batch", type=int, default=16, help="per GPU, per forward")
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.1, help="at an effective batch of 256")
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--img-size", type=int, default=448)
    ap.add_argument("--workers", type=int, default=10)
    return ap.parse_args()


class INat2018(Dataset):
    def __init__(self, root, split, transform, return_index=False):
        with open(os.path.join(root, f"{split}2018.json")) as f:
            js = json.load(f)
        y_of = {a["image_id"]: a["category_id"] for a in js["annotations"]}
        self.files = [im["file_name"] for im in js["images"]]
        self.targets = np.array([y_of[im["id"]] for im in js["images"]], dtype=np.int64)
        self.num_classes = len(js["categories"])
        self.root, self.transform, self.return_index = root, transform, return_index

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = self.transform(Image.open(os.path.join(self.root, self.files[i])).convert("RGB"))
        return (x, int(self.targets[i]), i) if self.return_index else (x, int(self.targets[i]))


@torch.no_grad()
def evaluate(net, loader, n_val, train_counts, device):
    """Gather (index, pred, target) from every rank and drop DistributedSampler's padded duplicates."""
    net.eval()
    idx_l, pred_l, tgt_l = [], [], []
    for x, y, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(x.to(device, non_blocking=True))
        pred_l.append(logits.argmax(1))
        tgt_l.append(y.to(device))
        idx_l.append(idx.to(device))
    local = torch.stack([torch.cat(idx_l), torch.cat(pred_l), torch.cat(tgt_l)])
    gathered = torch.empty((dist.get_world_size(),) + local.shape, dtype=local.dtype, device=device)
    dist.all_gather_into_tensor(gathered, local)
    allv = gathered.permute(1, 0, 2).reshape(3, -1)
    order = torch.argsort(allv[0], stable=True)
    allv = allv[:, order]
    keep = torch.ones(allv.shape[1], dtype=torch.bool, device=device)
    keep[1:] = allv[0, 1:] != allv[0, :-1]
    allv = allv[:, keep]
    assert allv.shape[1] == n_val
    pred, tgt = allv[1], allv[2]
    C = len(train_counts)
    correct = torch.bincount(tgt, weights=(pred == tgt).float(), minlength=C)
    total = torch.bincount(tgt, minlength=C).float()
    acc = (correct / total.clamp(min=1)).cpu().numpy()
    valid = total.cpu().numpy() > 0
    return {"top1": correct.sum().item() / n_val,
            "many": acc[valid & (train_counts > 100)].mean(),
            "medium": acc[valid & (train_counts >= 20) & (train_counts <= 100)].mean(),
            "few": acc[valid & (train_counts < 20)].mean()}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    norm = T.Normalize([0.466, 0.471, 0.380], [0.195, 0.194, 0.192])
    train_set = INat2018(args.root, "train", T.Compose([
        T.RandomResizedCrop(args.img_size), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    val_set = INat2018(args.root, "val", T.Compose([
        T.Resize(int(args.img_size / 0.875)), T.CenterCrop(args.img_size), T.ToTensor(), norm]),
        return_index=True)
    # every rank parses the same train json -> identical counts and prior on all ranks
    train_counts = np.bincount(train_set.targets, minlength=train_set.num_classes)
    log_prior = torch.log(torch.tensor(train_counts / train_counts.sum(), dtype=torch.float32, device=device))

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.micro_batch, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler, num_workers=args.workers, pin_memory=True)

    weights = torchvision.models.ResNet152_Weights.IMAGENET1K_V2
    if local_rank == 0:
        weights.get_state_dict(progress=False)  # fill this node's torch hub cache once
    dist.barrier()
    model = torchvision.models.resnet152(weights=weights)
    model.fc = nn.Linear(model.fc.in_features, train_set.num_classes)
    model = DDP(model.to(device), device_ids=[local_rank])

    eff_batch = args.micro_batch * args.accum * world
    lr = args.lr * eff_batch / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd)
    steps_per_epoch = len(train_loader) // args.accum
    total_steps = args.epochs * steps_per_epoch
    warmup = 2 * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / total_steps)))

    ckpt_path = os.path.join(args.out, "last.pth")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
        # the schedule counts optimizer steps; it only lines up if the effective batch is unchanged
        assert ck["eff_batch"] == eff_batch, (ck["eff_batch"], eff_batch)
        if rank == 0:
            print(f"resuming from epoch {start_epoch} (saved with {ck['world']} ranks, now {world})")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(train_loader):
            if i >= steps_per_epoch * args.accum:
                break  # same bound on every rank: len(train_loader) is equal across ranks
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            ctx = contextlib.nullcontext() if last_micro else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float() + args.tau * log_prior, y) / args.accum
                loss.backward()
            if last_micro:
                optimizer.step()
                sched.step()
                optimizer.zero_grad(set_to_none=True)
                if rank == 0 and (i // args.accum) % 100 == 0:
                    print(f"ep {epoch} step {i // args.accum}/{steps_per_epoch} "
                          f"loss {loss.item() * args.accum:.4f} lr {sched.get_last_lr()[0]:.5f}", flush=True)

        res = evaluate(model.module, val_loader, len(val_set), train_counts, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): top1 {100 * res['top1']:.2f} "
                  f"many {100 * res['many']:.2f} medium {100 * res['medium']:.2f} few {100 * res['few']:.2f}",
                  flush=True)
            os.makedirs(args.out, exist_ok=True)
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch, "world": world,
                        "eff_batch": eff_batch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
