"""Self-ensembling / mean-teacher domain adaptation (French et al., ICLR'18) on VisDA-2017.

Images are decoded and resized on the CPU; the photometric augmentation and the
normalisation run on the GPU for both student and teacher views.

    torchrun --nproc_per_node=4 11_mean_teacher_visda.py --root /data/visda17 --epochs 20
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models
from torchvision import transforms as T

NUM_CLASSES = 12
IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1).cuda()
IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1).cuda()


class VisDA(Dataset):
    def __init__(self, root, split, train=True, two_views=False):
        self.root = os.path.join(root, split)
        with open(os.path.join(self.root, "image_list.txt")) as f:
            self.items = [(p, int(y)) for p, y in (line.split() for line in f if line.strip())]
        if train:
            self.tf = T.Compose([T.RandomResizedCrop(160, scale=(0.5, 1.0)), T.RandomHorizontalFlip(),
                                 T.PILToTensor()])
        else:
            self.tf = T.Compose([T.Resize(176), T.CenterCrop(160), T.PILToTensor()])
        self.two_views = two_views

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, y = self.items[i]
        img = Image.open(os.path.join(self.root, path)).convert("RGB")
        if self.two_views:
            return self.tf(img), self.tf(img), y
        return self.tf(img), y


def gpu_augment(x, strength=0.2, noise=0.05):
    """Random per-image gain/offset, gaussian noise, then ImageNet normalisation."""
    x = x.float().div_(255.0)
    n = x.size(0)
    gain = 1.0 + strength * (2 * torch.rand(n, 1, 1, 1, device=x.device) - 1)
    offset = strength * (2 * torch.rand(n, 1, 1, 1, device=x.device) - 1)
    x = (x * gain + offset).clamp_(0.0, 1.0)
    x = x + noise * torch.randn_like(x)
    return (x - IMAGENET_MEAN) / IMAGENET_STD


def normalize(x):
    return (x.float().div(255.0) - IMAGENET_MEAN) / IMAGENET_STD


def build_net():
    net = models.resnet101(weights=models.ResNet101_Weights.IMAGENET1K_V2)
    net.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(2048, NUM_CLASSES))
    return net


@torch.no_grad()
def ema_update(teacher, student, decay):
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(decay).add_(s.detach(), alpha=1 - decay)
    for t, s in zip(teacher.buffers(), student.buffers()):
        t.copy_(s)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    n = NUM_CLASSES
    cm = torch.zeros(n * n, device=device, dtype=torch.long)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        pred = net(normalize(x)).argmax(1)
        cm += torch.bincount(y * n + pred, minlength=n * n)
    dist.all_reduce(cm)
    cm = cm.view(n, n).float()
    return (cm.diag() / cm.sum(1).clamp(min=1)).mean().item() * 100


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/data/visda17")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ema-decay", type=float, default=0.99)
    ap.add_argument("--cons-weight", type=float, default=3.0)
    ap.add_argument("--conf-thresh", type=float, default=0.9)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--ckpt-dir", default="ckpt/mean_teacher_visda")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    src = VisDA(args.root, "train", train=True)
    tgt = VisDA(args.root, "validation", train=True, two_views=True)
    tgt_eval = VisDA(args.root, "validation", train=False)
    s_sampler = DistributedSampler(src, shuffle=True, drop_last=True)
    t_sampler = DistributedSampler(tgt, shuffle=True, drop_last=True)
    s_loader = DataLoader(src, args.batch_size, sampler=s_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    t_loader = DataLoader(tgt, args.batch_size, sampler=t_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    e_loader = DataLoader(tgt_eval, 128, sampler=DistributedSampler(tgt_eval, shuffle=False),
                          num_workers=args.workers, pin_memory=True)

    student = build_net().to(device)
    teacher = copy.deepcopy(student)
    teacher.requires_grad_(False)
    student = DDP(student, device_ids=[local_rank])
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        s_sampler.set_epoch(epoch)
        t_sampler.set_epoch(epoch)
        student.train()
        teacher.train()
        t0 = time.time()
        stats = torch.zeros(4, device=device)
        for it, ((xs, ys), (xt1, xt2, _)) in enumerate(zip(s_loader, t_loader)):
            xs = gpu_augment(xs.to(device, non_blocking=True))
            ys = ys.to(device, non_blocking=True)
            xt1 = gpu_augment(xt1.to(device, non_blocking=True))
            xt2 = gpu_augment(xt2.to(device, non_blocking=True))

            logits = student(torch.cat([xs, xt1]))
            logit_s, logit_t = logits[: xs.size(0)], logits[xs.size(0):]
            with torch.no_grad():
                teacher_prob = F.softmax(teacher(xt2), dim=1)

            cls_loss = F.cross_entropy(logit_s, ys)
            conf_mask = (teacher_prob.max(1).values > args.conf_thresh).float()
            sq_diff = ((F.softmax(logit_t, 1) - teacher_prob) ** 2).sum(1)
            cons_loss = (sq_diff * conf_mask).mean()
            loss = cls_loss + args.cons_weight * cons_loss

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ema_update(teacher, student.module, args.ema_decay)

            stats += torch.stack([cls_loss.detach(), cons_loss.detach(), conf_mask.mean(),
                                  torch.ones((), device=device)])
            if it % 100 == 0:
                snap = stats.clone()
                dist.all_reduce(snap)
                if rank == 0:
                    k = snap[3]
                    print(f"ep {epoch} it {it}: cls {snap[0] / k:.3f} cons {snap[1] / k:.4f} "
                          f"mask {snap[2] / k:.2f} ({time.time() - t0:.0f}s)", flush=True)

        acc = evaluate(teacher, e_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: teacher mean-class acc {acc:.2f}", flush=True)
            ckpt = {"epoch": epoch, "student": student.module.state_dict(),
                    "teacher": teacher.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(ckpt, os.path.join(args.ckpt_dir, "last.pth"))
            if acc > best:
                best = acc
                torch.save(ckpt, os.path.join(args.ckpt_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
