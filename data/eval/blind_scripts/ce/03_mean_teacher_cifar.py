"""Mean Teacher (Tarvainen & Valpola, 2017) on CIFAR-10, launched with mp.spawn.

Single node:   python 03_mean_teacher_cifar.py --gpus 4
Two nodes:     python 03_mean_teacher_cifar.py --gpus 8 --nodes 2 --node-rank 0 --dist-url tcp://10.0.0.1:23456
               (multi-node runs expect --data already populated on the shared filesystem)
"""
import argparse
import copy
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

NO_LABEL = -1


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/shared/datasets/cifar10")
    p.add_argument("--labels-per-class", type=int, default=400)
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count(), help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--dist-url", default="tcp://127.0.0.1:29511")
    p.add_argument("--epochs", type=int, default=180)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--labeled-batch-size", type=int, default=31, help="per GPU")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ema-decay", type=float, default=0.97)
    p.add_argument("--consistency", type=float, default=100.0)
    p.add_argument("--consistency-rampup", type=int, default=5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--ckpt-dir", default="/shared/ckpt/mean_teacher")
    p.add_argument("--resume", default="")
    return p


class TwoCrops:
    def __init__(self, t):
        self.t = t

    def __call__(self, x):
        return self.t(x), self.t(x)


class RelabeledCIFAR(Dataset):
    """CIFAR-10 where all but a fixed labelled subset carry NO_LABEL."""

    def __init__(self, root, labeled_idx, transform):
        self.base = datasets.CIFAR10(root, train=True, transform=transform)
        keep = set(labeled_idx.tolist())
        self.targets = [t if i in keep else NO_LABEL for i, t in enumerate(self.base.targets)]

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, _ = self.base[i]
        return img, self.targets[i]


def make_model():
    m = models.resnet18(num_classes=10)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def sigmoid_rampup(current, rampup_length):
    if rampup_length == 0:
        return 1.0
    current = np.clip(current, 0.0, rampup_length)
    phase = 1.0 - current / rampup_length
    return float(np.exp(-5.0 * phase * phase))


@torch.no_grad()
def update_ema(student, teacher, alpha, global_step):
    alpha = min(1 - 1 / (global_step + 1), alpha)
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(alpha).add_(s, alpha=1 - alpha)
    for tb, sb in zip(teacher.buffers(), student.buffers()):
        tb.copy_(sb)


@torch.no_grad()
def validate(model, loader, gpu):
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=gpu)
    for x, y in loader:
        x, y = x.cuda(gpu, non_blocking=True), y.cuda(gpu, non_blocking=True)
        totals[0] += (model(x).argmax(1) == y).sum()
        totals[1] += y.numel()
    dist.all_reduce(totals)
    return (100.0 * totals[0] / totals[1]).item()


def worker(gpu, args):
    rank = args.node_rank * args.gpus + gpu
    world_size = args.nodes * args.gpus
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=args.dist_url, world_size=world_size, rank=rank)
    is_main = rank == 0

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = transforms.Compose([transforms.RandomCrop(32, 4, padding_mode="reflect"),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    # the split is drawn from a fixed generator so every process sees the same labelled set
    targets = np.array(datasets.CIFAR10(args.data, train=True).targets)
    rng = np.random.default_rng(12345)
    labeled_idx = np.concatenate([rng.choice(np.where(targets == c)[0], args.labels_per_class, replace=False)
                                  for c in range(10)])
    train_set = RelabeledCIFAR(args.data, labeled_idx, TwoCrops(train_tf))
    labeled_set = torch.utils.data.Subset(train_set, labeled_idx)
    unl_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    lab_sampler = DistributedSampler(labeled_set, num_replicas=world_size, rank=rank, shuffle=True)
    unl_loader = DataLoader(train_set, batch_size=args.batch_size - args.labeled_batch_size,
                            sampler=unl_sampler, num_workers=args.workers, pin_memory=True, drop_last=True)
    lab_loader = DataLoader(labeled_set, batch_size=args.labeled_batch_size, sampler=lab_sampler,
                            num_workers=2, pin_memory=True, drop_last=True)
    test_set = datasets.CIFAR10(args.data, train=False, transform=transforms.Compose([transforms.ToTensor(), norm]))
    test_loader = DataLoader(test_set, batch_size=256, num_workers=args.workers,
                             sampler=DistributedSampler(test_set, num_replicas=world_size, rank=rank, shuffle=False))

    student = make_model().cuda(gpu)
    teacher = copy.deepcopy(student)
    for p in teacher.parameters():
        p.detach_()
    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=2e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    start_epoch, global_step = 0, 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=f"cuda:{gpu}")
        student.load_state_dict(ckpt["student"])
        teacher.load_state_dict(ckpt["teacher"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, global_step = ckpt["epoch"], ckpt["global_step"]
    student = DDP(student, device_ids=[gpu])
    if is_main:
        os.makedirs(args.ckpt_dir, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        unl_sampler.set_epoch(epoch)
        lab_sampler.set_epoch(epoch)
        student.train()
        teacher.train()
        lab_iter = iter(lab_loader)
        tic = time.time()
        for i, ((u1, u2), _) in enumerate(unl_loader):
            try:
                (l1, l2), y = next(lab_iter)
            except StopIteration:
                lab_iter = iter(lab_loader)
                (l1, l2), y = next(lab_iter)
            x_student = torch.cat([l1, u1]).cuda(gpu, non_blocking=True)
            x_teacher = torch.cat([l2, u2]).cuda(gpu, non_blocking=True)
            y = y.cuda(gpu, non_blocking=True)
            n_lab = y.size(0)

            s_logits = student(x_student)
            with torch.no_grad():
                t_logits = teacher(x_teacher)
            class_loss = F.cross_entropy(s_logits[:n_lab], y)
            w = args.consistency * sigmoid_rampup(epoch + i / len(unl_loader), args.consistency_rampup)
            cons_loss = F.mse_loss(F.softmax(s_logits, 1), F.softmax(t_logits, 1), reduction="sum") / x_student.size(0)
            loss = class_loss + w * cons_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            global_step += 1
            update_ema(student.module, teacher, args.ema_decay, global_step)

            if is_main and i % 100 == 0:
                print(f"ep {epoch} it {i}/{len(unl_loader)} cls {class_loss.item():.3f} "
                      f"cons {cons_loss.item():.4f} w {w:.1f}", flush=True)
        scheduler.step()

        s_acc = validate(student.module, test_loader, gpu)
        t_acc = validate(teacher, test_loader, gpu)
        if is_main:
            print(f"epoch {epoch} student {s_acc:.2f} teacher {t_acc:.2f} ({time.time() - tic:.0f}s)", flush=True)
            torch.save({"epoch": epoch + 1, "global_step": global_step,
                        "student": student.module.state_dict(), "teacher": teacher.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(args.ckpt_dir, "checkpoint.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_parser().parse_args()
    if args.nodes == 1:
        datasets.CIFAR10(args.data, train=True, download=True)
        datasets.CIFAR10(args.data, train=False, download=True)
    mp.spawn(worker, args=(args,), nprocs=args.gpus, join=True)
