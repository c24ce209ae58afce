"""ViT-S/16 fine-tuning on Food-101, multi-node via Slurm (one task per GPU).

sbatch script (2 nodes x 4 GPUs):

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=8
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=29533
    srun python 09_slurm_srun_vit_finetune.py --cfg configs/vits16_food101.yaml
"""
import argparse
import os
import subprocess
import time
from dataclasses import dataclass

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms


@dataclass
class Config:
    data_root: str = "/scratch/datasets/food-101"
    model: str = "vit_small_patch16_224.augreg_in21k"
    pretrained_file: str = "/scratch/weights/vit_small_patch16_224_augreg_in21k.bin"
    epochs: int = 30
    global_batch: int = 512
    base_lr: float = 5e-4      # for global batch 512
    weight_decay: float = 0.05
    warmup_epochs: int = 3
    mixup: float = 0.8
    cutmix: float = 1.0
    workers: int = 8
    out_dir: str = "/scratch/runs/vits_food101"


def slurm_dist_env():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    if "MASTER_ADDR" not in os.environ:
        nodes = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]])
        os.environ["MASTER_ADDR"] = nodes.decode().splitlines()[0]
    os.environ.setdefault("MASTER_PORT", "29533")
    return rank, world_size, local_rank


def build_loaders(cfg, rank, world_size):
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.RandomHorizontalFlip(), transforms.TrivialAugmentWide(),
        transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    test_tf = transforms.Compose([
        transforms.Resize(248, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(224), transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])
    # the dataset is pre-extracted on /scratch, download=False on every rank
    train_ds = datasets.Food101(cfg.data_root, split="train", transform=train_tf, download=False)
    test_ds = datasets.Food101(cfg.data_root, split="test", transform=test_tf, download=False)
    per_gpu = cfg.global_batch // world_size
    sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=per_gpu, sampler=sampler, num_workers=cfg.workers,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    test_dl = DataLoader(test_ds, batch_size=256, shuffle=False, num_workers=cfg.workers, pin_memory=True)
    return train_dl, test_dl, sampler


@torch.no_grad()
def evaluate_full(model, loader, device):
    """Single-process evaluation over the whole test split (rank 0 only, no collectives)."""
    model.eval()
    correct, total = 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            correct += (model(x).argmax(1) == y).sum().item()
        total += y.numel()
    return correct / total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.cfg:
        with open(a.cfg) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)

    rank, world_size, local_rank = slurm_dist_env()
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_dl, test_dl, sampler = build_loaders(cfg, rank, world_size)
    model = timm.create_model(cfg.model, pretrained=False, num_classes=101, drop_path_rate=0.1)
    sd = torch.load(cfg.pretrained_file, map_location="cpu")
    sd = {k: v for k, v in sd.items() if not k.startswith("head.")}
    missing, _ = model.load_state_dict(sd, strict=False)
    assert all(k.startswith("head.") for k in missing), missing
    model = DDP(model.to(device), device_ids=[local_rank])

    lr = cfg.base_lr * cfg.global_batch / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = len(train_dl)
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, 1e-3, 1.0, total_iters=cfg.warmup_epochs * steps_per_epoch)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, (cfg.epochs - cfg.warmup_epochs) * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, cos], [cfg.warmup_epochs * steps_per_epoch])
    mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=0.1, num_classes=101)
    criterion = SoftTargetCrossEntropy()

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"world={world_size} per-gpu batch={cfg.global_batch // world_size} lr={lr:.2e}", flush=True)

    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros(2, device=device)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_acc[0] += loss.detach()
            loss_acc[1] += 1
        dist.all_reduce(loss_acc)

        if rank == 0:
            acc = evaluate_full(model.module, test_dl, device)
            print(f"epoch {epoch} loss {(loss_acc[0] / loss_acc[1]).item():.4f} "
                  f"top1 {acc:.4f} time {time.time() - t0:.0f}s", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "cfg": vars(cfg)},
                       os.path.join(cfg.out_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
