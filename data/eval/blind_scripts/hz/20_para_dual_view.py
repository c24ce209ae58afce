"""Dual-view (aesthetic + technical) image assessment on PARA.

Aesthetic view: whole image resized to 224 (composition, colour, content).
Technical view: 7x7 grid of 32x32 native-resolution patches (noise, blur,
compression). Two ConvNeXt-T branches; each regresses its own MOS and the
overall aesthetic score is a learned fusion. Loss per target: PLCC + rank.

    torchrun --nproc_per_node=8 20_para_dual_view.py --cfg configs/para_dual.yaml
"""
import argparse
import os
import random

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
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision.transforms import functional as TF

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def grid_patches(img, grid=7, patch=32, train=True):
    w, h = img.size
    if min(w, h) < grid * patch:
        r = grid * patch / min(w, h)
        img = img.resize((int(w * r + 1), int(h * r + 1)), Image.BILINEAR)
        w, h = img.size
    x = TF.to_tensor(img)
    gh, gw = h // grid, w // grid
    out = torch.empty(3, grid * patch, grid * patch)
    for i in range(grid):
        for j in range(grid):
            oy = random.randint(0, gh - patch) if train else (gh - patch) // 2
            ox = random.randint(0, gw - patch) if train else (gw - patch) // 2
            out[:, i * patch:(i + 1) * patch, j * patch:(j + 1) * patch] = \
                x[:, i * gh + oy:i * gh + oy + patch, j * gw + ox:j * gw + ox + patch]
    return TF.normalize(out, MEAN, STD)


class PARA(Dataset):
    def __init__(self, root, csv, train):
        df = pd.read_csv(csv)  # sessionId, imageName, aestheticScore_mean, qualityScore_mean
        self.paths = [os.path.join(root, "imgs", s, n) for s, n in zip(df["sessionId"], df["imageName"])]
        self.aes = (df["aestheticScore_mean"].values / 5.0).astype(np.float32)
        self.qual = (df["qualityScore_mean"].values / 5.0).astype(np.float32)
        self.train = train

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        if self.train and random.random() < 0.5:
            img = TF.hflip(img)
        aes_view = TF.normalize(TF.to_tensor(img.resize((224, 224), Image.BICUBIC)), MEAN, STD)
        tech_view = grid_patches(img, train=self.train)
        return aes_view, tech_view, self.aes[i], self.qual[i], i


class DualView(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.aes_branch = timm.create_model(arch, pretrained=True, num_classes=0)
        self.tech_branch = timm.create_model(arch, pretrained=True, num_classes=0)
        d = self.aes_branch.num_features
        self.aes_head = nn.Linear(d, 1)
        self.tech_head = nn.Linear(d, 1)
        self.fuse = nn.Linear(2, 1)

    def forward(self, aes_view, tech_view):
        a = self.aes_head(self.aes_branch(aes_view)).squeeze(-1)
        t = self.tech_head(self.tech_branch(tech_view)).squeeze(-1)
        overall = self.fuse(torch.stack([a, t], -1)).squeeze(-1)
        return overall, t


def plcc_rank_loss(pred, y):
    p = (pred - pred.mean()) / (pred.std() + 1e-6)
    g = (y - y.mean()) / (y.std() + 1e-6)
    l_plcc = (1 - (p * g).mean()) / 2
    dp, dg = pred[:, None] - pred[None], y[:, None] - y[None]
    l_rank = F.relu(0.02 - torch.sign(dg) * dp)[dg != 0].mean()
    return l_plcc + 0.3 * l_rank


@torch.no_grad()
def evaluate(model, loader, device, n):
    model.eval()
    rows = []
    for av, tv, aes, qual, idx in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            o, t = model(av.to(device, non_blocking=True), tv.to(device, non_blocking=True))
        rows.append(torch.stack([o.float(), t.float(), aes.to(device), qual.to(device), idx.to(device).float()], 1))
    rows = torch.cat(rows)
    all_rows = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(all_rows, rows)
    a = torch.cat(all_rows).cpu().numpy()
    _, k = np.unique(a[:, 4].astype(np.int64), return_index=True)
    a = a[k]
    assert len(a) == n
    model.train()
    return {"aes_srcc": spearmanr(a[:, 0], a[:, 2])[0], "aes_plcc": pearsonr(a[:, 0], a[:, 2])[0],
            "qual_srcc": spearmanr(a[:, 1], a[:, 3])[0], "qual_plcc": pearsonr(a[:, 1], a[:, 3])[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().cfg))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_ds = PARA(cfg["root"], cfg["train_csv"], train=True)
    test_ds = PARA(cfg["root"], cfg["test_csv"], train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg["seed"], drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg["workers"], pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_ds, batch_size=cfg["batch_size"], num_workers=cfg["workers"],
                             sampler=DistributedSampler(test_ds, shuffle=False), pin_memory=True)

    model = DDP(DualView(cfg["arch"]).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW([
        {"params": list(model.module.aes_branch.parameters()) + list(model.module.tech_branch.parameters()),
         "lr": cfg["lr"] * 0.1},
        {"params": list(model.module.aes_head.parameters()) + list(model.module.tech_head.parameters())
         + list(model.module.fuse.parameters()), "lr": cfg["lr"]},
    ], weight_decay=0.05)
    total = cfg["epochs"] * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[cfg["lr"] * 0.1, cfg["lr"]],
                                                    total_steps=total, pct_start=0.1)

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
    best = -1.0
    for epoch in range(cfg["epochs"]):
        model.train()
        meter = torch.zeros(3, device=device)
        for step, (av, tv, aes, qual, _) in enumerate(train_loader):
            av, tv = av.to(device, non_blocking=True), tv.to(device, non_blocking=True)
            aes, qual = aes.to(device), qual.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                overall, tech = model(av, tv)
            l_aes = plcc_rank_loss(overall.float(), aes)
            l_tech = plcc_rank_loss(tech.float(), qual)
            loss = l_aes + cfg.get("tech_weight", 0.5) * l_tech
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            meter += torch.stack([l_aes.detach(), l_tech.detach(), torch.ones((), device=device)])
        dist.all_reduce(meter)

        res = evaluate(model, test_loader, device, len(test_ds))
        if rank == 0:
            print(f"epoch {epoch}: l_aes {meter[0] / meter[2]:.4f} l_tech {meter[1] / meter[2]:.4f} | "
                  + " ".join(f"{k} {v:.4f}" for k, v in res.items()), flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "res": res},
                       os.path.join(cfg["out_dir"], "last.pth"))
            if res["aes_srcc"] > best:
                best = res["aes_srcc"]
                torch.save({"model": model.module.state_dict(), "epoch": epoch, "res": res},
                           os.path.join(cfg["out_dir"], "best.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
