"""DeiT-S with a distillation token, hard distillation from a frozen RegNetY-16GF
teacher. Student under DDP; the teacher is a plain module on every rank.

torchrun --nproc_per_node=8 deit_distill.py --data /data/imagenet --teacher-ckpt weights/regnety_160_ft.pth
"""
import argparse
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets


class ShardedEvalSampler(Sampler):
    """Contiguous, unpadded shard per rank: every val image is scored exactly once."""

    def __init__(self, n, rank, world):
        per = math.ceil(n / world)
        self.idx = list(range(rank * per, min(n, (rank + 1) * per)))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def hard_distill_loss(outputs, targets, teacher_logits, base_criterion):
    cls_out, dist_out = outputs
    base = base_criterion(cls_out, targets)
    teacher_labels = teacher_logits.argmax(dim=1)
    distill = F.cross_entropy(dist_out, teacher_labels)
    return 0.5 * base + 0.5 * distill


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(3, device=device)
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)  # eval mode: mean of class and distillation heads
        top5 = out.topk(5, dim=1).indices
        s[0] += (top5[:, 0] == target).sum()
        s[1] += (top5 == target[:, None]).any(1).sum()
        s[2] += target.numel()
    dist.all_reduce(s)
    model.train()
    return (100 * s[0] / s[2]).item(), (100 * s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--teacher-ckpt", required=True)
    ap.add_argument("--batch-size", type=int, default=128, help="per GPU")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=5e-4, help="for a global batch of 512")
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--output", default="out/deit_s_distilled")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0 + rank)

    train_tf = create_transform(224, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(224, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_ds = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_ds = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=256, sampler=ShardedEvalSampler(len(val_ds), rank, world),
                            num_workers=args.workers, pin_memory=True)

    # teacher: checkpoint was written from a DDP run, so its keys carry "module."
    teacher = timm.create_model("regnety_160", num_classes=1000)
    ckpt = torch.load(args.teacher_ckpt, map_location="cpu")
    sd = ckpt.get("model", ckpt)
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    teacher.load_state_dict(sd)
    teacher.to(device).eval()
    teacher.requires_grad_(False)

    student = timm.create_model("deit_small_distilled_patch16_224", pretrained=False, num_classes=1000,
                                drop_path_rate=0.1)
    student.set_distilled_training(True)  # training forward returns (cls_logits, dist_logits)
    student.to(device)
    model = DDP(student, device_ids=[local_rank])

    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    criterion = SoftTargetCrossEntropy()
    global_batch = args.batch_size * args.accum * world
    lr = args.lr * global_batch / 512
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "token" not in n and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim > 1 and "token" not in n and "pos_embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr)
    updates_per_epoch = len(loader) // args.accum
    total_updates, warm = args.epochs * updates_per_epoch, args.warmup_epochs * updates_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: (u + 1) / warm if u < warm else
                                              0.5 * (1 + math.cos(math.pi * (u - warm) / (total_updates - warm))))

    start_epoch, best = 0, 0.0
    resume = os.path.join(args.output, "checkpoint.pth")
    if os.path.exists(resume):
        ck = torch.load(resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"global batch {global_batch}, lr {lr:.2e}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        run = torch.zeros(2, device=device)
        for i, (images, targets) in enumerate(loader):
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            images, soft_targets = mixup(images, targets)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with torch.no_grad():
                    t_logits = teacher(images)
                outputs = model(images)
                loss = hard_distill_loss(outputs, soft_targets, t_logits.float(), criterion) / args.accum
            boundary = (i + 1) % args.accum == 0
            if boundary:
                loss.backward()
            else:
                with model.no_sync():
                    loss.backward()
            run += torch.stack([loss.detach() * args.accum, torch.ones((), device=device)])
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if (i + 1) % (100 * args.accum) == 0:
                r = run.clone()
                dist.all_reduce(r)
                if rank == 0:
                    print(f"ep {epoch} it {i + 1}/{len(loader)} loss {(r[0] / r[1]).item():.4f} "
                          f"lr {sched.get_last_lr()[0]:.2e} {(time.time() - t0) / (i + 1):.3f}s/it", flush=True)

        acc1, acc5 = evaluate(model.module, val_loader, device)
        if rank == 0:
            best = max(best, acc1)
            print(f"epoch {epoch} acc1 {acc1:.2f} acc5 {acc5:.2f} best {best:.2f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                     "epoch": epoch, "best": best}
            torch.save(state, resume)
            if acc1 >= best:
                torch.save(state, os.path.join(args.output, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
