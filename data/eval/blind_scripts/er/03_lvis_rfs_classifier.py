"""Region classifier on LVIS v1 object crops with repeat-factor sampling + focal loss.

Crops are pre-extracted (see tools/extract_lvis_crops.py) into
<root>/crops/{train,val}/<ann_id>.jpg with an index file crops_{split}.json:
    [{"file": "train/123.jpg", "category_id": 17, "frequency": "r"}, ...]

Repeat-factor sampling as in Gupta et al. (LVIS, CVPR 2019):
    r_c = max(1, sqrt(t / f_c)),  t = 0.001

    torchrun --nnodes=1 --nproc_per_node=8 lvis_rfs_classifier.py --config configs/lvis_crops_r50.yaml
"""
import argparse
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import timm
import yaml
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms


DEFAULTS = dict(
    root="/data/lvis_crops", model="resnet50", pretrained=True, epochs=24,
    batch_size=64, lr=0.02, weight_decay=1e-4, rfs_thresh=1e-3, gamma=2.0,
    workers=8, out_dir="work_dirs/lvis_crops_r50", seed=42, log_interval=50,
)


class LVISCrops(Dataset):
    def __init__(self, root, split, transform):
        with open(os.path.join(root, f"crops_{split}.json")) as f:
            self.items = json.load(f)
        self.root, self.transform = root, transform
        # LVIS v1 category ids are contiguous 1..1203
        self.labels = [it["category_id"] - 1 for it in self.items]
        self.freq_group = {it["category_id"] - 1: it["frequency"] for it in self.items}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, "crops", self.items[i]["file"])).convert("RGB")
        return self.transform(img), self.labels[i]


class DistributedRepeatFactorSampler(Sampler):
    def __init__(self, labels, num_classes, thresh, num_replicas, rank, seed=0):
        counts = torch.bincount(torch.tensor(labels), minlength=num_classes).float()
        freq = counts / len(labels)
        cls_rf = torch.clamp(torch.sqrt(thresh / freq.clamp(min=1e-12)), min=1.0)
        self.rep = cls_rf[torch.tensor(labels)]
        self.num_replicas, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0
        self.expected = math.ceil(self.rep.sum().item() / num_replicas)

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _indices(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        int_part = torch.trunc(self.rep)
        frac = self.rep - int_part
        reps = int_part + (torch.rand(len(frac), generator=g) < frac).float()
        idx = torch.repeat_interleave(torch.arange(len(reps)), reps.long())
        idx = idx[torch.randperm(len(idx), generator=g)]
        # pad / truncate to a fixed length so every rank yields exactly self.expected indices
        total = self.expected * self.num_replicas
        idx = idx.repeat(math.ceil(total / len(idx)))[:total]
        return idx[self.rank::self.num_replicas]

    def __iter__(self):
        return iter(self._indices().tolist())

    def __len__(self):
        return self.expected


class FocalLoss(nn.Module):
    def __init__(self, gamma=2.0):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, target):
        logp = F.log_softmax(logits.float(), dim=1)
        logp_t = logp.gather(1, target[:, None]).squeeze(1)
        return (-(1 - logp_t.exp()) ** self.gamma * logp_t).mean()


@torch.no_grad()
def evaluate(model, loader, dataset, num_classes, device):
    model.eval()
    hits = torch.zeros(num_classes, device=device)
    seen = torch.zeros(num_classes, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(x).argmax(1)
        seen += torch.bincount(y, minlength=num_classes)
        hits += torch.bincount(y, weights=(pred == y).float(), minlength=num_classes)
    dist.all_reduce(hits)
    dist.all_reduce(seen)
    acc = hits / seen.clamp(min=1)
    res = {"acc": (hits.sum() / seen.sum()).item()}
    for grp in ("r", "c", "f"):
        ids = [c for c, g in dataset.freq_group.items() if g == grp and seen[c] > 0]
        res[f"acc_{grp}"] = acc[ids].mean().item() if ids else float("nan")
    return res


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    cfg = dict(DEFAULTS)
    with open(args.config) as f:
        cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"] + rank)

    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    train_tf = transforms.Compose([
        transforms.RandomResizedCrop(224, scale=(0.5, 1.0)), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    val_tf = transforms.Compose([
        transforms.Resize((224, 224)), transforms.ToTensor(), transforms.Normalize(mean, std)])
    train_set = LVISCrops(cfg["root"], "train", train_tf)
    val_set = LVISCrops(cfg["root"], "val", val_tf)
    num_classes = 1203

    sampler = DistributedRepeatFactorSampler(train_set.labels, num_classes, cfg["rfs_thresh"],
                                             world, rank, seed=cfg["seed"])
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    val_idx = list(range(rank, len(val_set), world))
    val_loader = DataLoader(torch.utils.data.Subset(val_set, val_idx), batch_size=256,
                            num_workers=cfg["workers"], pin_memory=True)

    model = timm.create_model(cfg["model"], pretrained=cfg["pretrained"], num_classes=num_classes)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    lr = cfg["lr"] * cfg["batch_size"] * world / 256
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=cfg["weight_decay"])
    steps = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps,
                                                    pct_start=0.05, anneal_strategy="cos")
    scaler = torch.cuda.amp.GradScaler()
    criterion = FocalLoss(cfg["gamma"])

    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["epoch"] + 1

    for epoch in range(start, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(train_loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = criterion(logits, y)
            if not torch.isfinite(loss):
                if rank == 0:
                    print(f"non-finite loss at epoch {epoch} step {step}, skipping batch", flush=True)
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 35.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if rank == 0 and step % cfg["log_interval"] == 0:
                print(f"ep {epoch} [{step}/{len(train_loader)}] loss {loss.item():.4f} "
                      f"lr {scheduler.get_last_lr()[0]:.5f}", flush=True)

        res = evaluate(model, val_loader, val_set, num_classes, device)
        if rank == 0:
            print(f"== epoch {epoch}: acc {res['acc']:.4f} rare {res['acc_r']:.4f} "
                  f"common {res['acc_c']:.4f} frequent {res['acc_f']:.4f}", flush=True)
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "epoch": epoch, "cfg": cfg}, os.path.join(cfg["out_dir"], f"epoch_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
