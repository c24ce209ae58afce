"""One DenseNet-121 for three medical imaging datasets (ISIC-2018 skin lesions,
APTOS-2019 diabetic retinopathy grading, pediatric chest X-ray), one head each.

The public releases only ship a labelled pool per dataset, so a validation split
is carved out of each pool here (val_frac). Each step samples one batch per
dataset; per-task losses are weighted with learned uncertainty.

    torchrun --nproc_per_node=4 med_mtl.py --cfg configs/med_mtl.json
"""
import argparse
import json
import os
import random

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from PIL import Image
from sklearn.metrics import cohen_kappa_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, random_split

DEFAULT_CFG = {
    "tasks": {
        "isic": {"csv": "/data/isic2018/labels.csv", "img_dir": "/data/isic2018/images", "classes": 7},
        "aptos": {"csv": "/data/aptos2019/train.csv", "img_dir": "/data/aptos2019/train_images", "classes": 5},
        "cxr": {"csv": "/data/chest_xray/labels.csv", "img_dir": "/data/chest_xray/images", "classes": 3},
    },
    "img_size": 384,
    "batch_size": 16,
    "lr": 3e-4,
    "epochs": 40,
    "val_frac": 0.15,
    "seed": 7,
    "out_dir": "runs/med_mtl",
}


class CsvImages(Dataset):
    def __init__(self, csv_path, img_dir, size, train=True):
        df = pd.read_csv(csv_path)
        self.paths = [os.path.join(img_dir, f) for f in df["image"]]
        self.labels = df["label"].astype(int).tolist()
        aug = [torchvision.transforms.RandomResizedCrop(size, scale=(0.7, 1.0)),
               torchvision.transforms.RandomHorizontalFlip(), torchvision.transforms.RandomVerticalFlip(),
               torchvision.transforms.RandomRotation(20), torchvision.transforms.ColorJitter(0.2, 0.2, 0.1)]
        base = [torchvision.transforms.ToTensor(),
                torchvision.transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
        self.tf_train = torchvision.transforms.Compose(aug + base)
        self.tf_eval = torchvision.transforms.Compose([torchvision.transforms.Resize((size, size))] + base)
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return (self.tf_train if self.train else self.tf_eval)(img), self.labels[i]


class EvalView(Dataset):
    """same samples as a Subset, but with eval transforms"""

    def __init__(self, subset):
        self.base, self.idx = subset.dataset, subset.indices

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        img = Image.open(self.base.paths[self.idx[i]]).convert("RGB")
        return self.base.tf_eval(img), self.base.labels[self.idx[i]]


class MedMTL(nn.Module):
    def __init__(self, tasks):
        super().__init__()
        dn = torchvision.models.densenet121(weights="IMAGENET1K_V1")
        self.features = dn.features
        self.heads = nn.ModuleDict({t: nn.Sequential(nn.Dropout(0.3), nn.Linear(1024, c["classes"]))
                                    for t, c in tasks.items()})
        self.log_vars = nn.Parameter(torch.zeros(len(tasks)))

    def embed(self, x):
        return F.adaptive_avg_pool2d(F.relu(self.features(x)), 1).flatten(1)

    def forward(self, xs, ys):
        losses = []
        for i, (t, x) in enumerate(xs.items()):
            ce = F.cross_entropy(self.heads[t](self.embed(x)), ys[t])
            losses.append(ce)
        losses = torch.stack(losses)
        return (torch.exp(-self.log_vars) * losses + self.log_vars).sum(), losses.detach()


@torch.no_grad()
def evaluate(net, val_sets, device, rank, world):
    net.eval()
    metrics = {}
    for t, ds in val_sets.items():
        idx = list(range(rank, len(ds), world))
        probs, labels = [], []
        for x, y in DataLoader(torch.utils.data.Subset(ds, idx), batch_size=32, num_workers=4):
            p = F.softmax(net.heads[t](net.embed(x.to(device))), -1)
            probs.append(p.cpu())
            labels.append(y)
        local = (torch.cat(probs).numpy(), torch.cat(labels).numpy())
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        P = np.concatenate([g[0] for g in gathered])
        Y = np.concatenate([g[1] for g in gathered])
        if t == "aptos":
            metrics[t] = cohen_kappa_score(Y, P.argmax(1), weights="quadratic")
        else:
            metrics[t] = roc_auc_score(Y, P, multi_class="ovr")
    net.train()
    return metrics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = dict(DEFAULT_CFG)
    a = ap.parse_args()
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # different augmentation stream per rank
    seed = cfg["seed"] + rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    train_sets, val_sets, samplers, loaders = {}, {}, {}, {}
    for t, c in cfg["tasks"].items():
        pool = CsvImages(c["csv"], c["img_dir"], cfg["img_size"], train=True)
        n_val = int(len(pool) * cfg["val_frac"])
        tr, va = random_split(pool, [len(pool) - n_val, n_val])
        train_sets[t], val_sets[t] = tr, EvalView(va)
        samplers[t] = DistributedSampler(tr, shuffle=True, seed=cfg["seed"], drop_last=True)
        loaders[t] = DataLoader(tr, batch_size=cfg["batch_size"], sampler=samplers[t], num_workers=6,
                                pin_memory=True, drop_last=True)

    net = nn.SyncBatchNorm.convert_sync_batchnorm(MedMTL(cfg["tasks"])).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=1e-4)
    steps_per_epoch = max(len(l) for l in loaders.values())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["epochs"] * steps_per_epoch)

    os.makedirs(cfg["out_dir"], exist_ok=True)
    best = -1.0
    for epoch in range(cfg["epochs"]):
        for s in samplers.values():
            s.set_epoch(epoch)
        its = {t: iter(l) for t, l in loaders.items()}
        restarts = 0
        model.train()
        run = torch.zeros(len(loaders), device=device)
        for step in range(steps_per_epoch):
            xs, ys = {}, {}
            for t in loaders:
                try:
                    x, y = next(its[t])
                except StopIteration:
                    restarts += 1
                    samplers[t].set_epoch(epoch * 1000 + restarts)
                    its[t] = iter(loaders[t])
                    x, y = next(its[t])
                xs[t], ys[t] = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss, per_task = model(xs, ys)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run += per_task

        dist.all_reduce(run, op=dist.ReduceOp.AVG)
        scores = evaluate(net, val_sets, device, rank, world)
        mean = float(np.mean(list(scores.values())))
        if rank == 0:
            print(f"epoch {epoch} train_loss {dict(zip(loaders, (run / steps_per_epoch).tolist()))} "
                  f"val {scores} mean {mean:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], "last.pt"))
            if mean > best:
                best = mean
                torch.save(net.state_dict(), os.path.join(cfg["out_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
