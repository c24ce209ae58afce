"""
Logit + feature distillation on CIFAR-100: WRN-40-2 teacher -> WRN-16-2 student.
The student's penultimate feature map is projected to the teacher's width with a
1x1 conv adapter and matched with an L2 loss (FitNets-style, last stage only).

    torchrun --standalone --nproc_per_node=4 train_kd.py --teacher ckpt/wrn40_2.pth
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from models.wrn import wrn_16_2, wrn_40_2  # repo-local WideResNet implementation

MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="/data/cifar100")
    p.add_argument("--teacher", required=True)
    p.add_argument("--epochs", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=64, help="per-GPU batch")
    p.add_argument("--base-lr", type=float, default=0.05, help="lr for a global batch of 64")
    p.add_argument("--milestones", type=int, nargs="+", default=[150, 180, 210])
    p.add_argument("--T", type=float, default=4.0)
    p.add_argument("--w-ce", type=float, default=1.0)
    p.add_argument("--w-kd", type=float, default=0.9)
    p.add_argument("--w-feat", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default="save/kd_wrn16_2")
    return p.parse_args()


class StudentWithAdapter(nn.Module):
    """Bundles the student and its projection so DDP syncs both."""

    def __init__(self, student, s_channels, t_channels):
        super().__init__()
        self.student = student
        self.adapter = nn.Sequential(
            nn.Conv2d(s_channels, t_channels, 1, bias=False),
            nn.BatchNorm2d(t_channels),
        )

    def forward(self, x):
        feats, logits = self.student(x, is_feat=True)
        return self.adapter(feats[-2]), logits


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def reduce_mean(t):
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    correct = torch.zeros(1, device=device)
    total = torch.zeros(1, device=device)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        _, logits = model(x)
        correct += (logits.argmax(1) == y).sum()
        total += y.numel()
    dist.all_reduce(correct)
    dist.all_reduce(total)
    return (correct / total).item() * 100.0


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    set_seed(args.seed)

    train_tf = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(MEAN, STD)])
    test_tf = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    if rank == 0:
        torchvision.datasets.CIFAR100(args.data, train=True, download=True)
        torchvision.datasets.CIFAR100(args.data, train=False, download=True)
    dist.barrier()
    train_set = torchvision.datasets.CIFAR100(args.data, train=True, transform=train_tf)
    test_set = torchvision.datasets.CIFAR100(args.data, train=False, transform=test_tf)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler,
                             num_workers=4, pin_memory=True)

    # teacher: frozen, eval mode, never wrapped in DDP
    teacher = wrn_40_2(num_classes=100)
    state = torch.load(args.teacher, map_location="cpu")
    teacher.load_state_dict(state["model"])
    teacher = teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad = False

    student = wrn_16_2(num_classes=100)
    model = StudentWithAdapter(student, s_channels=128, t_channels=128)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    lr = args.base_lr * args.batch_size * world / 64
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=5e-4, nesterov=True)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, args.milestones, gamma=0.1)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        with open(os.path.join(args.save_dir, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        print(f"world={world} global_batch={args.batch_size * world} lr={lr}")

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        teacher.eval()
        meter = torch.zeros(4, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                t_feats, t_logits = teacher(x, is_feat=True)
            s_proj, s_logits = model(x)

            loss_ce = F.cross_entropy(s_logits, y)
            loss_kd = F.kl_div(F.log_softmax(s_logits / args.T, 1),
                               F.softmax(t_logits / args.T, 1),
                               reduction="batchmean") * args.T ** 2
            loss_feat = F.mse_loss(s_proj, t_feats[-2])
            loss = args.w_ce * loss_ce + args.w_kd * loss_kd + args.w_feat * loss_feat

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            meter += torch.stack([loss.detach(), loss_ce.detach(), loss_kd.detach(), loss_feat.detach()])
        scheduler.step()

        meter = reduce_mean(meter / len(train_loader))
        acc = evaluate(model, test_loader, device)
        if rank == 0:
            print(f"[{epoch:03d}] loss {meter[0]:.3f} ce {meter[1]:.3f} kd {meter[2]:.3f} "
                  f"feat {meter[3]:.4f} | top1 {acc:.2f}", flush=True)
            state = {"epoch": epoch + 1,
                     "student": model.module.student.state_dict(),
                     "adapter": model.module.adapter.state_dict(),
                     "optimizer": optimizer.state_dict(),
                     "acc": acc}
            torch.save(state, os.path.join(args.save_dir, "last.pth"))
            if acc > best_acc:
                best_acc = acc
                torch.save(state, os.path.join(args.save_dir, "best.pth"))

    if rank == 0:
        print(f"best top1: {best_acc:.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
