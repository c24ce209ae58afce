"""Fine-tune a timm ViT-S/16 on Oxford Flowers-102 with gradient averaging
done by hand (async all_reduce per parameter, overlapped with the rest of the
backward via post-accumulate-grad hooks).

Usage:
    torchrun --nproc_per_node=4 12_vit_flowers_allreduce.py --data /data/flowers102
"""
import argparse
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
from timm.data import create_transform, resolve_data_config
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


def get_parser():
    parser = argparse.ArgumentParser("vit-flowers")
    parser.add_argument("--data", type=str, required=True)
    parser.add_argument("--model", type=str, default="vit_small_patch16_224.augreg_in21k")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=48)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--weight_decay", type=float, default=0.05)
    parser.add_argument("--warmup_epochs", type=int, default=3)
    parser.add_argument("--output_dir", type=str, default="./output/vit_flowers")
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--num_workers", type=int, default=8)
    return parser


class GradAverager:
    """Launches an async all_reduce as soon as a parameter's gradient is ready."""

    def __init__(self, model, world_size):
        self.world_size = world_size
        self.handles = []
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        p.grad.div_(self.world_size)
        self.handles.append(dist.all_reduce(p.grad, async_op=True))

    def wait(self):
        for h in self.handles:
            h.wait()
        self.handles.clear()


def main():
    args = get_parser().parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", args.local_rank)

    model = timm.create_model(args.model, pretrained=(rank == 0), num_classes=102, drop_path_rate=0.1)
    model.to(device)
    # rank 0 holds the pretrained weights; copy them to everyone
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)

    cfg = resolve_data_config({}, model=model)
    train_tf = create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5")
    eval_tf = create_transform(**cfg, is_training=False)
    train_set = ImageFolder(os.path.join(args.data, "train"), transform=train_tf)
    val_set = ImageFolder(os.path.join(args.data, "val"), transform=eval_tf)
    assert train_set.classes == val_set.classes

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True)
    val_loader = DataLoader(torch.utils.data.Subset(val_set, range(rank, len(val_set), world_size)),
                            batch_size=128, num_workers=args.num_workers, pin_memory=True)

    averager = GradAverager(model, world_size)
    eff_lr = args.lr * args.batch_size * world_size / 512
    decay = [p for n, p in model.named_parameters() if p.ndim > 1 and "pos_embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=eff_lr)
    iters = len(train_loader)
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs * iters)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=(args.epochs - args.warmup_epochs) * iters)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cos], milestones=[args.warmup_epochs * iters])

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world_size={world_size} lr={eff_lr:.2e} iters/epoch={iters}", flush=True)

    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for it, (images, targets) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(images), targets, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            averager.wait()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 20 == 0:
                print(f"[{epoch}/{args.epochs}][{it}/{iters}] loss={loss.item():.4f} "
                      f"lr={scheduler.get_last_lr()[0]:.2e}", flush=True)

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for images, targets in val_loader:
                images, targets = images.to(device), targets.to(device)
                hits[0] += (model(images).argmax(-1) == targets).sum()
                hits[1] += targets.numel()
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()
        if rank == 0:
            print(f"epoch {epoch} val_acc={acc:.4f} time={time.time() - start:.0f}s", flush=True)
            if acc > best_acc:
                best_acc = acc
                torch.save({"model": model.state_dict(), "epoch": epoch, "acc": acc,
                            "classes": train_set.classes}, os.path.join(args.output_dir, "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
