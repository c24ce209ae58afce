"""Knowledge distillation with pre-computed teacher logits.

The teacher (a large supervised ResNet-152) is run once over the training set on the
center crop; its logits are cached to disk and reused as soft targets for every epoch,
so student training does not pay for teacher forwards.

    torchrun --nproc_per_node=8 04_kd_logit_cache.py --data /datasets/imagenet100 \
        --teacher-ckpt /ckpt/r152_in100.pth --cache-dir /shared/cache/kd
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
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--teacher-arch", default="resnet152")
    ap.add_argument("--teacher-ckpt", required=True)
    ap.add_argument("--student-arch", default="resnet18")
    ap.add_argument("--num-classes", type=int, default=100)
    ap.add_argument("--cache-dir", default="./cache")
    ap.add_argument("--epochs", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    ap.add_argument("--wd", type=float, default=5e-5)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=4.0)
    ap.add_argument("--alpha", type=float, default=0.9, help="weight of the KD term")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--output-dir", default="./kd_out")
    return ap.parse_args()


class WithIndex(Dataset):
    """Returns (image, label, index) so cached teacher logits can be looked up."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        img, y = self.base[i]
        return img, y, i


def build_teacher(arch, ckpt_path, num_classes):
    teacher = torchvision.models.__dict__[arch](num_classes=num_classes)
    state = torch.load(ckpt_path, map_location="cpu")
    state = state.get("model", state)
    state = {k.replace("module.", "", 1): v for k, v in state.items()}
    teacher.load_state_dict(state)
    return teacher.eval()


@torch.no_grad()
def compute_teacher_logits(teacher, data_root, num_classes, device, workers):
    plain = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = torchvision.datasets.ImageFolder(os.path.join(data_root, "train"), transform=plain)
    loader = DataLoader(ds, batch_size=256, shuffle=False, num_workers=workers, pin_memory=True)
    out = torch.empty(len(ds), num_classes, dtype=torch.float16)
    pos = 0
    for x, _ in tqdm(loader, desc="teacher logits"):
        with torch.autocast("cuda", dtype=torch.float16):
            logits = teacher(x.to(device, non_blocking=True))
        out[pos:pos + len(x)] = logits.float().cpu().half()
        pos += len(x)
    return out


def load_or_build_cache(args, device):
    os.makedirs(args.cache_dir, exist_ok=True)
    cache_path = os.path.join(args.cache_dir, f"{args.teacher_arch}_train_logits.pt")
    if os.path.exists(cache_path):
        return torch.load(cache_path, map_location="cpu")
    teacher = build_teacher(args.teacher_arch, args.teacher_ckpt, args.num_classes).to(device)
    logits = compute_teacher_logits(teacher, args.data, args.num_classes, device, args.workers)
    torch.save(logits, cache_path)
    del teacher
    torch.cuda.empty_cache()
    return logits


def kd_loss(student_logits, teacher_logits, labels, T_, alpha):
    soft = F.kl_div(F.log_softmax(student_logits / T_, dim=1),
                    F.softmax(teacher_logits / T_, dim=1), reduction="batchmean") * (T_ * T_)
    hard = F.cross_entropy(student_logits, labels)
    return alpha * soft + (1.0 - alpha) * hard


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)  # loss sum, correct, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        stats[0] += F.cross_entropy(out.float(), y, reduction="sum")
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (100.0 * stats[1] / stats[2]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    teacher_logits = load_or_build_cache(args, device)

    train_tf = T.Compose([T.RandomResizedCrop(224, scale=(0.35, 1.0)), T.RandomHorizontalFlip(),
                          T.ToTensor(), T.Normalize(MEAN, STD)])
    val_tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)])
    train_set = WithIndex(torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf))
    val_full = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    assert len(teacher_logits) == len(train_set), "cache does not match the training set"

    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True)
    # every val image exactly once: strided shard per rank, no padding
    val_set = Subset(val_full, list(range(rank, len(val_full), world)))
    val_loader = DataLoader(val_set, batch_size=256, shuffle=False, num_workers=args.workers,
                            pin_memory=True)

    student = torchvision.models.__dict__[args.student_arch](num_classes=args.num_classes).to(device)
    student = DDP(student, device_ids=[local_rank])

    global_bs = args.batch_size * world
    base_lr = args.lr * global_bs / 256
    optimizer = torch.optim.SGD(student.parameters(), lr=base_lr, momentum=0.9,
                                weight_decay=args.wd, nesterov=True)
    iters = len(train_loader)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01,
                                               total_iters=args.warmup_epochs * iters)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                        T_max=(args.epochs - args.warmup_epochs) * iters)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine],
                                                      milestones=[args.warmup_epochs * iters])
    teacher_logits = teacher_logits.to(device)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for step, (x, y, idx) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            t_logits = teacher_logits[idx.to(device)].float()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s_logits = student(x)
            loss = kd_loss(s_logits.float(), t_logits, y, args.temperature, args.alpha)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                print(f"[{epoch}/{args.epochs}] {step}/{iters} loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.4f} ({time.time() - t0:.0f}s)", flush=True)

        val_loss, val_acc = evaluate(student.module, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: val loss {val_loss:.4f} top-1 {val_acc:.2f}", flush=True)
            state = {"student": student.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "acc": val_acc}
            torch.save(state, os.path.join(args.output_dir, "last.pth"))
            if val_acc > best:
                best = val_acc
                torch.save(student.module.state_dict(), os.path.join(args.output_dir, "best_student.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
