"""
Fine-grained classification (EfficientNetV2-S) on our Slurm cluster, 2 nodes x 4 GPUs.
Validation top-1 / top-5 every epoch (all-reduced), best checkpoint + early stopping.

Works under torchrun on a workstation, and under plain srun on the cluster:

    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=10
    srun python 20_slurm_cls_early_stop.py --data /scratch/$USER/inat_birds --out /scratch/$USER/runs/effv2s
"""
import argparse
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=80)
    p.add_argument("--batch-size", type=int, default=48, help="per GPU")
    p.add_argument("--base-lr", type=float, default=0.1, help="SGD lr for a global batch of 256")
    p.add_argument("--warmup-epochs", type=int, default=3)
    p.add_argument("--patience", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--port", type=int, default=29571)
    return p.parse_args()


def init_distributed(port):
    if "RANK" in os.environ:  # torchrun
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    else:  # srun: one task per GPU
        rank = int(os.environ["SLURM_PROCID"])
        world_size = int(os.environ["SLURM_NTASKS"])
        hosts = subprocess.check_output(["scontrol", "show", "hostnames", os.environ["SLURM_NODELIST"]])
        os.environ["MASTER_ADDR"] = hosts.decode().split()[0]
        os.environ["MASTER_PORT"] = str(port)
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://")
    return rank, world_size, local_rank


def build_data(args, rank, world_size):
    norm = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(384, scale=(0.25, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.TrivialAugmentWide(),
        transforms.ToTensor(), norm,
        transforms.RandomErasing(p=0.1)])
    val_tf = transforms.Compose([transforms.Resize(416), transforms.CenterCrop(384), transforms.ToTensor(), norm])
    train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf)
    val_shard = Subset(val_set, list(range(rank, len(val_set), world_size)))

    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=args.batch_size * 2, num_workers=args.workers, pin_memory=True)
    return train_loader, val_loader, train_sampler, len(train_set.classes)


@torch.no_grad()
def validate(model, loader, device):
    model.eval()
    stats = torch.zeros(4, device=device, dtype=torch.float64)  # top1, top5, n, loss_sum
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).float()
        top5 = logits.topk(5, 1).indices
        stats[0] += (top5[:, 0] == y).sum()
        stats[1] += (top5 == y[:, None]).any(1).sum()
        stats[2] += y.numel()
        stats[3] += F.cross_entropy(logits, y, reduction="sum")
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item() * 100, (stats[1] / stats[2]).item() * 100, (stats[3] / stats[2]).item()


def main():
    args = parse_args()
    rank, world_size, local_rank = init_distributed(args.port)
    device = torch.device("cuda", local_rank)
    torch.backends.cudnn.benchmark = True

    train_loader, val_loader, train_sampler, num_classes = build_data(args, rank, world_size)
    model = torchvision.models.efficientnet_v2_s(weights="IMAGENET1K_V1")
    model.classifier[1] = nn.Linear(model.classifier[1].in_features, num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.base_lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=2e-5, nesterov=True)
    iters = len(train_loader)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=args.warmup_epochs * iters)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=(args.epochs - args.warmup_epochs) * iters)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine],
                                                      milestones=[args.warmup_epochs * iters])
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world_size={world_size} classes={num_classes} lr={lr:.4f} iters/epoch={iters}", flush=True)

    best_top1, bad_epochs = 0.0, 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and i % 100 == 0:
                print(f"ep {epoch} it {i}/{iters} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.5f}",
                      flush=True)

        top1, top5, vloss = validate(model.module, val_loader, device)
        # top1 is all-reduced, so every rank takes the same early-stopping decision
        improved = top1 > best_top1
        if improved:
            best_top1, bad_epochs = top1, 0
        else:
            bad_epochs += 1
        if rank == 0:
            print(f"epoch {epoch}: val top1 {top1:.2f} top5 {top5:.2f} loss {vloss:.4f} "
                  f"(best {best_top1:.2f}) {time.time() - t0:.0f}s", flush=True)
            ckpt = {"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "best_top1": best_top1}
            torch.save(ckpt, os.path.join(args.out, "last.pth"))
            if improved:
                torch.save(ckpt, os.path.join(args.out, "best.pth"))
        if bad_epochs >= args.patience:
            if rank == 0:
                print(f"no improvement for {args.patience} epochs, stopping at epoch {epoch}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
