"""
Offline knowledge distillation on ImageNet-100: the teacher's logits are
computed once over the (un-augmented) training set, cached to disk, and the
student is trained against the cached soft targets.

    torchrun --nproc_per_node=8 kd_offline.py \
        --data /datasets/imagenet100 --teacher-ckpt ckpts/resnet152_in100.pth
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser("offline KD")
    p.add_argument("--data", required=True)
    p.add_argument("--teacher-arch", default="resnet152")
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--student-arch", default="resnet18")
    p.add_argument("--num-classes", type=int, default=100)
    p.add_argument("--cache-dir", default="/shared/kd_cache")
    p.add_argument("--epochs", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=128, help="per GPU")
    p.add_argument("--lr", type=float, default=0.4)
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--temperature", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.9)
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--out", default="runs/kd_offline_r18")
    return p.parse_args()


class IndexedDataset(Dataset):
    """Returns (image, label, index) so cached teacher logits can be looked up."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, y = self.base[i]
        return img, y, i


def build_teacher(args, device):
    teacher = torchvision.models.__dict__[args.teacher_arch](num_classes=args.num_classes)
    sd = torch.load(args.teacher_ckpt, map_location="cpu")
    teacher.load_state_dict(sd.get("model", sd))
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


@torch.no_grad()
def compute_teacher_logits(teacher, dataset, device, batch_size, workers):
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False,
                        num_workers=workers, pin_memory=True)
    out = torch.empty(len(dataset), teacher.fc.out_features, dtype=torch.float16)
    for img, _, idx in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            logits = teacher(img.to(device, non_blocking=True))
        out[idx] = logits.float().cpu().half()
    return out


def load_or_build_cache(args, teacher, device):
    os.makedirs(args.cache_dir, exist_ok=True)
    path = os.path.join(args.cache_dir, f"{args.teacher_arch}_in{args.num_classes}_logits.pt")
    if os.path.exists(path):
        return torch.load(path, map_location="cpu")
    plain_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                          T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = IndexedDataset(torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), plain_tf))
    logits = compute_teacher_logits(teacher, ds, device, 256, args.workers)
    torch.save(logits, path)
    return logits


def kd_loss(student_logits, teacher_logits, labels, T_, alpha):
    soft = F.kl_div(F.log_softmax(student_logits / T_, dim=1),
                    F.softmax(teacher_logits / T_, dim=1),
                    reduction="batchmean") * (T_ * T_)
    hard = F.cross_entropy(student_logits, labels)
    return alpha * soft + (1.0 - alpha) * hard


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for img, y in loader:
        img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(img)
        stats[0] += F.cross_entropy(logits, y, reduction="sum")
        stats[1] += (logits.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item() * 100


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    teacher = build_teacher(args, device)
    teacher_logits = load_or_build_cache(args, teacher, device)
    del teacher
    torch.cuda.empty_cache()

    train_tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                          T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(),
                        T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    train_ds = IndexedDataset(torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf))
    val_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    assert len(train_ds) == teacher_logits.shape[0]

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)

    student = torchvision.models.__dict__[args.student_arch](num_classes=args.num_classes)
    student = nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device)
    student = DDP(student, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in student.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    opt = torch.optim.SGD([{"params": decay, "weight_decay": args.wd},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, momentum=0.9, nesterov=True)
    steps_per_epoch = len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=steps_per_epoch, pct_start=0.05)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for it, (img, y, idx) in enumerate(train_loader):
            img, y = img.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t_logits = teacher_logits[idx].to(device, non_blocking=True).float()
            with torch.autocast("cuda", dtype=torch.float16):
                s_logits = student(img)
            loss = kd_loss(s_logits.float(), t_logits, y, args.temperature, args.alpha)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()
            running[0] += loss.detach()
            running[1] += 1
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"lr {sched.get_last_lr()[0]:.4f}", flush=True)

        dist.all_reduce(running)
        val_loss, val_acc = evaluate(student, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: train_loss {(running[0] / running[1]).item():.4f} "
                  f"val_loss {val_loss:.4f} val_acc {val_acc:.2f} ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"epoch": epoch, "model": student.module.state_dict(),
                    "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "val_acc": val_acc}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if val_acc > best:
                best = val_acc
                torch.save(student.module.state_dict(), os.path.join(args.out, "best_student.pth"))
        dist.barrier()

    if rank == 0:
        print(f"best val acc {best:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
