"""Confidence-thresholded pseudo-labelling with an EMA teacher (CIFAR-100, WRN-28-8).

The teacher (EMA of the student) labels the weakly augmented unlabelled images;
only predictions above the threshold are kept and the student is trained on the
strongly augmented views of those images together with the labelled batch.

    torchrun --nproc_per_node=4 04_ema_pseudolabel_cifar100.py --num-labels 10000
"""
import argparse
import math
import os
import time
from copy import deepcopy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

from models.wideresnet import wrn_28_8
from utils.randaugment import RandAugmentMC

MEAN = (0.5071, 0.4865, 0.4409)
STD = (0.2673, 0.2564, 0.2762)


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--root", default="data/cifar100")
    p.add_argument("--out", default="exp/pl_ema_c100")
    p.add_argument("--num-labels", type=int, default=10000)
    p.add_argument("--bs", type=int, default=16, help="labelled images per GPU")
    p.add_argument("--uratio", type=int, default=7)
    p.add_argument("--lr", type=float, default=0.03)
    p.add_argument("--wd", type=float, default=1e-3)
    p.add_argument("--iters-per-epoch", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=512)
    p.add_argument("--warmup-iters", type=int, default=5000, help="supervised-only iterations")
    p.add_argument("--tau", type=float, default=0.95)
    p.add_argument("--T", type=float, default=1.0)
    p.add_argument("--lambda-u", type=float, default=1.0)
    p.add_argument("--ema", type=float, default=0.999)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    return p


class TwoCrop:
    def __init__(self):
        self.weak = transforms.Compose([
            transforms.RandomHorizontalFlip(),
            transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
            transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
        self.strong = transforms.Compose([
            transforms.RandomHorizontalFlip(),
            transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
            RandAugmentMC(n=2, m=10),
            transforms.ToTensor(), transforms.Normalize(MEAN, STD)])

    def __call__(self, x):
        return self.weak(x), self.strong(x)


def labelled_indices(targets, n, num_classes, seed):
    rng = np.random.default_rng(seed)
    targets = np.asarray(targets)
    per = n // num_classes
    return np.concatenate([rng.choice(np.flatnonzero(targets == c), per, replace=False)
                           for c in range(num_classes)])


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
        epoch += 1


@torch.no_grad()
def ema_update(teacher, student, m):
    for pt, ps in zip(teacher.parameters(), student.parameters()):
        pt.mul_(m).add_(ps.detach(), alpha=1 - m)
    for bt, bs in zip(teacher.buffers(), student.buffers()):
        bt.copy_(bs)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    hit = tot = 0
    for x, y in loader:
        pred = net(x.to(device)).argmax(1).cpu()
        hit += (pred == y).sum().item()
        tot += len(y)
    return 100.0 * hit / tot


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    if rank == 0:
        datasets.CIFAR100(args.root, train=True, download=True)
        datasets.CIFAR100(args.root, train=False, download=True)
    dist.barrier()

    lab_tf = transforms.Compose([transforms.RandomHorizontalFlip(),
                                 transforms.RandomCrop(32, padding=4, padding_mode="reflect"),
                                 transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    full_lab = datasets.CIFAR100(args.root, train=True, transform=lab_tf)
    full_unl = datasets.CIFAR100(args.root, train=True, transform=TwoCrop())
    test_set = datasets.CIFAR100(args.root, train=False,
                                 transform=transforms.Compose([transforms.ToTensor(),
                                                               transforms.Normalize(MEAN, STD)]))
    lab_idx = labelled_indices(full_lab.targets, args.num_labels, 100, args.seed)
    lab_set = Subset(full_lab, lab_idx)
    unl_set = full_unl

    lab_sampler = DistributedSampler(lab_set, shuffle=True, drop_last=True)
    unl_sampler = DistributedSampler(unl_set, shuffle=True, drop_last=True)
    lab_loader = DataLoader(lab_set, args.bs, sampler=lab_sampler, num_workers=args.workers,
                            pin_memory=True, drop_last=True)
    unl_loader = DataLoader(unl_set, args.bs * args.uratio, sampler=unl_sampler,
                            num_workers=args.workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, 512, shuffle=False, num_workers=args.workers)

    student = wrn_28_8(num_classes=100).to(device)
    teacher = deepcopy(student).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = DDP(student, device_ids=[local_rank])

    optimizer = torch.optim.SGD(student.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    total_iters = args.epochs * args.iters_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: max(0.0, math.cos(7 * math.pi * i / (16 * total_iters))))

    writer = SummaryWriter(args.out) if rank == 0 else None
    lab_stream = infinite(lab_loader, lab_sampler)
    unl_stream = infinite(unl_loader, unl_sampler)

    global_it, best = 0, 0.0
    for epoch in range(args.epochs):
        student.train()
        t0 = time.time()
        n_skipped, n_kept, sum_loss = 0, 0, 0.0
        for _ in range(args.iters_per_epoch):
            x_l, y_l = next(lab_stream)
            (u_w, u_s), _ = next(unl_stream)
            x_l, y_l = x_l.to(device, non_blocking=True), y_l.to(device, non_blocking=True)
            global_it += 1

            if global_it <= args.warmup_iters:
                loss = F.cross_entropy(student(x_l), y_l)
            else:
                u_w, u_s = u_w.to(device, non_blocking=True), u_s.to(device, non_blocking=True)
                with torch.no_grad():
                    probs = torch.softmax(teacher(u_w) / args.T, dim=1)
                    conf, pl = probs.max(dim=1)
                    keep = conf >= args.tau
                if keep.sum() == 0:
                    # nothing confident in this unlabelled batch
                    n_skipped += 1
                    continue
                n_kept += int(keep.sum())
                logits = student(torch.cat([x_l, u_s[keep]]))
                loss_x = F.cross_entropy(logits[:x_l.size(0)], y_l)
                loss_u = F.cross_entropy(logits[x_l.size(0):], pl[keep])
                loss = loss_x + args.lambda_u * loss_u

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            ema_update(teacher, student.module, args.ema)
            sum_loss += loss.item()

        if rank == 0:
            acc = evaluate(teacher, test_loader, device)
            writer.add_scalar("test/acc_teacher", acc, epoch)
            writer.add_scalar("train/loss", sum_loss / args.iters_per_epoch, epoch)
            writer.add_scalar("train/kept_per_iter", n_kept / args.iters_per_epoch, epoch)
            writer.add_scalar("train/skipped", n_skipped, epoch)
            print(f"epoch {epoch}: acc {acc:.2f} kept/it {n_kept / args.iters_per_epoch:.1f} "
                  f"skipped {n_skipped} time {time.time() - t0:.0f}s", flush=True)
            os.makedirs(args.out, exist_ok=True)
            state = {"student": student.module.state_dict(), "teacher": teacher.state_dict(),
                     "optimizer": optimizer.state_dict(), "epoch": epoch, "acc": acc}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if acc > best:
                best = acc
                torch.save(state, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
