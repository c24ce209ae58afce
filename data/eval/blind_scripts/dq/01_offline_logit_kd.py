"""Offline logit distillation: ResNet-50 teacher -> MobileNetV2 student.

Teacher logits are computed once (original + horizontally flipped view) and
cached next to the dataset, so the expensive teacher never runs during the
student's training epochs.

Launch:
    torchrun --nproc_per_node=8 01_offline_logit_kd.py --data /data/imagenet100
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--cache-dir", default="/data/cache/kd")
    p.add_argument("--teacher-ckpt", default="checkpoints/resnet50_in100.pth")
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--epochs", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.05, help="for a global batch of 256")
    p.add_argument("--wd", type=float, default=4e-5)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", default="runs/offline_kd_mbv2")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args()


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def fixed_transform():
    return transforms.Compose([
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])


class CachedLogitDataset(Dataset):
    """Returns (image, label, teacher_logits) with a random flip that matches the cached view."""

    def __init__(self, base, logits):
        self.base = base
        self.logits = logits  # [N, 2, C] on CPU: view 0 = original, view 1 = flipped

    def __len__(self):
        return len(self.base)

    def __getitem__(self, idx):
        img, label = self.base[idx]
        flip = int(torch.rand(()) < 0.5)
        if flip:
            img = torch.flip(img, dims=[2])
        return img, label, self.logits[idx, flip]


@torch.no_grad()
def compute_teacher_logits(teacher, dataset, device, batch_size, workers):
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        num_workers=workers, pin_memory=True)
    out = []
    for images, _ in loader:
        images = images.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            l0 = teacher(images).float()
            l1 = teacher(torch.flip(images, dims=[3])).float()
        out.append(torch.stack([l0, l1], dim=1).cpu())
    return torch.cat(out)


def kd_loss(s_logits, t_logits, labels, T, alpha):
    soft = F.kl_div(F.log_softmax(s_logits / T, dim=1),
                    F.softmax(t_logits / T, dim=1),
                    reduction="batchmean") * (T * T)
    hard = F.cross_entropy(s_logits, labels)
    return alpha * soft + (1.0 - alpha) * hard


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(2, device=device)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        stats[0] += (logits.argmax(1) == labels).sum()
        stats[1] += labels.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[1]).item() * 100.0


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_base = datasets.ImageFolder(os.path.join(args.data, "train"), fixed_transform())
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), fixed_transform())

    # ---- teacher ----
    teacher = models.resnet50(num_classes=args.num_classes)
    state = torch.load(args.teacher_ckpt, map_location="cpu")
    teacher.load_state_dict(state.get("model", state))
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    os.makedirs(args.cache_dir, exist_ok=True)
    cache_path = os.path.join(args.cache_dir, "resnet50_in100_train_logits.pt")
    if not os.path.exists(cache_path):
        logits = compute_teacher_logits(teacher, train_base, device, 256, args.workers)
        torch.save(logits, cache_path)
    teacher_logits = torch.load(cache_path, map_location="cpu")
    del teacher
    torch.cuda.empty_cache()
    assert teacher_logits.shape[0] == len(train_base)

    train_set = CachedLogitDataset(train_base, teacher_logits)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_subset = torch.utils.data.Subset(val_set, list(range(rank, len(val_set), world_size)))
    val_loader = DataLoader(val_subset, batch_size=256, shuffle=False,
                            num_workers=args.workers, pin_memory=True)

    # ---- student ----
    student = models.mobilenet_v2(num_classes=args.num_classes).to(device)
    student = DDP(student, device_ids=[local_rank])
    student_without_ddp = student.module

    global_bs = args.batch_size * world_size
    lr = args.lr * global_bs / 256
    decay, no_decay = [], []
    for n, p in student.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.SGD([
        {"params": decay, "weight_decay": args.wd},
        {"params": no_decay, "weight_decay": 0.0},
    ], lr=lr, momentum=0.9, nesterov=True)
    steps_per_epoch = len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=args.epochs * steps_per_epoch,
        pct_start=5 / args.epochs, anneal_strategy="cos")

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world_size} global_bs={global_bs} lr={lr:.4f} steps/epoch={steps_per_epoch}")

    best = 0.0
    for epoch in range(args.epochs):
        student.train()
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (images, labels, t_logits) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            t_logits = t_logits.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s_logits = student(images)
            loss = kd_loss(s_logits.float(), t_logits, labels, args.temperature, args.alpha)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

            if step % args.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} it {step}/{steps_per_epoch} loss {l.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.5f} {time.time() - t0:.1f}s")

        acc = evaluate(student_without_ddp, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val top1 {acc:.2f}")
            ckpt = {
                "model": student_without_ddp.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "acc": acc,
            }
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if acc > best:
                best = acc
                torch.save(student_without_ddp.state_dict(), os.path.join(args.out, "best_student.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best top1 {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
