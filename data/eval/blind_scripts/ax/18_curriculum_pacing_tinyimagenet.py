"""Curriculum learning by transfer scoring (Hacohen & Weinshall, 2019).

Difficulty of each training image = confidence of a pretrained teacher on its
true label (precomputed by score_difficulty.py into a .npy file). Training
starts on the easiest fraction of the data and an exponential pacing function
grows the fraction every `--step-length` iterations.

    torchrun --nproc_per_node=4 curriculum_pacing_tinyimagenet.py \
        --data /data/tiny-imagenet-200 --scores scores/teacher_conf.npy
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, models, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--scores", required=True, help="per-sample teacher confidence, higher = easier")
    p.add_argument("--out", default="runs/curriculum")
    p.add_argument("--start-frac", type=float, default=0.2)
    p.add_argument("--inc", type=float, default=1.9, help="pacing multiplier")
    p.add_argument("--step-length", type=int, default=2000, help="iterations per pacing step")
    p.add_argument("--total-iters", type=int, default=60000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def pacing(it, n, args):
    """Exponential pacing: fraction of the sorted data available at iteration it."""
    frac = args.start_frac * args.inc ** (it // args.step_length)
    return min(n, int(math.ceil(frac * n)))


def build_model():
    m = models.resnet18(num_classes=200)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    return nn.SyncBatchNorm.convert_sync_batchnorm(m)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        loss_sum += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        total += y.size(0)
    return correct / total, loss_sum / total


def make_loader(train_set, order, size, args, epoch_seed):
    subset = Subset(train_set, order[:size].tolist())
    sampler = DistributedSampler(subset, shuffle=True, seed=args.seed)
    sampler.set_epoch(epoch_seed)
    return DataLoader(subset, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                      pin_memory=True, drop_last=True, persistent_workers=False)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    norm = transforms.Normalize((0.480, 0.448, 0.398), (0.277, 0.269, 0.282))
    train_tf = transforms.Compose([transforms.RandomCrop(64, 8), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.ToTensor(), norm])
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    val_loader = DataLoader(val_set, batch_size=256, num_workers=4, pin_memory=True,
                            sampler=DistributedSampler(val_set, shuffle=False))

    conf = np.load(args.scores)
    assert len(conf) == len(train_set), "scores do not match the training set"
    order = np.argsort(-conf, kind="stable")  # easiest first, same on every rank

    model = DDP(build_model().to(device), device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.total_iters,
                                                pct_start=0.1)
    writer = SummaryWriter(args.out) if rank == 0 else None

    it, pass_id, best_acc = 0, 0, 0.0
    cur_size = pacing(0, len(train_set), args)
    loader = make_loader(train_set, order, cur_size, args, pass_id)
    data_iter = iter(loader)
    t0 = time.time()
    model.train()
    while it < args.total_iters:
        new_size = pacing(it, len(train_set), args)
        if new_size != cur_size:
            cur_size = new_size
            pass_id += 1
            loader = make_loader(train_set, order, cur_size, args, pass_id)
            data_iter = iter(loader)
            if rank == 0:
                print(f"iter {it}: curriculum grows to {cur_size} samples", flush=True)
        try:
            x, y = next(data_iter)
        except StopIteration:
            pass_id += 1
            loader = make_loader(train_set, order, cur_size, args, pass_id)
            data_iter = iter(loader)
            x, y = next(data_iter)

        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        it += 1

        if rank == 0 and it % 100 == 0:
            writer.add_scalar("train/loss", loss.item(), it)
            writer.add_scalar("train/data_frac", cur_size / len(train_set), it)
            writer.add_scalar("train/lr", sched.get_last_lr()[0], it)

        if it % args.eval_every == 0:
            acc, vloss = evaluate(model.module, val_loader, device)
            model.train()
            if rank == 0:
                writer.add_scalar("val/acc", acc, it)
                writer.add_scalar("val/loss", vloss, it)
                print(f"iter {it} | val acc {acc:.4f} loss {vloss:.3f} | "
                      f"{(time.time() - t0) / args.eval_every * 1000:.0f} ms/it", flush=True)
                t0 = time.time()
                state = {"iter": it, "model": model.module.state_dict(), "opt": opt.state_dict(),
                         "sched": sched.state_dict(), "cur_size": cur_size, "pass_id": pass_id}
                torch.save(state, os.path.join(args.out, "last.pt"))
                if acc > best_acc:
                    best_acc = acc
                    torch.save(state, os.path.join(args.out, "best.pt"))

    if rank == 0:
        print(f"done, best val acc {best_acc:.4f}")
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
