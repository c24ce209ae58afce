"""
DeiT-S distillation (hard-label distillation token) with a RegNetY-16GF teacher.

    torchrun --nproc_per_node=8 deit_distill.py --data-path /data/imagenet \
        --teacher-path ckpt/regnety_160-a5fe301d.pth --output_dir out/deit_s_distilled
"""
import argparse
import datetime
import json
import math
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.scheduler import CosineLRScheduler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


def get_args_parser():
    p = argparse.ArgumentParser("DeiT distillation", add_help=True)
    p.add_argument("--data-path", required=True)
    p.add_argument("--model", default="deit_small_distilled_patch16_224")
    p.add_argument("--teacher-model", default="regnety_160")
    p.add_argument("--teacher-path", required=True)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--epochs", type=int, default=300)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=1e-5)
    p.add_argument("--warmup-epochs", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--mixup", type=float, default=0.8)
    p.add_argument("--cutmix", type=float, default=1.0)
    p.add_argument("--smoothing", type=float, default=0.1)
    p.add_argument("--num-workers", type=int, default=10)
    p.add_argument("--output_dir", default="")
    return p


def load_teacher(name, path, device="cuda:0"):
    teacher = timm.create_model(name, pretrained=False, num_classes=1000)
    ckpt = torch.load(path, map_location="cpu")
    teacher.load_state_dict(ckpt["model"] if "model" in ckpt else ckpt)
    teacher.to(device)
    teacher.eval()
    return teacher


class HardDistillationLoss(torch.nn.Module):
    def __init__(self, base_criterion, teacher):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher = teacher

    def forward(self, inputs, outputs, labels):
        cls_out, dist_out = outputs
        base_loss = self.base_criterion(cls_out, labels)
        with torch.no_grad():
            teacher_out = self.teacher(inputs)
        dist_loss = F.cross_entropy(dist_out, teacher_out.argmax(dim=1))
        return 0.5 * base_loss + 0.5 * dist_loss


def build_dataset(is_train, args):
    if is_train:
        tf = create_transform(224, is_training=True, color_jitter=0.3, auto_augment="rand-m9-mstd0.5-inc1",
                              interpolation="bicubic", re_prob=0.25, re_mode="pixel", re_count=1)
    else:
        tf = transforms.Compose([transforms.Resize(256, interpolation=transforms.InterpolationMode.BICUBIC),
                                 transforms.CenterCrop(224), transforms.ToTensor(),
                                 transforms.Normalize(timm.data.IMAGENET_DEFAULT_MEAN,
                                                      timm.data.IMAGENET_DEFAULT_STD)])
    return datasets.ImageFolder(os.path.join(args.data_path, "train" if is_train else "val"), tf)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    m = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.cuda.amp.autocast():
            out = model(x)
        top5 = out.topk(5, 1).indices
        m[0] += (top5[:, 0] == y).sum()
        m[1] += (top5 == y[:, None]).any(1).sum()
        m[2] += y.numel()
    dist.all_reduce(m)
    return (100 * m[0] / m[2]).item(), (100 * m[1] / m[2]).item()


def main(args):
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0 + rank)

    ds_train = build_dataset(True, args)
    ds_val = build_dataset(False, args)
    sampler_train = DistributedSampler(ds_train, num_replicas=world_size, rank=rank, shuffle=True)
    sampler_val = DistributedSampler(ds_val, num_replicas=world_size, rank=rank, shuffle=False)
    loader_train = DataLoader(ds_train, sampler=sampler_train, batch_size=args.batch_size,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    loader_val = DataLoader(ds_val, sampler=sampler_val, batch_size=int(1.5 * args.batch_size),
                            num_workers=args.num_workers, pin_memory=True, drop_last=False)

    mixup_fn = Mixup(mixup_alpha=args.mixup, cutmix_alpha=args.cutmix, label_smoothing=args.smoothing,
                     num_classes=1000)

    model = timm.create_model(args.model, pretrained=False, num_classes=1000, drop_path_rate=0.1)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    lr = args.lr * args.batch_size * world_size / 512.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs, lr_min=args.min_lr,
                                     warmup_t=args.warmup_epochs, warmup_lr_init=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    teacher = load_teacher(args.teacher_model, args.teacher_path)
    criterion = HardDistillationLoss(SoftTargetCrossEntropy(), teacher)

    if rank == 0:
        print(f"params: {n_params / 1e6:.1f}M  lr: {lr:.2e}  world: {world_size}")
        if args.output_dir:
            os.makedirs(args.output_dir, exist_ok=True)

    start = time.time()
    max_acc = 0.0
    for epoch in range(args.epochs):
        sampler_train.set_epoch(epoch)
        model.train()
        for step, (samples, targets) in enumerate(loader_train):
            samples = samples.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            samples, targets = mixup_fn(samples, targets)
            with torch.cuda.amp.autocast():
                outputs = model(samples)
                loss = criterion(samples, outputs, targets)
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"loss is {loss.item()}, stopping training")
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and step % 100 == 0:
                print(f"Epoch [{epoch}] [{step}/{len(loader_train)}] loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)
        lr_scheduler.step(epoch + 1)

        acc1, acc5 = evaluate(model, loader_val, device)
        if rank == 0:
            print(f"* Acc@1 {acc1:.3f} Acc@5 {acc5:.3f}")
            if args.output_dir:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "lr_scheduler": lr_scheduler.state_dict(), "epoch": epoch,
                         "scaler": scaler.state_dict()}
                torch.save(state, os.path.join(args.output_dir, "checkpoint.pth"))
                if acc1 > max_acc:
                    torch.save(state, os.path.join(args.output_dir, "best_checkpoint.pth"))
                with open(os.path.join(args.output_dir, "log.txt"), "a") as f:
                    f.write(json.dumps({"epoch": epoch, "acc1": acc1, "acc5": acc5}) + "\n")
            max_acc = max(max_acc, acc1)

    if rank == 0:
        print("Training time {}".format(str(datetime.timedelta(seconds=int(time.time() - start)))))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args_parser().parse_args())
