"""Plant-disease image classifier (ResNet-50, ImageFolder), multi-node on Slurm.

Job script (excerpt):
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gres=gpu:4
    #SBATCH --cpus-per-task=8
    export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
    export MASTER_PORT=29517
    srun python 04_plant_disease_resnet_slurm.py --archive $PROJECT/data/plantvillage.tar
"""
import argparse
import datetime
import json
import os
import shutil
import tarfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.datasets import ImageFolder


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--archive", required=True, help="tar of an ImageFolder tree (one folder per class)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1, help="for a global batch of 256")
    p.add_argument("--wd", type=float, default=1e-4)
    p.add_argument("--val-frac", type=float, default=0.15)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def setup():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ["SLURM_LOCALID"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=60))
    return rank, world_size, local_rank


def stage_dataset(archive, local_rank):
    """Unpack the archive once per node onto the node's fast local disk."""
    root = os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), "plantvillage")
    done = root + ".done"
    if local_rank == 0 and not os.path.exists(done):
        shutil.rmtree(root, ignore_errors=True)
        with tarfile.open(archive) as tf:
            tf.extractall(os.path.dirname(root))
        open(done, "w").close()
    dist.barrier()
    return root


def stratified_split(targets, val_frac, seed):
    g = torch.Generator().manual_seed(seed)
    targets = torch.as_tensor(targets)
    train_idx, val_idx = [], []
    for c in targets.unique(sorted=True):
        idx = (targets == c).nonzero().flatten()
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_val = max(1, int(len(idx) * val_frac))
        val_idx += idx[:n_val].tolist()
        train_idx += idx[n_val:].tolist()
    return sorted(train_idx), sorted(val_idx)


def build_loaders(root, args, rank, world_size):
    normalize = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                                   transforms.ColorJitter(0.2, 0.2, 0.2), transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])
    # ImageFolder sorts class folders, so class_to_idx is identical on every rank
    train_full = ImageFolder(root, transform=train_tf)
    val_full = ImageFolder(root, transform=val_tf)
    train_idx, val_idx = stratified_split(train_full.targets, args.val_frac, args.seed)
    train_ds, val_ds = Subset(train_full, train_idx), Subset(val_full, val_idx)
    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world_size, rank=rank, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=args.workers, pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler,
                            num_workers=args.workers, pin_memory=True)
    return train_full.class_to_idx, train_sampler, train_loader, val_loader


def main():
    args = get_args()
    rank, world_size, local_rank = setup()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    root = stage_dataset(args.archive, local_rank)
    class_to_idx, train_sampler, train_loader, val_loader = build_loaders(root, args, rank, world_size)

    model = torchvision.models.resnet50(weights="IMAGENET1K_V2")
    model.fc = nn.Linear(model.fc.in_features, len(class_to_idx))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = args.lr * args.batch_size * world_size / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.wd, nesterov=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    ckpt_dir = os.path.join(os.environ.get("SLURM_TMPDIR", "/tmp"), "checkpoints")
    os.makedirs(ckpt_dir, exist_ok=True)
    ckpt_path = os.path.join(ckpt_dir, "last.pt")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch = ckpt["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and i % 50 == 0:
                print(f"ep {epoch} it {i}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        model.eval()
        totals = torch.zeros(3, device=device)
        with torch.no_grad(), torch.cuda.amp.autocast():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                logits = model(x)
                totals[0] += criterion(logits, y).float() * y.size(0)
                totals[1] += (logits.argmax(1) == y).sum()
                totals[2] += y.size(0)
        dist.all_reduce(totals)
        if rank == 0:
            print(json.dumps({"epoch": epoch, "val_loss": (totals[0] / totals[2]).item(),
                              "val_acc": (totals[1] / totals[2]).item(), "sec": round(time.time() - t0)}), flush=True)
            if (epoch + 1) % args.save_every == 0 or epoch + 1 == args.epochs:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                            "epoch": epoch, "class_to_idx": class_to_idx}, ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
