"""Student-teacher anomaly detection on wafer-die images, tiled at full res.

Die images are 4096x4096; the AOI export already stores each die as a folder
with its 8x8 grid of 512 px tiles (r{row}_c{col}.png). The
teacher is a frozen ImageNet ResNet18 (layers 1-3), the student has the same
architecture from scratch and regresses the teacher's normalised features.

    torchrun --nproc_per_node=8 wafer_st.py --cfg configs/die_type_k7.yaml
"""
import argparse
import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models

Image.MAX_IMAGE_PIXELS = None


@dataclasses.dataclass
class Cfg:
    data_root: str
    die_type: str
    out_dir: str
    tile: int = 512
    grid: int = 8
    epochs: int = 40
    batch_size: int = 16          # per GPU
    lr: float = 0.05
    min_foreground: float = 0.15  # tiles that are mostly scribe line / chuck carry no signal
    eval_every: int = 5
    workers: int = 8


class DieTiles(Dataset):
    MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __init__(self, files, cfg, labels=None):
        self.files, self.cfg = files, cfg
        self.labels = labels if labels is not None else [0] * len(files)
        self.n = cfg.grid * cfg.grid

    def __len__(self):
        return len(self.files) * self.n

    def __getitem__(self, i):
        f, t = divmod(i, self.n)
        r, c = divmod(t, self.cfg.grid)
        img = Image.open(self.files[f] / f"r{r}_c{c}.png").convert("RGB")
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255
        # die pattern area is bright metal; scribe lines and chuck are dark
        fg = (x.mean(0) > 0.25).float().mean()
        return (x - self.MEAN) / self.STD, fg, self.labels[f], f


class ResNet18L123(nn.Module):
    def __init__(self, pretrained):
        super().__init__()
        r = models.resnet18(weights=models.ResNet18_Weights.IMAGENET1K_V1 if pretrained else None)
        self.stem = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool)
        self.layers = nn.ModuleList([r.layer1, r.layer2, r.layer3])

    def forward(self, x):
        x = self.stem(x)
        out = []
        for layer in self.layers:
            x = layer(x)
            out.append(x)
        return out


def st_loss(t_feats, s_feats):
    return sum(F.mse_loss(F.normalize(s, dim=1), F.normalize(t, dim=1), reduction="sum") / (s.shape[0] * s.shape[2] * s.shape[3])
               for t, s in zip(t_feats, s_feats))


@torch.no_grad()
def tile_scores(teacher, student, x):
    t_feats, s_feats = teacher(x), student(x)
    amap = None
    for t, s in zip(t_feats, s_feats):
        d = 0.5 * (F.normalize(t, dim=1) - F.normalize(s, dim=1)).pow(2).sum(1, keepdim=True)
        d = F.interpolate(d, size=x.shape[-2:], mode="bilinear", align_corners=False)
        amap = d if amap is None else amap * d
    return amap.flatten(1).amax(1)


@torch.no_grad()
def evaluate(teacher, student, cfg, device):
    """Die score = max tile score; only foreground tiles count. Run on rank 0."""
    student.eval()
    root = Path(cfg.data_root) / cfg.die_type / "test"
    files, labels = [], []
    for d in sorted(root.iterdir()):
        for f in sorted(p for p in d.iterdir() if p.is_dir()):
            files.append(f)
            labels.append(int(d.name != "good"))
    ds = DieTiles(files, cfg, labels)
    die_score = np.zeros(len(files))
    for x, fg, _, fidx in DataLoader(ds, batch_size=32, num_workers=cfg.workers):
        s = tile_scores(teacher, student, x.to(device)).cpu().numpy()
        s[fg.numpy() < cfg.min_foreground] = 0.0
        np.maximum.at(die_score, fidx.numpy(), s)
    student.train()
    return roc_auc_score(labels, die_score)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    cfg = Cfg(**yaml.safe_load(open(ap.parse_args().cfg)))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_files = sorted(p for p in (Path(cfg.data_root) / cfg.die_type / "train" / "good").iterdir() if p.is_dir())
    ds = DieTiles(train_files, cfg)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    teacher = ResNet18L123(pretrained=True).to(device).eval()
    teacher.requires_grad_(False)
    student = ResNet18L123(pretrained=False)
    student = DDP(nn.SyncBatchNorm.convert_sync_batchnorm(student).to(device), device_ids=[local_rank])
    optimizer = torch.optim.SGD(student.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.epochs * len(loader))

    out = Path(cfg.out_dir) / cfg.die_type
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        print(f"{len(train_files)} dies -> {len(ds)} tiles, {len(loader)} steps/epoch on {world} GPUs")

    best = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        stats = torch.zeros(3, device=device)
        for x, fg, _, _ in loader:
            keep = fg >= cfg.min_foreground
            stats[2] += (~keep).sum()
            if not keep.any():
                continue
            x = x[keep].to(device, non_blocking=True)
            with torch.no_grad():
                t_feats = teacher(x)
            loss = st_loss(t_feats, student(x))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            stats[0] += loss.detach()
            stats[1] += 1
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} loss {(stats[0] / stats[1].clamp_min(1)).item():.4f} "
                  f"skipped tiles {int(stats[2].item())} ({time.time() - t0:.0f}s)", flush=True)
            if (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs:
                auroc = evaluate(teacher, student.module, cfg, device)
                print(f"epoch {epoch} die AUROC {auroc:.4f}", flush=True)
                torch.save({"student": student.module.state_dict(), "epoch": epoch, "auroc": auroc},
                           out / "student_last.pt")
                if auroc > best:
                    best = auroc
                    torch.save({"student": student.module.state_dict(), "epoch": epoch, "auroc": auroc},
                               out / "student_best.pt")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
