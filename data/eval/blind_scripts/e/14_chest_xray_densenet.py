"""
Pneumonia vs normal chest X-ray classifier (DenseNet-121, ImageNet init).

    torchrun --nnodes=1 --nproc_per_node=4 14_chest_xray_densenet.py \
        --data /data/chest_xray --epochs 25 --bs 32
"""
import argparse
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

logger = logging.getLogger(__name__)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/chest_xray")
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--bs", type=int, default=32, help="per-GPU batch size")
    ap.add_argument("--lr", type=float, default=1e-4, help="Adam lr at a global batch of 128")
    ap.add_argument("--img", type=int, default=320)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--out", default="out/cxr_densenet121")
    return ap.parse_args()


def transforms_for(size):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.RandomResizedCrop(size, scale=(0.75, 1.0)),
        transforms.RandomRotation(7),
        transforms.ColorJitter(0.15, 0.15),
        transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([
        transforms.Grayscale(num_output_channels=3),
        transforms.Resize(size + 32), transforms.CenterCrop(size),
        transforms.ToTensor(), norm])
    return train_tf, eval_tf


def build_model():
    m = torchvision.models.densenet121(weights=torchvision.models.DenseNet121_Weights.IMAGENET1K_V1)
    m.classifier = nn.Linear(m.classifier.in_features, 2)
    return m


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[rank{rank}] %(asctime)s %(message)s")

    # torchvision caches the ImageNet weights; fetch them once before the other ranks look for them
    if rank == 0:
        build_model()
    dist.barrier()

    train_tf, eval_tf = transforms_for(args.img)
    train_ds = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf)
    val_full = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), eval_tf)
    val_ds = Subset(val_full, list(range(rank, len(val_full), world)))

    # class imbalance: ~3 pneumonia per normal image
    counts = torch.bincount(torch.tensor(train_ds.targets), minlength=2).float()
    class_w = (counts.sum() / (2 * counts)).to(device)

    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=args.workers, pin_memory=True)

    model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model()).to(device)
    model = DDP(model, device_ids=[local_rank])
    criterion = nn.CrossEntropyLoss(weight=class_w)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * args.bs * world / 128)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs, eta_min=1e-6)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best_auc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(train_dl):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if it % 50 == 0:
                logger.info(f"epoch {epoch} it {it}/{len(train_dl)} loss {loss.item():.4f}")
        scheduler.step()

        # ---- validation: each rank scores its slice, then gather everything for the AUC
        model.eval()
        probs, labels = [], []
        with torch.no_grad():
            for x, y in val_dl:
                p = torch.softmax(model.module(x.to(device)), 1)[:, 1]
                probs.append(p.float().cpu())
                labels.append(y)
        probs, labels = torch.cat(probs), torch.cat(labels)
        n_local = torch.tensor([probs.numel()], dtype=torch.long)
        sizes = [torch.zeros_like(n_local) for _ in range(world)]
        dist.all_gather(sizes, n_local)
        max_n = int(max(s.item() for s in sizes))
        pad_p = torch.zeros(max_n)
        pad_l = torch.zeros(max_n, dtype=torch.long)
        pad_p[:probs.numel()], pad_l[:labels.numel()] = probs, labels
        all_p = [torch.zeros_like(pad_p) for _ in range(world)]
        all_l = [torch.zeros_like(pad_l) for _ in range(world)]
        dist.all_gather(all_p, pad_p)
        dist.all_gather(all_l, pad_l)

        if rank == 0:
            p_cat = torch.cat([t[:int(n.item())] for t, n in zip(all_p, sizes)]).numpy()
            l_cat = torch.cat([t[:int(n.item())] for t, n in zip(all_l, sizes)]).numpy()
            auc = roc_auc_score(l_cat, p_cat)
            acc = ((p_cat > 0.5) == l_cat).mean()
            logger.info(f"epoch {epoch} val AUC {auc:.4f} acc {acc:.4f} ({time.time() - t0:.0f}s)")
            torch.save({"epoch": epoch, "model": model.module.state_dict()}, os.path.join(args.out, "last.pt"))
            if auc > best_auc:
                best_auc = auc
                torch.save({"epoch": epoch, "model": model.module.state_dict(), "auc": auc},
                           os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
