"""
Feature + logit distillation with timm models.

Teacher: convnext_base (frozen), student: efficientnet_lite0 (edge target).
The last feature map of the student is projected to the teacher's width with a
1x1 connector and matched with an MSE loss after spatial alignment.

    torchrun --nproc_per_node 8 04_timm_feature_kd.py --data-dir /datasets/imagenet \
        --teacher convnext_base.fb_in22k_ft_in1k --student efficientnet_lite0
"""
import argparse
import logging
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.data import create_transform, resolve_data_config
from timm.layers import convert_sync_batchnorm
from timm.utils import AverageMeter
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

_logger = logging.getLogger("feat_kd")


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--teacher", default="convnext_base.fb_in22k_ft_in1k")
    ap.add_argument("--student", default="efficientnet_lite0")
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3, help="lr at global batch 1024")
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup-epochs", type=int, default=5)
    ap.add_argument("--tau", type=float, default=1.0)
    ap.add_argument("--w-logit", type=float, default=1.0)
    ap.add_argument("--w-feat", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--output", default="output/feat_kd")
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class Connector(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.proj = nn.Sequential(nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x, size):
        x = self.proj(x)
        if x.shape[-2:] != size:
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        return x


def cosine_lr(step, total, warmup, base):
    if step < warmup:
        return base * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return 0.5 * base * (1 + torch.cos(torch.tensor(prog * 3.141592653589793)).item())


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(2, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        acc[0] += (out.argmax(-1) == y).sum()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    return 100.0 * (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    teacher = timm.create_model(args.teacher, pretrained=True, num_classes=1000)
    teacher = teacher.to(device).eval().requires_grad_(False)
    student = timm.create_model(args.student, pretrained=False, num_classes=1000)
    student.to(device)

    connector = Connector(student.num_features, teacher.num_features).to(device)

    data_cfg = resolve_data_config({}, model=student)
    train_tf = create_transform(**data_cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    eval_tf = create_transform(**data_cfg, is_training=False)
    train_ds = ImageFolder(os.path.join(args.data_dir, "train"), transform=train_tf)
    val_ds = ImageFolder(os.path.join(args.data_dir, "val"), transform=eval_tf)
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)),
                            batch_size=256, num_workers=args.workers, pin_memory=True)

    student = convert_sync_batchnorm(student)
    student = DistributedDataParallel(student, device_ids=[local_rank])
    connector = DistributedDataParallel(connector, device_ids=[local_rank])

    params = list(student.parameters()) + list(connector.parameters())
    base_lr = args.lr * args.batch_size * world_size / 1024
    optimizer = torch.optim.AdamW(params, lr=base_lr, weight_decay=args.weight_decay)
    scaler = torch.cuda.amp.GradScaler()

    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        student.module.load_state_dict(ckpt["student"])
        connector.module.load_state_dict(ckpt["connector"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = args.warmup_epochs * steps_per_epoch
    os.makedirs(args.output, exist_ok=True)
    best_acc = 0.0

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        student.train()
        connector.train()
        meters = {k: AverageMeter() for k in ("loss", "logit", "feat")}
        tic = time.time()
        for i, (x, y) in enumerate(train_loader):
            step = epoch * steps_per_epoch + i
            lr = cosine_lr(step, total_steps, warmup_steps, base_lr)
            for g in optimizer.param_groups:
                g["lr"] = lr
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)

            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                t_feat = teacher.forward_features(x)
                t_logits = teacher.forward_head(t_feat)

            with torch.autocast("cuda", dtype=torch.float16):
                s_feat = student.forward_features(x)
                s_logits = student.forward_head(s_feat)
                s_proj = connector(s_feat, t_feat.shape[-2:])

            l_logit = F.kl_div(F.log_softmax(s_logits.float() / args.tau, -1),
                               F.softmax(t_logits.float() / args.tau, -1),
                               reduction="batchmean") * args.tau ** 2
            l_feat = F.mse_loss(s_proj.float(), t_feat.float())
            loss = args.w_logit * l_logit + args.w_feat * l_feat + 0.1 * F.cross_entropy(s_logits.float(), y)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 5.0)
            scaler.step(optimizer)
            scaler.update()

            meters["loss"].update(loss.item(), x.size(0))
            meters["logit"].update(l_logit.item(), x.size(0))
            meters["feat"].update(l_feat.item(), x.size(0))
            if i % 100 == 0:
                _logger.info(f"ep {epoch} [{i}/{steps_per_epoch}] lr {lr:.2e} "
                             f"loss {meters['loss'].avg:.4f} logit {meters['logit'].avg:.4f} "
                             f"feat {meters['feat'].avg:.4f} ({time.time() - tic:.0f}s)")

        acc = validate(student.module, val_loader, device)
        _logger.info(f"epoch {epoch} top1 {acc:.2f}")
        if rank == 0:
            state = {"student": student.module.state_dict(),
                     "connector": connector.module.state_dict(),
                     "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(),
                     "epoch": epoch, "acc": acc}
            torch.save(state, os.path.join(args.output, "last.pth.tar"))
            if acc > best_acc:
                best_acc = acc
                torch.save(student.module.state_dict(), os.path.join(args.output, "student_best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
