"""Multi-task dense prediction: shared ResNet-50 + FPN-lite decoder, one head per task.
Tasks come from different datasets (semantic seg / depth / surface normals), so every
iteration draws a batch from one task in round-robin order.

    torchrun --nproc_per_node=8 train_mtl.py --cfg configs/mtl_nyu_r50.yaml
"""
import argparse
import itertools
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.models import resnet50, ResNet50_Weights

TASKS = ("semseg", "depth", "normals")


class NpzTaskDataset(Dataset):
    """Each sample is an .npz with 'image' (H,W,3 uint8) and a task-specific target."""

    def __init__(self, root, task, split):
        self.task = task
        list_file = os.path.join(root, task, f"{split}.txt")
        with open(list_file) as f:
            self.files = [os.path.join(root, task, line.strip()) for line in f if line.strip()]

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        d = np.load(self.files[i])
        img = torch.from_numpy(d["image"]).permute(2, 0, 1).float().div(255)
        img = (img - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
        if self.task == "semseg":
            tgt = torch.from_numpy(d["label"]).long()
        elif self.task == "depth":
            tgt = torch.from_numpy(d["depth"]).float()[None]
        else:
            tgt = torch.from_numpy(d["normals"]).permute(2, 0, 1).float()
        return img, tgt


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        r = resnet50(weights=ResNet50_Weights.IMAGENET1K_V2)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3, r.layer4])

    def forward(self, x):
        feats = []
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
            feats.append(x)
        return feats


class FPNDecoder(nn.Module):
    def __init__(self, in_chs=(256, 512, 1024, 2048), ch=256):
        super().__init__()
        self.lateral = nn.ModuleList([nn.Conv2d(c, ch, 1) for c in in_chs])
        self.smooth = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU(inplace=True))

    def forward(self, feats):
        x = self.lateral[-1](feats[-1])
        for lat, f in zip(reversed(self.lateral[:-1]), reversed(feats[:-1])):
            x = F.interpolate(x, size=f.shape[-2:], mode="bilinear", align_corners=False) + lat(f)
        return self.smooth(x)


def make_head(ch, out):
    return nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.BatchNorm2d(ch), nn.ReLU(inplace=True),
                         nn.Conv2d(ch, out, 1))


class MultiTaskNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.backbone = Backbone()
        self.decoder = FPNDecoder()
        self.heads = nn.ModuleDict({"semseg": make_head(256, num_classes),
                                    "depth": make_head(256, 1),
                                    "normals": make_head(256, 3)})

    def forward(self, x, task):
        out = self.heads[task](self.decoder(self.backbone(x)))
        return F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)


def task_loss(task, pred, tgt):
    if task == "semseg":
        return F.cross_entropy(pred, tgt, ignore_index=255)
    if task == "depth":
        valid = tgt > 0
        return F.l1_loss(pred[valid], tgt[valid])
    pred = F.normalize(pred, dim=1)
    valid = tgt.abs().sum(1) > 0
    return (1 - (pred * tgt).sum(1))[valid].mean()


def infinite(loader, sampler):
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch


@torch.no_grad()
def validate(model, loaders, device):
    model.eval()
    results = {}
    for task, loader in loaders.items():
        acc = torch.zeros(2, device=device)
        for img, tgt in loader:
            img, tgt = img.to(device), tgt.to(device)
            acc += torch.stack([task_loss(task, model(img, task), tgt) * img.shape[0],
                                torch.tensor(float(img.shape[0]), device=device)])
        dist.all_reduce(acc)
        results[task] = (acc[0] / acc[1]).item()
    model.train()
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    args = ap.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)

    train_iters, val_loaders = {}, {}
    for task in TASKS:
        ds = NpzTaskDataset(cfg["data_root"], task, "train")
        s = DistributedSampler(ds, shuffle=True, drop_last=True)
        dl = DataLoader(ds, batch_size=cfg["batch_per_gpu"], sampler=s, num_workers=4,
                        pin_memory=True, drop_last=True)
        train_iters[task] = infinite(dl, s)
        vds = NpzTaskDataset(cfg["data_root"], task, "val")
        val_loaders[task] = DataLoader(vds, batch_size=cfg["batch_per_gpu"],
                                       sampler=DistributedSampler(vds, shuffle=False), num_workers=2)

    model = MultiTaskNet(cfg["num_classes"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])

    weights = cfg.get("loss_weights", {"semseg": 1.0, "depth": 1.0, "normals": 1.0})
    lr = cfg["lr"] * cfg["batch_per_gpu"] * world / cfg.get("base_batch", 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.get("wd", 1e-4))
    total = cfg["max_iters"]
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total, pct_start=0.05)

    model.train()
    t0 = time.time()
    for it in range(total):
        task = TASKS[it % len(TASKS)]
        img, tgt = next(train_iters[task])
        img, tgt = img.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        pred = model(img, task)
        loss = weights[task] * task_loss(task, pred, tgt)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.get("clip", 5.0))
        optimizer.step()
        sched.step()

        if it % 50 == 0:
            l = loss.detach().clone()
            dist.all_reduce(l)
            if rank == 0:
                print(f"it {it} task {task:8s} loss {l.item() / world:.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"({time.time() - t0:.0f}s)", flush=True)
        if (it + 1) % cfg["val_every"] == 0 or it + 1 == total:
            res = validate(model, val_loaders, device)
            if rank == 0:
                print("val", {k: round(v, 4) for k, v in res.items()}, flush=True)
                torch.save({"it": it + 1, "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict()}, os.path.join(cfg["out_dir"], "last.pth"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
