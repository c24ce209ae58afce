"""GradNorm multi-task training of one ResNet-50 trunk on several image datasets.

Each step takes one batch from every task's loader, runs them through the shared
trunk in a single forward, and balances the task losses with GradNorm
(Chen et al., 2018) on the last shared conv layer.

Launch:
    torchrun --nproc_per_node=4 gradnorm_train.py --data_root /datasets/mt --tasks cub,cars,aircraft,dtd
"""
import argparse
import os
import time
from itertools import count

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--tasks", default="cub,cars,aircraft,dtd")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--iters_per_epoch", type=int, default=500)
    ap.add_argument("--batch_per_task", type=int, default=32, help="per GPU, per task")
    ap.add_argument("--lr", type=float, default=0.02, help="for a global batch of 256 images")
    ap.add_argument("--weight_lr", type=float, default=0.025)
    ap.add_argument("--alpha", type=float, default=1.5, help="GradNorm asymmetry")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--out", default="runs/gradnorm")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


def make_transforms(train):
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    if train:
        return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    return T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm])


class MultiHeadResNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        trunk = torchvision.models.resnet50(weights="IMAGENET1K_V2")
        self.trunk = nn.Sequential(*list(trunk.children())[:-2])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.heads = nn.ModuleDict({t: nn.Linear(2048, n) for t, n in num_classes.items()})

    def last_shared_weight(self):
        return self.trunk[-1][-1].conv3.weight

    def forward(self, images, splits):
        feats = self.pool(self.trunk(images)).flatten(1)
        chunks = torch.split(feats, splits)
        return {t: self.heads[t](f) for t, f in zip(self.heads.keys(), chunks)}


def cycle(loader, sampler):
    for ep in count():
        sampler.set_epoch(ep)
        for batch in loader:
            yield batch


@torch.no_grad()
def evaluate(model, val_sets, device, rank, world):
    model.eval()
    stats = torch.zeros(len(val_sets), 2, device=device)
    for i, (t, ds) in enumerate(val_sets.items()):
        part = Subset(ds, range(rank, len(ds), world))
        for x, y in DataLoader(part, batch_size=128, num_workers=4, pin_memory=True):
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            logits = model.heads[t](model.pool(model.trunk(x)).flatten(1))
            stats[i, 0] += (logits.argmax(1) == y).sum()
            stats[i, 1] += y.numel()
    dist.all_reduce(stats)
    model.train()
    return {t: (stats[i, 0] / stats[i, 1]).item() for i, t in enumerate(val_sets)}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tasks = args.tasks.split(",")
    train_sets = {t: torchvision.datasets.ImageFolder(os.path.join(args.data_root, t, "train"), make_transforms(True))
                  for t in tasks}
    val_sets = {t: torchvision.datasets.ImageFolder(os.path.join(args.data_root, t, "val"), make_transforms(False))
                for t in tasks}
    num_classes = {t: len(ds.classes) for t, ds in train_sets.items()}

    streams = {}
    for t, ds in train_sets.items():
        sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
        loader = DataLoader(ds, batch_size=args.batch_per_task, sampler=sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True, persistent_workers=True)
        streams[t] = cycle(loader, sampler)

    net = MultiHeadResNet(num_classes)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    shared_w = model.module.last_shared_weight()

    n_tasks = len(tasks)
    task_w = torch.ones(n_tasks, device=device, requires_grad=True)
    global_batch = args.batch_per_task * n_tasks * world
    lr = args.lr * global_batch / 256
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    opt_w = torch.optim.Adam([task_w], lr=args.weight_lr)
    total = args.epochs * args.iters_per_epoch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.05)

    start_epoch, init_losses = 0, None
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        opt_w.load_state_dict(ckpt["opt_w"])
        sched.load_state_dict(ckpt["sched"])
        with torch.no_grad():
            task_w.copy_(ckpt["task_w"])
        init_losses = ckpt["init_losses"]
        start_epoch = ckpt["epoch"] + 1

    writer = SummaryWriter(args.out) if rank == 0 else None
    step = start_epoch * args.iters_per_epoch
    for epoch in range(start_epoch, args.epochs):
        tic = time.time()
        for it in range(args.iters_per_epoch):
            batches = [next(streams[t]) for t in tasks]
            images = torch.cat([b[0] for b in batches]).to(device, non_blocking=True)
            targets = [b[1].to(device, non_blocking=True) for b in batches]
            splits = [len(b[1]) for b in batches]

            outs = model(images, splits)
            losses = torch.stack([F.cross_entropy(outs[t], y) for t, y in zip(tasks, targets)])

            # loss ratios use the loss averaged over ranks so every rank sees the same numbers
            mean_losses = losses.detach().clone()
            dist.all_reduce(mean_losses)
            mean_losses /= world
            if init_losses is None:
                init_losses = mean_losses.clone()

            # per-task gradient norms at the last shared layer; torch.autograd.grad does not
            # touch .grad, so DDP's reducer only fires on the backward below
            norms = torch.stack([
                torch.autograd.grad(losses[i], shared_w, retain_graph=True)[0].norm()
                for i in range(n_tasks)
            ])
            dist.all_reduce(norms)
            norms /= world

            opt.zero_grad(set_to_none=True)
            (task_w.detach() * losses).sum().backward()

            g = task_w * norms
            ratio = mean_losses / init_losses
            target = (g.mean() * (ratio / ratio.mean()) ** args.alpha).detach()
            gn_loss = (g - target).abs().sum()
            opt_w.zero_grad(set_to_none=True)
            task_w.grad = torch.autograd.grad(gn_loss, task_w)[0]

            opt.step()
            opt_w.step()
            sched.step()
            with torch.no_grad():
                task_w.clamp_(min=1e-3)
                task_w.mul_(n_tasks / task_w.sum())
            step += 1

            if rank == 0 and step % 50 == 0:
                for i, t in enumerate(tasks):
                    writer.add_scalar(f"loss/{t}", mean_losses[i].item(), step)
                    writer.add_scalar(f"weight/{t}", task_w[i].item(), step)
                    writer.add_scalar(f"gradnorm/{t}", norms[i].item(), step)
                writer.add_scalar("lr", sched.get_last_lr()[0], step)

        accs = evaluate(model.module, val_sets, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - tic:.0f}s) " +
                  " ".join(f"{t}={a:.4f}" for t, a in accs.items()), flush=True)
            for t, a in accs.items():
                writer.add_scalar(f"val_acc/{t}", a, step)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "opt_w": opt_w.state_dict(),
                        "sched": sched.state_dict(), "task_w": task_w.detach().cpu(),
                        "init_losses": init_losses.cpu(), "epoch": epoch},
                       os.path.join(args.out, "checkpoint.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
