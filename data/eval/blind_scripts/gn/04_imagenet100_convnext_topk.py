"""ConvNeXt-T on ImageNet-100 with periodic evaluation and top-k checkpoint retention.

    torchrun --nproc_per_node=8 04_imagenet100_convnext_topk.py --cfg configs/in100_convnext_t.yaml
"""
import argparse
import glob
import heapq
import json
import os
import time
from dataclasses import asdict, dataclass

import timm
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from timm.data import create_transform, Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder


@dataclass
class Config:
    data_root: str = "/datasets/imagenet100"
    out_dir: str = "outputs/in100_convnext_t"
    model: str = "convnext_tiny"
    img_size: int = 224
    batch_size: int = 128  # per GPU
    base_lr: float = 4e-3  # for a global batch of 4096
    weight_decay: float = 0.05
    epochs: int = 100
    warmup_epochs: int = 5
    eval_interval: int = 2  # epochs
    keep_top_k: int = 3
    mixup: float = 0.8
    cutmix: float = 1.0
    workers: int = 10


class TopKCheckpoints:
    """Keeps the k best checkpoints (by top-1) on disk plus a small json index."""

    def __init__(self, directory, k):
        self.directory = directory
        self.k = k
        self.heap = []  # (score, epoch, path), min-heap -> worst is heap[0]
        os.makedirs(directory, exist_ok=True)

    def update(self, score, epoch, state):
        if len(self.heap) >= self.k and score <= self.heap[0][0]:
            return False
        path = os.path.join(self.directory, f"epoch{epoch:03d}_top1_{score:.4f}.pth")
        torch.save(state, path)
        heapq.heappush(self.heap, (score, epoch, path))
        if len(self.heap) > self.k:
            _, _, worst = heapq.heappop(self.heap)
            os.remove(worst)
        with open(os.path.join(self.directory, "topk.json"), "w") as f:
            json.dump(sorted(self.heap, reverse=True), f, indent=1)
        return True

    def best(self):
        return max(self.heap)[2] if self.heap else None


def lr_at(cfg, epoch_float, lr_peak):
    if epoch_float < cfg.warmup_epochs:
        return lr_peak * epoch_float / cfg.warmup_epochs
    t = (epoch_float - cfg.warmup_epochs) / max(1, cfg.epochs - cfg.warmup_epochs)
    return 1e-6 + 0.5 * (lr_peak - 1e-6) * (1 + torch.cos(torch.tensor(t * torch.pi)).item())


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device)  # top1, top5, n
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images)
        top5 = logits.topk(5, dim=1).indices
        acc[0] += (top5[:, 0] == target).sum()
        acc[1] += (top5 == target[:, None]).any(dim=1).sum()
        acc[2] += target.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cli = ap.parse_args()
    cfg = Config()
    if cli.cfg:
        with open(cli.cfg) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_tf = create_transform(cfg.img_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(cfg.img_size, is_training=False, interpolation="bicubic", crop_pct=0.875)
    train_set = ImageFolder(os.path.join(cfg.data_root, "train"), transform=train_tf)
    val_set = ImageFolder(os.path.join(cfg.data_root, "val"), transform=val_tf)
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))

    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=200, num_workers=cfg.workers, pin_memory=True)

    model = timm.create_model(cfg.model, num_classes=len(train_set.classes), drop_path_rate=0.1).to(device)
    model = DDP(model, device_ids=[local_rank])
    global_batch = cfg.batch_size * world
    lr_peak = cfg.base_lr * global_batch / 4096
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr_peak, weight_decay=cfg.weight_decay)
    mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=0.1,
                  num_classes=len(train_set.classes))
    criterion = SoftTargetCrossEntropy()

    ckpts = TopKCheckpoints(os.path.join(cfg.out_dir, "checkpoints"), cfg.keep_top_k)
    if rank == 0:
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
        print(f"world={world} global_batch={global_batch} peak_lr={lr_peak:.2e}", flush=True)

    steps_per_epoch = len(train_loader)
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (images, target) in enumerate(train_loader):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(cfg, epoch + i / steps_per_epoch, lr_peak)
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            images, target = mixup(images, target)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{steps_per_epoch} loss {loss.item():.4f} "
                      f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)

        if (epoch + 1) % cfg.eval_interval == 0 or epoch + 1 == cfg.epochs:
            top1, top5 = evaluate(model, val_loader, device)
            state = {"epoch": epoch, "model": model.module.state_dict(),
                     "optimizer": optimizer.state_dict(), "top1": top1, "top5": top5}
            kept = ckpts.update(top1, epoch, state)
            if rank == 0:
                print(f"[val] epoch {epoch} top1 {top1:.4f} top5 {top5:.4f} kept={kept} "
                      f"({time.time() - t0:.0f}s)", flush=True)

    dist.barrier()
    best = ckpts.best()
    if best is not None:
        state = torch.load(best, map_location="cpu")
        model.module.load_state_dict(state["model"])
        top1, top5 = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"[final] reloaded {os.path.basename(best)}: top1 {top1:.4f} top5 {top5:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
