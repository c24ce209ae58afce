"""Distil a deep ensemble into a single student (Hinton et al.; Malinin et al. 2020).

The teachers are M frozen ResNet-18 members (see the deep-ensemble run); the
student is trained on the average tempered teacher distribution plus the hard
label. Teachers run in bf16 inside the training step on every rank.

    torchrun --nproc_per_node=8 17_ensemble_distillation.py \
        --teachers runs/deep_ensemble/member_*.pt --student resnet18 --epochs 120
"""
import argparse
import glob
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torchvision import transforms as T
from torch.utils.tensorboard import SummaryWriter


def cifar_net(arch, num_classes=10):
    m = getattr(torchvision.models, arch)(num_classes=num_classes)
    m.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


def load_teachers(pattern, device):
    teachers = []
    for path in sorted(glob.glob(pattern)):
        t = cifar_net("resnet18")
        t.load_state_dict(torch.load(path, map_location="cpu")["model"])
        t.to(device).eval().requires_grad_(False)
        teachers.append(t)
    return teachers


def distill_loss(student_logits, teacher_probs, y, tau, alpha):
    soft = F.kl_div(F.log_softmax(student_logits / tau, -1), teacher_probs, reduction="batchmean") * tau ** 2
    hard = F.cross_entropy(student_logits, y)
    return alpha * soft + (1 - alpha) * hard


@torch.no_grad()
def teacher_distribution(teachers, x, tau):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = torch.stack([t(x) for t in teachers]).float()
    return F.softmax(logits / tau, -1).mean(0)


@torch.no_grad()
def evaluate(model, loader, device, n_bins=15):
    model.eval()
    correct, total, nll = 0, 0, 0.0
    confs, hits = [], []
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x).float()
        nll += F.cross_entropy(logits, y, reduction="sum").item()
        conf, pred = logits.softmax(-1).max(1)
        correct += pred.eq(y).sum().item()
        total += y.numel()
        confs.append(conf)
        hits.append(pred.eq(y).float())
    conf, hit = torch.cat(confs), torch.cat(hits)
    b = (conf * n_bins).long().clamp(max=n_bins - 1)
    gap = torch.zeros(n_bins, device=device).index_add_(0, b, conf - hit)
    return {"acc": correct / total, "nll": nll / total, "ece": gap.abs().sum().item() / total}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teachers", required=True, help="glob for member checkpoints")
    ap.add_argument("--student", default="resnet18")
    ap.add_argument("--data", default="/data/cifar10")
    ap.add_argument("--out", default="runs/distill")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--tau", type=float, default=2.5)
    ap.add_argument("--alpha", type=float, default=0.9)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3)

    teachers = load_teachers(args.teachers, device)
    if rank == 0:
        print(f"{len(teachers)} teachers loaded", flush=True)

    norm = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_set = torchvision.datasets.CIFAR10(args.data, True, T.Compose(
        [T.RandomCrop(32, 4), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    test_set = torchvision.datasets.CIFAR10(args.data, False, T.Compose([T.ToTensor(), norm]))
    train_sampler = DistributedSampler(train_set, shuffle=True)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    test_loader = DataLoader(test_set, 500, sampler=test_sampler, num_workers=4, pin_memory=True)

    student = cifar_net(args.student).to(device)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student)
    model = DDP(student, device_ids=[local_rank])
    base_lr = args.lr * args.batch_size * world / 128
    opt = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=5e-4, nesterov=True)
    warmup = 5 * len(train_loader)
    total = args.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup),
    ], milestones=[warmup])

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            tp = teacher_distribution(teachers, x, args.tau)
            loss = distill_loss(model(x), tp, y, args.tau, args.alpha)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(run)

        m = evaluate(model, test_loader, device)
        if rank == 0:
            train_loss = (run[0] / run[1]).item()
            print(f"epoch {epoch} loss {train_loss:.4f} acc {m['acc']:.4f} nll {m['nll']:.4f} "
                  f"ece {m['ece']:.4f} ({time.time() - t0:.0f}s)", flush=True)
            writer.add_scalar("train/loss", train_loss, epoch)
            for k, v in m.items():
                writer.add_scalar(f"test/{k}", v, epoch)
            ckpt = {"model": student.state_dict(), "epoch": epoch, "metrics": m, "args": vars(args)}
            torch.save(ckpt, os.path.join(args.out, "student_last.pt"))
            if m["acc"] > best_acc:
                best_acc = m["acc"]
                torch.save(ckpt, os.path.join(args.out, "student_best.pt"))
        dist.barrier()

    if rank == 0:
        writer.close()
        print(f"best student acc {best_acc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
