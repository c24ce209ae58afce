"""Urban change detection on bi-temporal 0.5 m RGB-NIR scene pairs.

Training uses random 256 px crops from co-registered pairs; validation runs on
whole scene pairs, writes the change-probability rasters next to the run and
reports F1 at 0.5 plus the best threshold and PR-AUC over all validation pixels.

    torchrun --nproc_per_node=8 10_urban_change_bitemporal.py --cfg cfg/urban_cd.json
"""
import argparse
import json
import os
import random

import numpy as np
import rasterio
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score, precision_recall_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import segmentation_models_pytorch as smp

CFG = {
    "root": "/mnt/geo-share/urban_cd",
    "run_dir": "/mnt/geo-share/urban_cd/runs/unet_r50_ef",
    "encoder": "resnet50",
    "crop": 256,
    "crops_per_epoch": 16000,
    "batch_size": 8,
    "epochs": 60,
    "lr": 2e-4,
    "eval_every": 5,
    "eval_stride": 8,
}


def read_pair(root, pair_id):
    d = os.path.join(root, pair_id)
    with rasterio.open(os.path.join(d, "t1.tif")) as s1, rasterio.open(os.path.join(d, "t2.tif")) as s2:
        a = s1.read().astype(np.float32) / 255.0
        b = s2.read().astype(np.float32) / 255.0
        profile = s1.profile
    with rasterio.open(os.path.join(d, "change.tif")) as s:
        m = (s.read(1) > 0).astype(np.float32)
    return a, b, m, profile


class RandomCropPairs(Dataset):
    def __init__(self, root, pair_ids, crop, length):
        self.pairs = [read_pair(root, p)[:3] for p in pair_ids]
        self.crop, self.length = crop, length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        a, b, m = self.pairs[i % len(self.pairs)]
        h, w = m.shape
        y, x = random.randint(0, h - self.crop), random.randint(0, w - self.crop)
        a = a[:, y:y + self.crop, x:x + self.crop]
        b = b[:, y:y + self.crop, x:x + self.crop]
        m = m[y:y + self.crop, x:x + self.crop]
        if random.random() < 0.5:
            a, b = b, a
        if random.random() < 0.5:
            a, b, m = a[:, ::-1], b[:, ::-1], m[::-1]
        x = np.concatenate([a, b], 0)
        return torch.from_numpy(x.copy()), torch.from_numpy(m.copy())


@torch.no_grad()
def predict_scene(net, a, b, device, tile=512, pad=32):
    x = torch.from_numpy(np.concatenate([a, b], 0))[None].to(device)
    _, _, h, w = x.shape
    prob = torch.zeros(h, w, device=device)
    for y0 in range(0, h, tile):
        for x0 in range(0, w, tile):
            ys, xs = max(0, y0 - pad), max(0, x0 - pad)
            ye, xe = min(h, y0 + tile + pad), min(w, x0 + tile + pad)
            patch = x[..., ys:ye, xs:xe]
            ph, pw = patch.shape[-2:]
            th, tw = (ph + 31) // 32 * 32, (pw + 31) // 32 * 32
            patch = F.pad(patch, (0, tw - pw, 0, th - ph), mode="reflect")
            p = torch.sigmoid(net(patch))[0, 0, :ph, :pw]
            prob[y0:min(h, y0 + tile), x0:min(w, x0 + tile)] = \
                p[y0 - ys:y0 - ys + min(tile, h - y0), x0 - xs:x0 - xs + min(tile, w - x0)]
    return prob


def validate(net, cfg, val_ids, epoch, rank, world, device):
    net.eval()
    out_dir = os.path.join(cfg["run_dir"], f"val_ep{epoch:03d}")
    os.makedirs(out_dir, exist_ok=True)
    probs, gts = [], []
    for pid in val_ids[rank::world]:
        a, b, m, profile = read_pair(cfg["root"], pid)
        prob = predict_scene(net, a, b, device)
        profile.update(count=1, dtype="uint8", nodata=None, compress="deflate")
        with rasterio.open(os.path.join(out_dir, f"{pid}_change.tif"), "w", **profile) as dst:
            dst.write((prob * 255).byte().cpu().numpy(), 1)
        s = cfg["eval_stride"]
        probs.append(prob[::s, ::s].flatten())
        gts.append(torch.from_numpy(m[::s, ::s]).to(device).flatten())
    probs = torch.cat(probs) if probs else torch.zeros(0, device=device)
    gts = torch.cat(gts) if gts else torch.zeros(0, device=device)

    all_probs = [torch.empty_like(probs) for _ in range(world)]
    all_gts = [torch.empty_like(gts) for _ in range(world)]
    dist.all_gather(all_probs, probs)
    dist.all_gather(all_gts, gts)
    if rank != 0:
        return None
    p = torch.cat(all_probs).cpu().numpy()
    g = torch.cat(all_gts).cpu().numpy().astype(np.uint8)
    pred = p > 0.5
    tp, fp, fn = (pred & (g == 1)).sum(), (pred & (g == 0)).sum(), (~pred & (g == 1)).sum()
    f1 = 2 * tp / max(2 * tp + fp + fn, 1)
    prec, rec, thr = precision_recall_curve(g, p)
    f1s = 2 * prec * rec / np.clip(prec + rec, 1e-9, None)
    best = int(np.argmax(f1s[:-1]))
    return {"f1@0.5": float(f1), "best_f1": float(f1s[best]), "best_thr": float(thr[best]),
            "ap": float(average_precision_score(g, p))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = dict(CFG)
    a = ap.parse_args()
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)
    torch.manual_seed(0)

    with open(os.path.join(cfg["root"], "splits.json")) as f:
        splits = json.load(f)
    train_ds = RandomCropPairs(cfg["root"], splits["train"], cfg["crop"], cfg["crops_per_epoch"])
    sampler = DistributedSampler(train_ds, shuffle=True)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True,
                        worker_init_fn=lambda wid: random.seed(torch.initial_seed() % 2**31 + rank))

    net = smp.Unet(cfg["encoder"], encoder_weights=None, in_channels=8, classes=1)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"] * world, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"] * world,
                                                total_steps=cfg["epochs"] * len(loader))
    dice = smp.losses.DiceLoss("binary")
    bce = nn.BCEWithLogitsLoss()

    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        for it, (x, m) in enumerate(loader):
            x, m = x.to(device, non_blocking=True), m.to(device, non_blocking=True)[:, None]
            logits = model(x)
            loss = bce(logits, m) + dice(logits, m)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it} loss {loss.item():.4f}", flush=True)

        if (epoch + 1) % cfg["eval_every"] == 0:
            res = validate(net, cfg, splits["val"], epoch, rank, world, device)
            if rank == 0:
                print(f"epoch {epoch} val {json.dumps(res)}", flush=True)
                torch.save({"epoch": epoch, "model": net.state_dict(), "val": res},
                           os.path.join(cfg["run_dir"], f"ckpt_ep{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
