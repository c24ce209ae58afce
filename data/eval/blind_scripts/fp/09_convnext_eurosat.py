"""ConvNeXt-T fine-tuning on EuroSAT (land-cover classification), DDP.

    torchrun --standalone --nproc-per-node=4 --max-restarts=2 09_convnext_eurosat.py \
        --data /datasets/EuroSAT_RGB --out /shared/exp/eurosat-convnext

Resumable: model / optimizer / scheduler / epoch plus each rank's RNG streams are
checkpointed, so a restarted job reproduces the augmentations it would have used.
"""
import argparse
import os
import random
import signal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, random_split
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

_GOT_SIGTERM = False


def _on_signal(signum, frame):
    global _GOT_SIGTERM
    _GOT_SIGTERM = True


class WithTransform(Dataset):
    def __init__(self, subset, transform):
        self.subset = subset
        self.transform = transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        img, label = self.subset[i]
        return self.transform(img), label


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)


def rng_state():
    return {"py": random.getstate(), "np": np.random.get_state(),
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()}


def set_rng_state(s):
    random.setstate(s["py"])
    np.random.set_state(s["np"])
    torch.set_rng_state(s["torch"])
    torch.cuda.set_rng_state(s["cuda"])


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--bs", type=int, default=64, help="per process")
    ap.add_argument("--lr", type=float, default=4e-4, help="for the global batch of 256 (4 x 64)")
    ap.add_argument("--val-frac", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=7)
    return ap.parse_args()


def main():
    args = get_args()
    signal.signal(signal.SIGTERM, _on_signal)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_all(args.seed + rank)  # different augmentation stream on every rank

    full = datasets.ImageFolder(args.data)
    n_val = int(len(full) * args.val_frac)
    train_sub, val_sub = random_split(full, [len(full) - n_val, n_val])
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_set = WithTransform(train_sub, transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomVerticalFlip(),
        transforms.ColorJitter(0.2, 0.2, 0.2),
        transforms.ToTensor(), norm]))
    val_set = WithTransform(val_sub, transforms.Compose([
        transforms.Resize(224), transforms.ToTensor(), norm]))

    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=train_sampler, num_workers=6,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, num_workers=4,
                            sampler=DistributedSampler(val_set, shuffle=False))

    model = models.convnext_tiny(weights=models.ConvNeXt_Tiny_Weights.IMAGENET1K_V1)
    model.classifier[2] = nn.Linear(model.classifier[2].in_features, len(full.classes))
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, epochs=args.epochs,
                                                    steps_per_epoch=len(train_loader), pct_start=0.1)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    ckpt_dir = os.path.join(args.out, "ckpt")
    start_epoch, best = 0, 0.0
    if os.path.exists(os.path.join(ckpt_dir, "train_state.pt")):
        st = torch.load(os.path.join(ckpt_dir, "train_state.pt"), map_location="cpu")
        model.load_state_dict(st["model"])
        optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        start_epoch, best = st["epoch"], st["best"]
        rng_file = os.path.join(ckpt_dir, f"rng_{rank}.pt")
        if st["world"] == world and os.path.exists(rng_file):
            set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
        if rank == 0:
            print(f"resumed at epoch {start_epoch}, best acc so far {best:.4f}")

    model = DDP(model, device_ids=[local_rank])
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    def save(epoch, best):
        if rank == 0:
            os.makedirs(ckpt_dir, exist_ok=True)
        dist.barrier()
        torch.save(rng_state(), os.path.join(ckpt_dir, f"rng_{rank}.pt"))
        if rank == 0:
            tmp = os.path.join(ckpt_dir, "train_state.pt.tmp")
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best": best,
                        "world": world}, tmp)
            os.replace(tmp, os.path.join(ckpt_dir, "train_state.pt"))
        dist.barrier()

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        running = torch.zeros(2, device=device)
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            running += torch.stack([loss.detach().float() * y.size(0), torch.tensor(float(y.size(0)), device=device)])

        model.eval()
        hits = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, y in val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                pred = model(x).argmax(1)
                hits += torch.stack([(pred == y).sum().float(), torch.tensor(float(y.numel()), device=device)])
        dist.all_reduce(running)
        dist.all_reduce(hits)
        acc = (hits[0] / hits[1]).item()
        if rank == 0:
            print(f"epoch {epoch:02d} train_loss {running[0].item() / running[1].item():.4f} val_acc {acc:.4f}")
            if acc > best:
                torch.save(model.module.state_dict(), os.path.join(args.out, "best.pt"))
        best = max(best, acc)

        save(epoch + 1, best)
        stop = torch.tensor([float(_GOT_SIGTERM)], device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            if rank == 0:
                print("terminating after SIGTERM; state saved", flush=True)
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
