"""Learning without Forgetting, class-incremental ImageNet-100 (B10 / 10 steps).

Two nodes x 8 GPUs:
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29400 \
      03_lwf_imagenet100.py --data /mnt/shared/imagenet100 --out /mnt/shared/runs/lwf_in100
"""
import argparse
import copy
import math
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder
from torchvision.models import resnet18


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True, help="must be on storage shared by all nodes")
    p.add_argument("--init-classes", type=int, default=10)
    p.add_argument("--step-classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=16, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="for a global batch of 256")
    p.add_argument("--kd-lambda", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--resume", default="")
    p.add_argument("--wandb-project", default="cil-lwf")
    return p.parse_args()


class CILNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = resnet18()
        self.dim = self.backbone.fc.in_features
        self.backbone.fc = nn.Identity()
        self.head = nn.Linear(self.dim, 0)

    def grow(self, n):
        old = self.head
        new = nn.Linear(self.dim, old.out_features + n).to(old.weight.device)
        with torch.no_grad():
            new.weight[: old.out_features].copy_(old.weight)
            new.bias[: old.out_features].copy_(old.bias)
        self.head = new

    def forward(self, x):
        return self.head(self.backbone(x))


def kd_loss(student, teacher, T):
    return F.kl_div(F.log_softmax(student / T, 1), F.softmax(teacher / T, 1),
                    reduction="batchmean") * T * T


@torch.no_grad()
def accuracy_on(net, dataset, idx, device, rank, world):
    net.eval()
    part = idx[rank::world]  # no padding: each sample is scored exactly once
    loader = DataLoader(Subset(dataset, part), batch_size=128, num_workers=4)
    hits = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in loader:
        y = y.to(device)
        hits[0] += (net(x.to(device)).argmax(1) == y).sum()
        hits[1] += y.numel()
    dist.all_reduce(hits)
    return (100.0 * hits[0] / hits[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    is_main = rank == 0
    if is_main:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), dir=args.out)

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = ImageFolder(os.path.join(args.data, "train"),
                            T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(),
                                       T.ToTensor(), norm]))
    val_set = ImageFolder(os.path.join(args.data, "val"),
                          T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    # fixed class order (seed 1993) -> label = position in the order
    order = np.random.RandomState(1993).permutation(len(train_set.classes))
    pos = np.argsort(order)
    train_set.target_transform = val_set.target_transform = lambda y: int(pos[y])
    tr_y = pos[np.asarray(train_set.targets)]
    va_y = pos[np.asarray(val_set.targets)]

    n_cls = len(order)
    steps = [args.init_classes] + [args.step_classes] * ((n_cls - args.init_classes) // args.step_classes)
    bounds = np.cumsum([0] + steps)

    net = CILNet()
    teacher = None
    acc = np.zeros((len(steps), len(steps)))
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        net.grow(int(bounds[ck["task"] + 1]))
        net.load_state_dict(ck["model"])
        acc = ck["acc"]
        start = ck["task"] + 1
    # per-GPU batch is small: normalise over the global batch
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    if start > 0:
        teacher = copy.deepcopy(net).eval().requires_grad_(False)

    # global batch = batch_size * world; lr scaled linearly from the 256 reference
    lr = args.base_lr * args.batch_size * world / 256

    for task in range(start, len(steps)):
        lo, hi = int(bounds[task]), int(bounds[task + 1])
        net.grow(hi - lo)
        model = DDP(net, device_ids=[local_rank])

        train_idx = np.flatnonzero((tr_y >= lo) & (tr_y < hi))
        sampler = DistributedSampler(Subset(train_set, train_idx), shuffle=True, seed=task)
        loader = DataLoader(Subset(train_set, train_idx), batch_size=args.batch_size,
                            sampler=sampler, num_workers=args.workers, pin_memory=True,
                            drop_last=True, persistent_workers=True)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        total = args.epochs * len(loader)
        warm = 5 * len(loader)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            model.train()
            for step, (x, y) in enumerate(loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                out = model(x)
                loss = F.cross_entropy(out, y)
                if teacher is not None:
                    with torch.no_grad():
                        t_out = teacher(x)
                    loss = loss + args.kd_lambda * kd_loss(out[:, :lo], t_out, args.temperature)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                # skip the update everywhere if any rank saw a non-finite loss
                bad = (~torch.isfinite(loss.detach())).float()
                dist.all_reduce(bad)
                if bad.item() == 0:
                    opt.step()
                sched.step()
                if is_main and step % 50 == 0:
                    wandb.log({"task": task, "loss": loss.item(), "lr": sched.get_last_lr()[0]})

        for j in range(task + 1):
            a, b = int(bounds[j]), int(bounds[j + 1])
            acc[task, j] = accuracy_on(net, val_set, np.flatnonzero((va_y >= a) & (va_y < b)),
                                       device, rank, world)
        overall = accuracy_on(net, val_set, np.flatnonzero(va_y < hi), device, rank, world)

        if is_main:
            forgetting = (np.mean([acc[j:task, j].max() - acc[task, j] for j in range(task)])
                          if task else 0.0)
            print(f"task {task}: top1 {overall:.2f}  per-task {np.round(acc[task, :task + 1], 1)}"
                  f"  forgetting {forgetting:.2f}", flush=True)
            wandb.log({"task": task, "top1": overall, "forgetting": forgetting})
            torch.save({"task": task, "model": net.state_dict(), "acc": acc},
                       os.path.join(args.out, f"lwf_task{task:02d}.pt"))
        dist.barrier()

        teacher = copy.deepcopy(net).eval().requires_grad_(False)

    if is_main:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
