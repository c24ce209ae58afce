"""iNaturalist 2018, ResNeXt-50 with deferred re-sampling (DRS, Cao et al. 2019 /
"Bag of Tricks for Long-Tailed Visual Recognition", Zhang et al. AAAI 2021).

Instance-balanced sampling for the first `--drs-epoch` epochs, then square-root
(class-balanced with power q=0.5) re-sampling for the rest.

    torchrun --nproc_per_node=8 inat_resnext_drs.py --config configs/inat18_x50_drs.yaml
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

DEFAULTS = {
    "root": "/data/iNat2018",
    "epochs": 90,
    "drs_epoch": 70,
    "q": 0.5,
    "batch_size": 256,        # images per GPU
    "lr": 0.1,                # BoT / Decoupling recipe: 0.1 at batch 256
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "milestones": [60, 80],
    "workers": 12,
    "out": "exp/inat18_x50_drs",
    "seed": 0,
}


class INat(Dataset):
    def __init__(self, root, split, tf):
        with open(os.path.join(root, f"{split}2018.json")) as f:
            d = json.load(f)
        lab = {a["image_id"]: a["category_id"] for a in d["annotations"]}
        self.items = [(im["file_name"], lab[im["id"]]) for im in d["images"]]
        self.targets = np.array([y for _, y in self.items])
        self.num_classes = len(d["categories"])
        self.root, self.tf = root, tf

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        fn, y = self.items[i]
        return self.tf(Image.open(os.path.join(self.root, fn)).convert("RGB")), y


class DistributedPowerSampler(Sampler):
    """p(i) proportional to n_{y_i}^(q-1): q=0 class-balanced, q=0.5 square-root, q=1 instance."""

    def __init__(self, targets, q, num_replicas, rank, seed=0):
        counts = np.bincount(targets)
        w = counts[targets].astype(np.float64) ** (q - 1.0)
        self.p = w / w.sum()
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.per_rank = math.ceil(len(targets) / num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng(self.seed + self.epoch)
        idx = rng.choice(len(self.p), size=self.per_rank * self.num_replicas, replace=True, p=self.p)
        return iter(idx[self.rank::self.num_replicas].tolist())

    def __len__(self):
        return self.per_rank


def make_loader(ds, sampler, cfg):
    return DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                      pin_memory=True, drop_last=True, persistent_workers=False)


@torch.no_grad()
def evaluate(net, loader, train_counts, device):
    net.eval()
    C = len(train_counts)
    hits = torch.zeros(C, device=device, dtype=torch.float64)
    seen = torch.zeros(C, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            p = net(x).argmax(1)
        seen.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
        hits.index_add_(0, y, (p == y).double())
    dist.all_reduce(hits)
    dist.all_reduce(seen)
    acc = (hits / seen.clamp(min=1)).cpu().numpy()
    return dict(top1=(hits.sum() / seen.sum()).item(), many=acc[train_counts > 100].mean(),
                medium=acc[(train_counts >= 20) & (train_counts <= 100)].mean(), few=acc[train_counts < 20].mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    norm = transforms.Normalize([0.466, 0.471, 0.380], [0.195, 0.194, 0.192])
    train_set = INat(cfg["root"], "train", transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
        transforms.ColorJitter(0.4, 0.4, 0.4), transforms.ToTensor(), norm]))
    val_set = INat(cfg["root"], "val", transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), norm]))
    train_counts = np.bincount(train_set.targets, minlength=train_set.num_classes)

    ib_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg["seed"])
    drs_sampler = DistributedPowerSampler(train_set.targets, cfg["q"], world, rank, seed=cfg["seed"])
    val_part = torch.utils.data.Subset(val_set, np.array_split(np.arange(len(val_set)), world)[rank].tolist())
    val_loader = DataLoader(val_part, batch_size=200, num_workers=cfg["workers"], pin_memory=True)

    model = torchvision.models.resnext50_32x4d(num_classes=train_set.num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                                weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=cfg["milestones"], gamma=0.1)
    scaler = torch.cuda.amp.GradScaler()

    start = 0
    if a.resume:
        ck = torch.load(a.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1

    for epoch in range(start, cfg["epochs"]):
        sampler = ib_sampler if epoch < cfg["drs_epoch"] else drs_sampler
        sampler.set_epoch(epoch)
        loader = make_loader(train_set, sampler, cfg)
        model.train()
        t0 = time.time()
        for it, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} {'DRS' if epoch >= cfg['drs_epoch'] else 'IB'} "
                      f"[{it}/{len(loader)}] loss {loss.item():.4f} lr {optimizer.param_groups[0]['lr']:.4f}",
                      flush=True)
        scheduler.step()

        r = evaluate(model.module, val_loader, train_counts, device)
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s: top1 {100 * r['top1']:.2f} "
                  f"many {100 * r['many']:.2f} medium {100 * r['medium']:.2f} few {100 * r['few']:.2f}",
                  flush=True)
            os.makedirs(cfg["out"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out"], "latest.pth"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
