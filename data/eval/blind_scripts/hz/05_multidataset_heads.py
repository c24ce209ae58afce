"""Joint training on several IQA databases with per-database heads.

MOS scales and rater pools differ between databases, so a shared ConvNeXt
backbone feeds one small regression head per database, and every mini-batch is
drawn from a single database so that the in-batch ranking loss only compares
images that were rated on the same scale.

    torchrun --nproc_per_node=4 05_multidataset_heads.py --config configs/joint_iqa.json
"""
import argparse
import json
import math
import os

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from scipy import stats
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

NORM = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class IQADataset(Dataset):
    def __init__(self, source_id, root, csv, mos_min, mos_max, size, train):
        df = pd.read_csv(csv)
        self.source_id, self.root = source_id, root
        self.files = df["image"].tolist()
        self.mos = ((df["mos"].values - mos_min) / (mos_max - mos_min)).astype(np.float32)
        if train:
            self.tf = T.Compose([T.RandomCrop(size, pad_if_needed=True), T.RandomHorizontalFlip(), T.ToTensor(), NORM])
        else:
            self.tf = T.Compose([T.CenterCrop(size), T.ToTensor(), NORM])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        img = Image.open(os.path.join(self.root, self.files[i])).convert("RGB")
        return self.tf(img), self.mos[i], i, self.source_id


class SingleSourceBatchSampler(Sampler):
    """Yields per-rank batches; every global step draws from one source dataset."""

    def __init__(self, sizes, batch_size, num_replicas, rank, seed=0):
        self.sizes, self.bs = sizes, batch_size
        self.world, self.rank, self.seed, self.epoch = num_replicas, rank, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _global_batches(self, g):
        out, offset = [], 0
        gbs = self.bs * self.world
        for size in self.sizes:
            perm = torch.randperm(size, generator=g) + offset
            for k in range(size // gbs):
                out.append(perm[k * gbs:(k + 1) * gbs])
            offset += size
        return out

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        batches = self._global_batches(g)
        for j in torch.randperm(len(batches), generator=g).tolist():
            yield batches[j][self.rank * self.bs:(self.rank + 1) * self.bs].tolist()

    def __len__(self):
        gbs = self.bs * self.world
        return sum(s // gbs for s in self.sizes)


class JointIQA(nn.Module):
    def __init__(self, arch, names):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=True, num_classes=0, drop_path_rate=0.1)
        d = self.backbone.num_features
        self.heads = nn.ModuleDict({n: nn.Sequential(nn.Linear(d, 256), nn.GELU(), nn.Linear(256, 1))
                                    for n in names})

    def forward(self, x, source):
        return self.heads[source](self.backbone(x)).squeeze(-1)


def margin_rank_loss(pred, mos, margin=0.02):
    i, j = torch.triu_indices(len(pred), len(pred), 1, device=pred.device)
    sign = torch.sign(mos[i] - mos[j])
    valid = sign != 0
    return F.relu(margin - sign[valid] * (pred[i] - pred[j])[valid]).mean() if valid.any() else pred.sum() * 0


@torch.no_grad()
def evaluate(model, name, ds, device, batch_size, workers):
    loader = DataLoader(ds, batch_size=batch_size, sampler=DistributedSampler(ds, shuffle=False),
                        num_workers=workers, pin_memory=True)
    model.eval()
    out = []
    for x, y, idx, _ in loader:
        p = model.module(x.to(device, non_blocking=True), name)
        out.append(torch.stack([p.float(), y.to(device), idx.to(device).float()], 1))
    out = torch.cat(out)
    full = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(full, out)
    full = torch.cat(full).cpu().numpy()
    _, keep = np.unique(full[:, 2].astype(int), return_index=True)
    full = full[keep]
    model.train()
    return stats.spearmanr(full[:, 0], full[:, 1])[0], stats.pearsonr(full[:, 0], full[:, 1])[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    cfg = json.load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    names = [d["name"] for d in cfg["datasets"]]
    train_parts, test_parts = [], {}
    for k, d in enumerate(cfg["datasets"]):
        train_parts.append(IQADataset(k, d["root"], d["train_csv"], d["mos_min"], d["mos_max"],
                                      cfg["crop"], train=True))
        test_parts[d["name"]] = IQADataset(k, d["root"], d["test_csv"], d["mos_min"], d["mos_max"],
                                           cfg["crop"], train=False)
    train_set = ConcatDataset(train_parts)
    batch_sampler = SingleSourceBatchSampler([len(p) for p in train_parts], cfg["batch_size"], world, rank,
                                             seed=cfg.get("seed", 0))
    train_loader = DataLoader(train_set, batch_sampler=batch_sampler, num_workers=cfg["workers"],
                              pin_memory=True, persistent_workers=True)

    model = JointIQA(cfg["arch"], names).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.module.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg["lr"])
    total = cfg["epochs"] * len(train_loader)
    warm = cfg.get("warmup_steps", 300)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    best = -1.0
    for epoch in range(cfg["epochs"]):
        batch_sampler.set_epoch(epoch)
        model.train()
        for step, (x, y, _, src) in enumerate(train_loader):
            source = names[int(src[0])]  # the whole batch comes from one database
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, source).float()
            loss = F.smooth_l1_loss(pred, y, beta=0.1) + cfg.get("rank_weight", 1.0) * margin_rank_loss(pred, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sched.step()
            if rank == 0 and step % 100 == 0:
                print(f"ep {epoch} step {step}/{len(train_loader)} [{source}] loss {loss.item():.4f}", flush=True)

        results = {n: evaluate(model, n, test_parts[n], device, cfg["batch_size"], cfg["workers"]) for n in names}
        mean_srcc = float(np.mean([r[0] for r in results.values()]))
        if rank == 0:
            for n, (s, p) in results.items():
                print(f"  {n:>10s}: SRCC {s:.4f} PLCC {p:.4f}")
            print(f"epoch {epoch}: mean SRCC {mean_srcc:.4f}", flush=True)
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "results": results},
                       os.path.join(cfg["out_dir"], "last.pth"))
            if mean_srcc > best:
                best = mean_srcc
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "results": results},
                           os.path.join(cfg["out_dir"], "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
