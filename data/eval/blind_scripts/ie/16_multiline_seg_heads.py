"""Shared-encoder defect segmentation for several product lines at once.

One ConvNeXt encoder + FPN neck is shared; every product line has its own
small segmentation head (lines differ in what counts as a defect). Training
data: nominal images with synthetic defects pasted in (Perlin-masked texture
blends) plus the few real annotated defects each line has.

    torchrun --nnodes=2 --nproc_per_node=4 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        multiline_seg.py --manifest /shared/aoi/manifests/lines_2024q3.json --out /shared/aoi/runs/mlseg
"""
import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--manifest", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--size", type=int, default=384)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=12, help="per GPU")
    p.add_argument("--base-lr", type=float, default=1e-4, help="for a global batch of 64")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--synth-prob", type=float, default=0.5)
    return p.parse_args()


class MultiLineSet(Dataset):
    """Manifest entries: {"image": ..., "mask": ... or null, "line": name}."""

    def __init__(self, entries, lines, size, train):
        self.entries, self.line_ids, self.size, self.train = entries, {l: i for i, l in enumerate(lines)}, size, train
        self.synth_prob = 0.0

    def __len__(self):
        return len(self.entries)

    def _synthetic(self, img):
        h, w, _ = img.shape
        k = random.randint(2, 6)
        low = np.random.rand(k, k).astype(np.float32)
        blob = np.array(Image.fromarray(low).resize((w, h), Image.BICUBIC)) > random.uniform(0.6, 0.8)
        tex = np.random.rand(h, w, 3).astype(np.float32) * random.uniform(0.3, 1.0)
        a = random.uniform(0.3, 0.9)
        out = np.where(blob[..., None], (1 - a) * img + a * tex, img)
        return out, blob.astype(np.float32)

    def __getitem__(self, i):
        e = self.entries[i]
        img = np.asarray(Image.open(e["image"]).convert("RGB").resize((self.size, self.size)), np.float32) / 255
        if e["mask"]:
            mask = (np.asarray(Image.open(e["mask"]).convert("L").resize((self.size, self.size), Image.NEAREST)) > 127)
            mask = mask.astype(np.float32)
        else:
            mask = np.zeros((self.size, self.size), np.float32)
            if self.train and random.random() < self.synth_prob:
                img, mask = self._synthetic(img)
        if self.train and random.random() < 0.5:
            img, mask = img[:, ::-1], mask[:, ::-1]
        x = torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1)))
        x = (x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
        return x, torch.from_numpy(np.ascontiguousarray(mask))[None], self.line_ids[e["line"]], i


class MultiLineSeg(nn.Module):
    def __init__(self, n_lines, fpn_ch=128):
        super().__init__()
        self.encoder = timm.create_model("convnext_tiny", pretrained=True, features_only=True, out_indices=(0, 1, 2, 3))
        chans = self.encoder.feature_info.channels()
        self.lateral = nn.ModuleList([nn.Conv2d(c, fpn_ch, 1) for c in chans])
        self.smooth = nn.Sequential(nn.Conv2d(fpn_ch, fpn_ch, 3, padding=1), nn.GroupNorm(16, fpn_ch), nn.GELU())
        self.heads = nn.ModuleList([nn.Sequential(nn.Conv2d(fpn_ch, 64, 3, padding=1), nn.GELU(), nn.Conv2d(64, 1, 1))
                                    for _ in range(n_lines)])

    def forward(self, x, line_id):
        feats = self.encoder(x)
        p = self.lateral[-1](feats[-1])
        for f, lat in zip(reversed(feats[:-1]), reversed(self.lateral[:-1])):
            p = F.interpolate(p, size=f.shape[-2:], mode="nearest") + lat(f)
        p = self.smooth(p)
        out = p.new_zeros(p.shape[0], 1, *p.shape[-2:])
        for lid in line_id.unique().tolist():
            sel = line_id == lid
            out[sel] = self.heads[lid](p[sel])
        return F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)


def focal_dice(logits, target):
    bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    focal = ((1 - torch.exp(-bce)) ** 2 * bce).mean()
    p = torch.sigmoid(logits)
    dice = 1 - (2 * (p * target).sum() + 1) / (p.sum() + target.sum() + 1)
    return focal + dice


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    manifest = json.load(open(args.manifest))   # split is fixed in the manifest, same file on every node
    lines = sorted(manifest["lines"])
    train_ds = MultiLineSet(manifest["train"], lines, args.size, train=True)
    train_ds.synth_prob = args.synth_prob
    val_ds = MultiLineSet(manifest["val"], lines, args.size, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=8, sampler=val_sampler, num_workers=4)

    model = MultiLineSeg(len(lines)).to(device)
    # a batch only touches the heads of the lines it contains
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    global_batch = args.batch_size * world
    lr = args.base_lr * global_batch / 64
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps = args.epochs * len(train_loader)
    warmup = max(1, min(500, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    out = Path(args.out)
    ckpt_path = out / "last.pt"
    start_epoch, best = 0, -1.0
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["sched"])
        start_epoch, best = ck["epoch"] + 1, ck["best"]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(f"{len(lines)} lines, {len(train_ds)} train / {len(val_ds)} val, global batch {global_batch}, lr {lr:.2e}")

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        tot = torch.zeros(2, device=device)
        for x, m, lid, _ in train_loader:
            x, m, lid = x.to(device, non_blocking=True), m.to(device, non_blocking=True), lid.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, lid)
            loss = focal_dice(logits.float(), m)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)

        # validation: every rank scores its shard, results gathered with their dataset index
        model.eval()
        rows = []
        with torch.no_grad():
            for x, m, lid, idx in val_loader:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    prob = torch.sigmoid(model.module(x.to(device), lid.to(device)).float())
                prob = F.avg_pool2d(prob, 4)
                m = F.max_pool2d(m, 4)
                for k in range(len(idx)):
                    rows.append((int(idx[k]), int(lid[k]), prob[k].max().item(), int(m[k].max() > 0),
                                 prob[k].cpu().numpy().ravel().astype(np.float16), m[k].numpy().ravel().astype(bool)))
        parts = [None] * world
        dist.all_gather_object(parts, rows)
        if rank == 0:
            uniq = {r[0]: r for p in parts for r in p}
            rows = [uniq[i] for i in sorted(uniq)]
            report = {}
            for li, name in enumerate(lines):
                rs = [r for r in rows if r[1] == li]
                ys = [r[3] for r in rs]
                if len(set(ys)) < 2:
                    continue
                px_y = np.concatenate([r[5] for r in rs])
                px_s = np.concatenate([r[4] for r in rs]).astype(np.float32)
                report[name] = {"image_auroc": roc_auc_score(ys, [r[2] for r in rs]),
                                "pixel_ap": average_precision_score(px_y, px_s)}
            mean_ap = float(np.mean([v["pixel_ap"] for v in report.values()])) if report else 0.0
            print(f"epoch {epoch} loss {(tot[0] / tot[1]).item():.4f} mean pixel AP {mean_ap:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            best = max(best, mean_ap)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "sched": sched.state_dict(), "epoch": epoch, "best": best, "lines": lines}
            torch.save(state, out / "last.tmp")
            os.replace(out / "last.tmp", ckpt_path)
            if mean_ap >= best:
                torch.save({"model": model.module.state_dict(), "lines": lines, "report": report}, out / "best.pt")
            with open(out / f"report_{epoch:03d}.json", "w") as f:
                json.dump(report, f, indent=2)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
