"""Balanced Knowledge Distillation (Zhang et al., 2021) on ImageNet-LT.

A teacher trained with plain CE (instance-balanced) is distilled into a student with
  L = CE(student, y) + T^2 * sum_c w_c * KL_c(teacher_T || student_T)
where w_c are class-balanced weights computed from the training-set counts.

    torchrun --nproc_per_node=8 imagenetlt_bkd.py --teacher ckpt/x50_ce_teacher.pth --out ckpt/r50_bkd
"""
import argparse
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
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-root", default="/data/imagenet")
    p.add_argument("--list-dir", default="/data/ImageNet_LT")
    p.add_argument("--teacher", required=True)
    p.add_argument("--teacher-arch", default="resnext50_32x4d")
    p.add_argument("--student-arch", default="resnet50")
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--beta", type=float, default=0.999)
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=32, help="per GPU")
    p.add_argument("--lr", type=float, default=0.1, help="per 256 images")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="ckpt/bkd")
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


class LTImages(Dataset):
    def __init__(self, root, txt, tf):
        with open(txt) as f:
            rows = [r.split() for r in f]
        self.paths = [os.path.join(root, r[0]) for r in rows]
        self.targets = [int(r[1]) for r in rows]
        self.tf = tf

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tf(Image.open(self.paths[i]).convert("RGB")), self.targets[i]


def cb_weights(counts, beta):
    eff = 1.0 - np.power(beta, counts)
    w = (1.0 - beta) / eff
    return torch.tensor(w / w.sum() * len(counts), dtype=torch.float32)


class BKDLoss(nn.Module):
    def __init__(self, class_weights, T):
        super().__init__()
        self.register_buffer("w", class_weights)
        self.T = T

    def forward(self, s_logits, t_logits, target):
        ce = F.cross_entropy(s_logits, target)
        log_p_s = F.log_softmax(s_logits / self.T, dim=1)
        p_t = F.softmax(t_logits / self.T, dim=1)
        kl = (p_t * (torch.log(p_t.clamp(min=1e-8)) - log_p_s)) * self.w
        return ce + (self.T ** 2) * kl.sum(1).mean()


@torch.no_grad()
def test(net, loader, counts, device):
    net.eval()
    C = len(counts)
    stat = torch.zeros(2, C, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = net(x).argmax(1)
        stat[0].index_add_(0, y, (pred == y).float())
        stat[1].index_add_(0, y, torch.ones_like(y, dtype=torch.float))
    dist.all_reduce(stat)
    acc = (stat[0] / stat[1].clamp(min=1)).cpu().numpy()
    return {"all": (stat[0].sum() / stat[1].sum()).item(), "many": acc[counts > 100].mean(),
            "medium": acc[(counts >= 20) & (counts <= 100)].mean(), "few": acc[counts < 20].mean()}


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = LTImages(args.data_root, os.path.join(args.list_dir, "ImageNet_LT_train.txt"),
                         transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                             transforms.ToTensor(), norm]))
    test_set = LTImages(args.data_root, os.path.join(args.list_dir, "ImageNet_LT_test.txt"),
                        transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                            transforms.ToTensor(), norm]))
    counts = np.bincount(train_set.targets, minlength=1000)

    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True)
    test_loader = DataLoader(torch.utils.data.Subset(test_set, range(rank, len(test_set), world)),
                             batch_size=250, num_workers=args.workers, pin_memory=True)

    teacher = torchvision.models.__dict__[args.teacher_arch](num_classes=1000)
    t_state = torch.load(args.teacher)
    teacher.load_state_dict(t_state["model"] if "model" in t_state else t_state)
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student = torchvision.models.__dict__[args.student_arch](num_classes=1000)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    model = DDP(student, device_ids=[local_rank])
    criterion = BKDLoss(cb_weights(counts, args.beta), args.T).to(device)

    lr = args.lr * args.batch_size * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)

    ckpt_file = os.path.join(args.out, "last.pth")
    start_epoch = 0
    if args.resume and os.path.isfile(ckpt_file):
        ck = torch.load(ckpt_file)
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        start_epoch = ck["epoch"] + 1

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.no_grad():
                t_logits = teacher(x)
            loss = criterion(model(x), t_logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if writer is not None and it % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), epoch * len(loader) + it)
        scheduler.step()

        r = test(model.module, test_loader, counts, device)
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s): all {100 * r['all']:.2f} many {100 * r['many']:.2f} "
                  f"medium {100 * r['medium']:.2f} few {100 * r['few']:.2f}", flush=True)
            for k, v in r.items():
                writer.add_scalar(f"test/{k}", v, epoch)
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, ckpt_file)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
