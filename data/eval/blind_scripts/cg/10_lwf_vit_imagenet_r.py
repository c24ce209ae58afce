"""LwF fine-tuning of an ImageNet-21k pre-trained ViT-B/16 on 10-split ImageNet-R.

After every task the model is written to <out>/task_XX.pt; the next task reloads it from
disk as the frozen teacher (this also makes it possible to restart at any task with --start-task).

    torchrun --nproc_per_node=8 10_lwf_vit_imagenet_r.py --data /data/imagenet-r --out ckpt/lwf_vit_inr
"""
import argparse
import math
import os
import time

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import create_transform
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

BACKBONE = "vit_base_patch16_224.augreg_in21k"


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/imagenet-r")
    ap.add_argument("--out", default="ckpt/lwf_vit_inr")
    ap.add_argument("--n-tasks", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16, help="per GPU")
    ap.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 128")
    ap.add_argument("--kd-weight", type=float, default=1.0)
    ap.add_argument("--kd-T", type=float, default=2.0)
    ap.add_argument("--start-task", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class ViTIncremental(nn.Module):
    def __init__(self, n_classes, pretrained=True):
        super().__init__()
        self.vit = timm.create_model(BACKBONE, pretrained=pretrained, num_classes=0)
        self.head = nn.Linear(self.vit.num_features, n_classes)

    def forward(self, x):
        return self.head(self.vit(x))


def masked_ce(logits, y, lo, hi):
    # train the current task's outputs only; old-class outputs are handled by the KD term
    return F.cross_entropy(logits[:, lo:hi], y - lo)


@torch.no_grad()
def per_task_accuracy(net, test_set, y_test, bounds, upto, device, rank, world):
    net.eval()
    res = []
    for j in range(upto + 1):
        lo, hi = bounds[j], bounds[j + 1]
        idx = np.flatnonzero((y_test >= lo) & (y_test < hi))[rank::world]
        stat = torch.zeros(2, device=device)
        for x, y in DataLoader(Subset(test_set, idx), batch_size=64, num_workers=4):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(x.to(device, non_blocking=True))[:, : bounds[upto + 1]]
            stat[0] += (logits.argmax(1).cpu() == y).sum().item()
            stat[1] += len(y)
        dist.all_reduce(stat)
        res.append(100.0 * (stat[0] / stat[1]).item())
    return res


def main():
    args = cli()
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    cfg = timm.data.resolve_data_config({}, model=BACKBONE)
    train_tf = create_transform(**cfg, is_training=True)
    test_tf = create_transform(**cfg)
    train_set = ImageFolder(os.path.join(args.data, "train"), train_tf)
    test_set = ImageFolder(os.path.join(args.data, "test"), test_tf)
    order = np.random.RandomState(args.seed).permutation(len(train_set.classes))
    pos = np.argsort(order)
    train_set.target_transform = test_set.target_transform = lambda c: int(pos[c])
    y_train = pos[np.asarray(train_set.targets)]
    y_test = pos[np.asarray(test_set.targets)]
    n_cls = len(order)
    bounds = np.linspace(0, n_cls, args.n_tasks + 1).astype(int).tolist()

    if rank == 0:
        timm.create_model(BACKBONE, pretrained=True)  # fill the hub cache once
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    net = ViTIncremental(n_cls).to(device)
    if args.start_task > 0:
        state = torch.load(os.path.join(args.out, f"task_{args.start_task - 1:02d}.pt"),
                           map_location="cpu")
        net.load_state_dict(state["model"])
    model = DDP(net, device_ids=[local_rank])
    acc = np.zeros((args.n_tasks, args.n_tasks))
    lr = args.lr * args.batch_size * world / 128

    for t in range(args.start_task, args.n_tasks):
        lo, hi = bounds[t], bounds[t + 1]
        teacher = None
        if t > 0:
            teacher = ViTIncremental(n_cls, pretrained=False).to(device)
            teacher.load_state_dict(torch.load(os.path.join(args.out, f"task_{t - 1:02d}.pt"))["model"])
            teacher.eval().requires_grad_(False)

        ds = Subset(train_set, np.flatnonzero((y_train >= lo) & (y_train < hi)))
        sampler = DistributedSampler(ds, shuffle=True, seed=args.seed + t)
        loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                            pin_memory=True, drop_last=True)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
        steps = args.epochs * len(loader)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))

        model.train()
        for ep in range(args.epochs):
            sampler.set_epoch(ep)
            tic = time.time()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                    loss = masked_ce(logits, y, lo, hi)
                    if teacher is not None:
                        with torch.no_grad():
                            old = teacher(x)[:, :lo]
                        T = args.kd_T
                        loss = loss + args.kd_weight * T * T * F.kl_div(
                            F.log_softmax(logits[:, :lo].float() / T, 1),
                            F.softmax(old.float() / T, 1), reduction="batchmean")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
            if rank == 0:
                print(f"task {t} epoch {ep} loss {loss.item():.4f} {time.time() - tic:.0f}s", flush=True)

        acc[t, : t + 1] = per_task_accuracy(net, test_set, y_test, bounds, t, device, rank, world)
        if rank == 0:
            last = acc[t, : t + 1].mean()
            fgt = np.mean([acc[j:t, j].max() - acc[t, j] for j in range(t)]) if t else 0.0
            print(f"[task {t}] avg acc {last:.2f} forgetting {fgt:.2f}", flush=True)
            torch.save({"model": net.state_dict(), "task": t, "acc": acc},
                       os.path.join(args.out, f"task_{t:02d}.pt"))
        dist.barrier()
        model.train()
        del teacher

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
