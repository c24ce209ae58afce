"""Decoupled KD (DKD, Zhao et al. 2022) on CIFAR-100 for the edge model zoo.

ResNet32x4 teacher -> ShuffleNetV2 student, tracked in Weights & Biases so the
sweep agent can compare alpha/beta settings.

    torchrun --nproc_per_node=4 11_dkd_wandb.py --teacher-ckpt zoo/resnet32x4_c100.pth \
        --alpha 1.0 --beta 8.0 --wandb-project edge-kd
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from zoo.cifar_models import resnet32x4, shufflenet_v2  # in-house CIFAR model definitions


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/cifar100")
    ap.add_argument("--teacher-ckpt", required=True)
    ap.add_argument("--epochs", type=int, default=240)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.05, help="for a global batch of 64")
    ap.add_argument("--milestones", type=int, nargs="+", default=[150, 180, 210])
    ap.add_argument("--alpha", type=float, default=1.0, help="TCKD weight")
    ap.add_argument("--beta", type=float, default=8.0, help="NCKD weight")
    ap.add_argument("--T", type=float, default=4.0)
    ap.add_argument("--warmup", type=int, default=20, help="epochs to ramp up the DKD loss")
    ap.add_argument("--wandb-project", default="edge-kd")
    ap.add_argument("--run-name", default=None)
    ap.add_argument("--save-dir", default="checkpoints/dkd_shufv2")
    return ap.parse_args()


def dkd_loss(logits_s, logits_t, target, alpha, beta, T):
    gt_mask = F.one_hot(target, logits_s.size(1)).bool()
    other_mask = ~gt_mask
    p_s = F.softmax(logits_s / T, dim=1)
    p_t = F.softmax(logits_t / T, dim=1)
    # binary (target vs. rest) probabilities
    b_s = torch.stack([(p_s * gt_mask).sum(1), (p_s * other_mask).sum(1)], dim=1)
    b_t = torch.stack([(p_t * gt_mask).sum(1), (p_t * other_mask).sum(1)], dim=1)
    tckd = F.kl_div(torch.log(b_s.clamp_min(1e-8)), b_t, reduction="batchmean") * T ** 2
    # non-target distribution
    log_p_s_nt = F.log_softmax(logits_s / T - 1000.0 * gt_mask, dim=1)
    p_t_nt = F.softmax(logits_t / T - 1000.0 * gt_mask, dim=1)
    nckd = F.kl_div(log_p_s_nt, p_t_nt, reduction="batchmean") * T ** 2
    return alpha * tckd + beta * nckd


@torch.no_grad()
def test(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        stats[0] += F.cross_entropy(out, y, reduction="sum")
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (100 * stats[1] / stats[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    run = wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    mean, std = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), transforms.Normalize(mean, std)])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    if rank == 0:
        datasets.CIFAR100(args.data, train=True, download=True)
        datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_set = datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_set = datasets.CIFAR100(args.data, train=False, transform=test_tf)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world_size)),
                             batch_size=256, num_workers=2)

    teacher = resnet32x4(num_classes=100)
    teacher.load_state_dict(torch.load(args.teacher_ckpt, map_location="cpu")["model"])
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = shufflenet_v2(num_classes=100).to(device)
    student = DDP(student, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 64
    optimizer = torch.optim.SGD(student.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=args.milestones, gamma=0.1)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        ramp = min(1.0, (epoch + 1) / args.warmup)
        agg = torch.zeros(3, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                t_logits = teacher(x)
            s_logits = student(x)
            ce = F.cross_entropy(s_logits, y)
            kd = ramp * dkd_loss(s_logits, t_logits, y, args.alpha, args.beta, args.T)
            loss = ce + kd
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            agg += torch.stack([ce.detach(), kd.detach(), torch.ones((), device=device)])
        scheduler.step()

        dist.all_reduce(agg)
        test_loss, test_acc = test(student.module, test_loader, device)
        wandb.log({
            "epoch": epoch,
            "train/ce": (agg[0] / agg[2]).item(),
            "train/dkd": (agg[1] / agg[2]).item(),
            "test/loss": test_loss,
            "test/acc": test_acc,
            "lr": scheduler.get_last_lr()[0],
        })
        if rank == 0:
            if test_acc > best_acc:
                best_acc = test_acc
                torch.save({"model": student.module.state_dict(), "epoch": epoch, "acc": test_acc},
                           os.path.join(args.save_dir, "best.pth"))
            torch.save({"model": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "epoch": epoch}, os.path.join(args.save_dir, "last.pth"))
            print(f"epoch {epoch} test acc {test_acc:.2f} best {best_acc:.2f}", flush=True)
        dist.barrier()

    run.summary["best_acc"] = best_acc
    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
