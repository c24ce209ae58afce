"""Pairwise aesthetics ranking with a ViT-B/16 (relative judgements -> absolute score).

Pairs come from the comparative aesthetics study (same scene, different shots);
each pair has a label in {0, 1} for which shot was preferred and a confidence.
Pairs with a near-tie confidence are dropped from the batch. Validation is
SRCC/PLCC on the absolute-rating split; training stops early when val SRCC
stalls.

    torchrun --nproc_per_node=8 11_vit_pair_aesthetics_earlystop.py --cfg cfg/vit_pairs.yaml
"""
import argparse
import os

import numpy as np
import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from scipy.stats import pearsonr, spearmanr
from timm.data import create_transform, resolve_data_config
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class ShotPairs(Dataset):
    def __init__(self, root, csv, tf):
        self.root, self.tf = root, tf
        self.df = pd.read_csv(csv)  # left, right, label, confidence

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        left = self.tf(Image.open(os.path.join(self.root, r.left)).convert("RGB"))
        right = self.tf(Image.open(os.path.join(self.root, r.right)).convert("RGB"))
        return left, right, float(r.label), float(r.confidence)


class RatedImages(Dataset):
    def __init__(self, root, csv, tf):
        self.root, self.tf = root, tf
        self.df = pd.read_csv(csv)  # image, score

    def __len__(self):
        return len(self.df)

    def __getitem__(self, i):
        r = self.df.iloc[i]
        return self.tf(Image.open(os.path.join(self.root, r.image)).convert("RGB")), float(r.score), i


class AestheticViT(nn.Module):
    def __init__(self, name):
        super().__init__()
        self.vit = timm.create_model(name, pretrained=True, num_classes=0, drop_path_rate=0.1)
        self.score = nn.Linear(self.vit.num_features, 1)

    def forward(self, x):
        return self.score(self.vit(x)).squeeze(-1)

    @torch.no_grad()
    def score_tta(self, x):
        return 0.5 * (self.forward(x) + self.forward(torch.flip(x, dims=[3])))


@torch.no_grad()
def validate(model, loader, device, n):
    model.eval()
    rows = []
    for x, y, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s = model.module.score_tta(x.to(device, non_blocking=True))
        rows.append(torch.stack([s.float(), y.to(device, dtype=torch.float32), idx.to(device).float()], 1))
    rows = torch.cat(rows)
    world = dist.get_world_size()
    store = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(store, rows)
    allr = torch.cat(store).cpu().numpy()
    _, keep = np.unique(allr[:, 2].astype(np.int64), return_index=True)
    allr = allr[keep]
    assert len(allr) == n
    model.train()
    return float(spearmanr(allr[:, 0], allr[:, 1])[0]), float(pearsonr(allr[:, 0], allr[:, 1])[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    model = AestheticViT(cfg["model"])
    data_cfg = resolve_data_config({}, model=model.vit)
    train_tf = create_transform(**data_cfg, is_training=True, hflip=0.5, scale=(0.7, 1.0))
    eval_tf = create_transform(**data_cfg, is_training=False)

    pairs = ShotPairs(cfg["root"], cfg["pairs_csv"], train_tf)
    val_set = RatedImages(cfg["root"], cfg["val_csv"], eval_tf)
    sampler = DistributedSampler(pairs, shuffle=True, drop_last=True)
    loader = DataLoader(pairs, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["workers"],
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=cfg["batch_size"] * 2, num_workers=cfg["workers"],
                            sampler=DistributedSampler(val_set, shuffle=False), pin_memory=True)

    model = DDP(model.to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg["max_epochs"] * len(loader))

    ckpt_path = os.path.join(cfg["out_dir"], "best.pt")
    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
    best, bad_epochs = -1.0, 0
    min_conf = cfg.get("min_confidence", 0.6)

    for epoch in range(cfg["max_epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        skipped = 0
        for left, right, label, conf in loader:
            keep = conf >= min_conf
            # the step is skipped on every rank together, otherwise the gradient all-reduce would desync
            n_keep = torch.tensor([int(keep.sum())], device=device)
            dist.all_reduce(n_keep, op=dist.ReduceOp.MIN)
            if n_keep.item() == 0:
                skipped += 1
                continue
            left = left[keep].to(device, non_blocking=True)
            right = right[keep].to(device, non_blocking=True)
            label = label[keep].to(device, dtype=torch.float32)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s_left = model(left)
                s_right = model(right)
            loss = F.binary_cross_entropy_with_logits((s_left - s_right).float(), label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()

        srcc, plcc = validate(model, val_loader, device, len(val_set))
        stop = torch.zeros(1, device=device)
        if rank == 0:
            print(f"epoch {epoch}: SRCC {srcc:.4f} PLCC {plcc:.4f} skipped {skipped}", flush=True)
            if srcc > best + 1e-4:
                best, bad_epochs = srcc, 0
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "srcc": srcc}, ckpt_path)
            else:
                bad_epochs += 1
            stop[0] = float(bad_epochs >= cfg.get("patience", 3))
        dist.broadcast(stop, src=0)
        if stop.item() > 0:
            if rank == 0:
                print(f"early stop at epoch {epoch}, best SRCC {best:.4f}", flush=True)
            break

    dist.barrier()
    state = torch.load(ckpt_path, map_location=device)
    model.module.load_state_dict(state["model"])
    srcc, plcc = validate(model, val_loader, device, len(val_set))
    if rank == 0:
        print(f"reloaded best (epoch {state['epoch']}): SRCC {srcc:.4f} PLCC {plcc:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
