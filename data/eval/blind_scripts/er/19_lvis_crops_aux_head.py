"""LVIS v1 object-crop classification: repeat-factor sampling + a deferred balanced-softmax
auxiliary head (switched on at `--aux-start`), early stopping on rare-class accuracy.

Crops index: <root>/crops_{train,val}.json, list of {"file", "category_id", "frequency"}.
Per-category statistics are cached in <cache-dir> the first time the script runs.

    torchrun --nproc_per_node=8 lvis_crops_aux_head.py --root /data/lvis_crops --cache-dir /data/lvis_crops/cache
"""
import argparse
import json
import os
import pickle

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

NUM_CLASSES = 1203


class Crops(Dataset):
    def __init__(self, root, split, tf):
        with open(os.path.join(root, f"crops_{split}.json")) as f:
            items = json.load(f)
        self.files = [os.path.join(root, "crops", it["file"]) for it in items]
        self.labels = np.array([it["category_id"] - 1 for it in items], dtype=np.int64)
        self.tf = tf

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB")), int(self.labels[i])


def category_stats(root, cache_dir, local_rank):
    """Counts and frequency groups from the train index; built once per node, then read by all."""
    path = os.path.join(cache_dir, "lvis_crop_stats.pkl")
    if local_rank == 0 and not os.path.exists(path):
        with open(os.path.join(root, "crops_train.json")) as f:
            items = json.load(f)
        counts = np.zeros(NUM_CLASSES, dtype=np.int64)
        group = np.full(NUM_CLASSES, "r", dtype="<U1")
        for it in items:
            counts[it["category_id"] - 1] += 1
            group[it["category_id"] - 1] = it["frequency"]
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump({"counts": counts, "group": group}, f)
        os.replace(tmp, path)
    dist.barrier()
    with open(path, "rb") as f:
        return pickle.load(f)


class RepeatFactorSampler(Sampler):
    def __init__(self, labels, counts, t, rank, world, seed=0):
        freq = counts / counts.sum()
        rf = np.maximum(1.0, np.sqrt(t / np.maximum(freq, 1e-12)))[labels]
        self.int_part, self.frac = np.floor(rf), rf - np.floor(rf)
        self.rank, self.world, self.seed, self.epoch = rank, world, seed, 0
        self.num_samples = int(np.ceil(rf.sum() / world))

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)  # identical on every rank
        reps = (self.int_part + (rng.random(len(self.frac)) < self.frac)).astype(np.int64)
        idx = rng.permutation(np.repeat(np.arange(len(reps)), reps))
        total = self.num_samples * self.world
        idx = np.resize(idx, total)  # repeats from the start if short, truncates if long
        return iter(idx[self.rank:total:self.world].tolist())

    def __len__(self):
        return self.num_samples


class CropClassifier(nn.Module):
    def __init__(self, arch, num_classes):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True, num_classes=0)
        d = self.backbone.num_features
        self.head = nn.Linear(d, num_classes)
        self.aux_head = nn.Linear(d, num_classes)

    def forward(self, x, use_aux=False):
        f = self.backbone(x)
        return self.head(f), (self.aux_head(f) if use_aux else None)


@torch.no_grad()
def evaluate(net, loader, n_total, stats, use_aux, device):
    """DistributedSampler(shuffle=False) pads by wrapping around; those tail positions are masked out."""
    net.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    hit = torch.zeros(NUM_CLASSES, device=device)
    tot = torch.zeros(NUM_CLASSES, device=device)
    pos = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits, aux = net(x, use_aux=use_aux)
        if aux is not None:
            logits = 0.5 * (logits.softmax(1) + aux.softmax(1))
        keep = (rank + world * torch.arange(pos, pos + y.numel(), device=device)) < n_total
        pos += y.numel()
        ok = ((logits.argmax(1) == y) & keep).float()
        tot += torch.bincount(y, weights=keep.float(), minlength=NUM_CLASSES)
        hit += torch.bincount(y, weights=ok, minlength=NUM_CLASSES)
    dist.all_reduce(hit)
    dist.all_reduce(tot)
    acc = (hit / tot.clamp(min=1)).cpu().numpy()
    seen = tot.cpu().numpy() > 0
    out = {"acc": (hit.sum() / tot.sum()).item()}
    for g in "rcf":
        m = seen & (stats["group"] == g)
        out[f"acc_{g}"] = float(acc[m].mean()) if m.any() else 0.0
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--arch", default="convnext_tiny")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--aux-start", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=64, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW lr at total batch 512")
    ap.add_argument("--rfs-t", type=float, default=1e-3)
    ap.add_argument("--patience", type=int, default=5)
    ap.add_argument("--out", default="work/lvis_crops_aux")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    stats = category_stats(args.root, args.cache_dir, local_rank)
    log_prior = torch.log(torch.tensor(stats["counts"] / stats["counts"].sum(), dtype=torch.float32,
                                       device=device).clamp(min=1e-12))

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_set = Crops(args.root, "train", transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.4, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(mean, std)]))
    val_set = Crops(args.root, "val", transforms.Compose([
        transforms.Resize((224, 224)), transforms.ToTensor(), transforms.Normalize(mean, std)]))
    sampler = RepeatFactorSampler(train_set.labels, stats["counts"], args.rfs_t, rank, world)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=128, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, pin_memory=True)

    net = CropClassifier(args.arch, NUM_CLASSES).to(device)
    # aux_head gets no gradient before --aux-start
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    lr = args.lr * args.batch_size * world / 512
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=args.epochs * len(loader),
                                                    pct_start=0.05)

    run = wandb.init(project="lvis-crops", config=vars(args)) if rank == 0 else None
    best, bad_epochs = -1.0, 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        use_aux = epoch >= args.aux_start
        model.train()
        for it, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, aux = model(x, use_aux=use_aux)
            loss = F.cross_entropy(logits.float(), y)
            if aux is not None:
                loss = loss + F.cross_entropy(aux.float() + log_prior, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if run is not None and it % 50 == 0:
                run.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]})

        res = evaluate(model.module, val_loader, len(val_set), stats, use_aux, device)
        stop = torch.zeros(1, device=device)
        if rank == 0:
            run.log({f"val/{k}": v for k, v in res.items()} | {"epoch": epoch})
            print(f"epoch {epoch}: " + " ".join(f"{k} {100 * v:.2f}" for k, v in res.items()), flush=True)
            if res["acc_r"] > best:
                best, bad_epochs = res["acc_r"], 0
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "res": res},
                           os.path.join(args.out, "best.pth"))
            elif use_aux:
                bad_epochs += 1
            stop[0] = float(bad_epochs >= args.patience)
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            break

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
