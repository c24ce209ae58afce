"""One ViT-L/16 for three medical imaging datasets with very different sizes:

  cxr   - chest X-ray, 14 findings, multi-label   (~220k images)
  derm  - dermoscopy, 8 classes                   (~25k images)
  fundus- diabetic retinopathy grade 0-4, ordinal (~35k images, trained as regression)

Each step draws one dataset (sqrt-size sampling, same draw on every rank) and
runs only that dataset's head. Activation checkpointing on the transformer blocks
keeps 448px inputs in memory.

    torchrun --nproc_per_node=8 10_medical_multidataset_vit.py --cfg med_mt.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from sklearn.metrics import cohen_kappa_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T

HEADS = {"cxr": 14, "derm": 8, "fundus": 1}


class CsvImages(Dataset):
    def __init__(self, csv, img_root, label_cols, tf):
        self.df = pd.read_csv(csv)
        self.root, self.cols, self.tf = img_root, label_cols, tf

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        img = self.tf(Image.open(os.path.join(self.root, r["path"])).convert("RGB"))
        y = torch.tensor(r[self.cols].values.astype(np.float32))
        return img, y


class MedViT(nn.Module):
    def __init__(self, arch, img_size, grad_ckpt=True):
        super().__init__()
        self.vit = timm.create_model(arch, pretrained=True, num_classes=0, img_size=img_size)
        self.grad_ckpt = grad_ckpt
        d = self.vit.num_features
        self.heads = nn.ModuleDict({k: nn.Linear(d, n) for k, n in HEADS.items()})

    def features(self, x):
        v = self.vit
        x = v.patch_embed(x)
        x = v._pos_embed(x)
        x = v.norm_pre(x)
        for blk in v.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x)
            else:
                x = blk(x)
        x = v.norm(x)
        return x[:, 0]

    def forward(self, x, task):
        return self.heads[task](self.features(x))


def loss_fn(task, out, y):
    if task == "cxr":
        return F.binary_cross_entropy_with_logits(out, y)
    if task == "derm":
        return F.cross_entropy(out, y[:, 0].long(), label_smoothing=0.1)
    return F.smooth_l1_loss(out.squeeze(1), y[:, 0])


def build(cfg, rank, world):
    norm = T.Normalize([0.5] * 3, [0.5] * 3)
    tr = T.Compose([T.RandomResizedCrop(cfg["img_size"], scale=(0.7, 1.0)), T.RandomHorizontalFlip(),
                    T.ColorJitter(0.1, 0.1), T.ToTensor(), norm])
    te = T.Compose([T.Resize(cfg["img_size"]), T.CenterCrop(cfg["img_size"]), T.ToTensor(), norm])
    train, val, loaders, samplers = {}, {}, {}, {}
    for task, dc in cfg["data"].items():
        train[task] = CsvImages(dc["train_csv"], dc["root"], dc["labels"], tr)
        val[task] = CsvImages(dc["val_csv"], dc["root"], dc["labels"], te)
        samplers[task] = DistributedSampler(train[task], num_replicas=world, rank=rank, shuffle=True)
        loaders[task] = DataLoader(train[task], batch_size=cfg["batch_size"], sampler=samplers[task],
                                   num_workers=cfg["workers"], pin_memory=True, drop_last=True,
                                   persistent_workers=True)
    return train, val, loaders, samplers


@torch.no_grad()
def evaluate(net, val, cfg, device, rank, world):
    net.eval()
    res = {}
    for task, ds in val.items():
        part = Subset(ds, range(rank, len(ds), world))
        outs, ys = [], []
        for x, y in DataLoader(part, batch_size=64, num_workers=cfg["workers"]):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                o = net(x.to(device, non_blocking=True), task).float()
            outs.append(o.cpu())
            ys.append(y)
        gathered = [None] * world
        dist.all_gather_object(gathered, (torch.cat(outs), torch.cat(ys)))
        o = torch.cat([g[0] for g in gathered]).numpy()
        y = torch.cat([g[1] for g in gathered]).numpy()
        if task == "cxr":
            res[task] = float(np.mean([roc_auc_score(y[:, k], o[:, k]) for k in range(y.shape[1])
                                       if 0 < y[:, k].sum() < len(y)]))
        elif task == "derm":
            res[task] = float((o.argmax(1) == y[:, 0]).mean())
        else:
            res[task] = float(cohen_kappa_score(y[:, 0].astype(int), np.clip(np.rint(o[:, 0]), 0, 4).astype(int),
                                                weights="quadratic"))
    net.train()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))
    cfg.setdefault("arch", "vit_large_patch16_224.augreg_in21k")
    cfg.setdefault("img_size", 448)
    cfg.setdefault("batch_size", 16)
    cfg.setdefault("workers", 8)
    cfg.setdefault("steps", 40000)
    cfg.setdefault("lr", 1e-4)
    cfg.setdefault("eval_every", 2000)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train, val, loaders, samplers = build(cfg, rank, world)
    tasks = list(loaders)
    p = np.sqrt([len(train[t]) for t in tasks])
    p = p / p.sum()
    task_rng = np.random.default_rng(cfg.get("seed", 0))  # identical stream on all ranks

    net = MedViT(cfg["arch"], cfg["img_size"]).to(device)
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    warm = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, cfg["steps"]) / cfg["steps"])))

    passes = {t: 0 for t in tasks}
    its = {}
    for t in tasks:
        samplers[t].set_epoch(0)
        its[t] = iter(loaders[t])

    out_dir = cfg.get("out_dir", "runs/med_mt")
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    for step in range(cfg["steps"]):
        task = tasks[task_rng.choice(len(tasks), p=p)]
        try:
            x, y = next(its[task])
        except StopIteration:
            passes[task] += 1
            samplers[task].set_epoch(passes[task])
            its[task] = iter(loaders[task])
            x, y = next(its[task])
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, task)
        loss = loss_fn(task, out.float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()

        if rank == 0 and step % 50 == 0:
            print(f"step {step} {task} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
            t0 = time.time()
        if (step + 1) % cfg["eval_every"] == 0:
            res = evaluate(model.module, val, cfg, device, rank, world)
            if rank == 0:
                print(f"eval @ {step + 1}: {res}", flush=True)
                torch.save({"model": model.module.state_dict(), "step": step + 1, "metrics": res},
                           os.path.join(out_dir, f"step{step + 1}.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
