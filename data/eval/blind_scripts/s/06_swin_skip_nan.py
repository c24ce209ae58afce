"""Happywhale-ish species classifier, swin backbone, AMP + grad accumulation + EMA.

torchrun --nproc_per_node=8 06_swin_skip_nan.py --config configs/swin_b_384.yaml
"""
import os
import math
import time
import argparse
import logging

import yaml
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
import timm
from timm.data import create_transform
from timm.utils import ModelEmaV2
from torchvision.datasets.folder import default_loader

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
log = logging.getLogger("train")

DEFAULTS = dict(
    train_csv="/data/whale/train_folds.csv",
    img_dir="/data/whale/cropped_384",
    model="swin_base_patch4_window12_384.ms_in22k",
    img_size=384,
    fold=0,
    epochs=20,
    batch_size=16,
    accum_steps=4,
    lr=1.5e-4,
    warmup_epochs=1,
    weight_decay=0.05,
    ema_decay=0.999,
    num_workers=8,
    output="./output/swin_b",
)


class WhaleDS(torch.utils.data.Dataset):
    def __init__(self, df, img_dir, tfm):
        self.paths = [os.path.join(img_dir, f) for f in df.image]
        self.y = df.label.values
        self.tfm = tfm

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return self.tfm(default_loader(self.paths[i])), self.y[i], i


def cosine_warmup(step, total, warmup):
    if step < warmup:
        return step / max(1, warmup)
    prog = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * prog))


@torch.no_grad()
def evaluate(model, loader, device, world_size):
    model.eval()
    out_idx, out_top5 = [], []
    for x, y, idx in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(x)
        top5 = logits.topk(5, dim=1).indices
        out_top5.append(top5.eq(y[:, None]).float().cpu())
        out_idx.append(idx)
    mine = (torch.cat(out_idx), torch.cat(out_top5))
    allr = [None] * world_size
    dist.all_gather_object(allr, mine)
    idx = torch.cat([a[0] for a in allr]).numpy()
    hit = torch.cat([a[1] for a in allr]).numpy()
    _, first = np.unique(idx, return_index=True)
    hit = hit[first]
    # MAP@5
    w = np.array([1.0, 1 / 2, 1 / 3, 1 / 4, 1 / 5])
    return float((hit * w).sum(1).mean()), float(hit[:, 0].mean())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--fold", type=int, default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    if a.fold is not None:
        cfg["fold"] = a.fold

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    if rank != 0:
        log.setLevel(logging.WARNING)

    df = pd.read_csv(cfg["train_csv"])
    n_classes = int(df.label.max()) + 1
    tr = df[df.fold != cfg["fold"]].reset_index(drop=True)
    va = df[df.fold == cfg["fold"]].reset_index(drop=True)
    tf_tr = create_transform(cfg["img_size"], is_training=True, auto_augment="rand-m9-mstd0.5",
                             re_prob=0.25)
    tf_va = create_transform(cfg["img_size"], is_training=False, crop_pct=1.0)
    ds_tr, ds_va = WhaleDS(tr, cfg["img_dir"], tf_tr), WhaleDS(va, cfg["img_dir"], tf_va)
    samp_tr = DistributedSampler(ds_tr, shuffle=True, drop_last=True)
    samp_va = DistributedSampler(ds_va, shuffle=False)
    dl_tr = DataLoader(ds_tr, cfg["batch_size"], sampler=samp_tr, num_workers=cfg["num_workers"],
                       pin_memory=True, drop_last=True)
    dl_va = DataLoader(ds_va, cfg["batch_size"] * 2, sampler=samp_va,
                       num_workers=cfg["num_workers"], pin_memory=True)

    model = timm.create_model(cfg["model"], pretrained=True, num_classes=n_classes,
                              drop_path_rate=0.2).to(device)
    ema = ModelEmaV2(model, decay=cfg["ema_decay"])
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    upd_per_epoch = len(dl_tr) // cfg["accum_steps"]
    total = cfg["epochs"] * upd_per_epoch
    warm = cfg["warmup_epochs"] * upd_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine_warmup(s, total, warm))
    scaler = torch.cuda.amp.GradScaler()
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(cfg["output"], exist_ok=True)
    best = 0.0
    n_skipped = 0
    for epoch in range(cfg["epochs"]):
        samp_tr.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for it, (x, y, _) in enumerate(dl_tr):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync_now = (it + 1) % cfg["accum_steps"] == 0
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y) / cfg["accum_steps"]
            if not torch.isfinite(loss):
                n_skipped += 1
                log.warning(f"rank {rank}: non-finite loss at ep {epoch} it {it}, skipping batch")
                continue
            if sync_now:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                sched.step()
                ema.update(model.module)
            else:
                with model.no_sync():
                    scaler.scale(loss).backward()
            if it % 100 == 0:
                log.info(f"ep {epoch} it {it}/{len(dl_tr)} loss {loss.item() * cfg['accum_steps']:.4f} "
                         f"lr {sched.get_last_lr()[0]:.2e}")

        map5, top1 = evaluate(ema.module, dl_va, device, world)
        log.info(f"epoch {epoch} MAP@5 {map5:.4f} top1 {top1:.4f} skipped {n_skipped} "
                 f"time {time.time() - t0:.0f}s")
        if rank == 0 and map5 > best:
            best = map5
            torch.save({"state_dict": ema.module.state_dict(), "epoch": epoch, "map5": map5,
                        "n_classes": n_classes}, f"{cfg['output']}/fold{cfg['fold']}_best.pth")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
