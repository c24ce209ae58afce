"""STFPM (student-teacher feature pyramid matching) for PCB assembly inspection.

Teacher: ImageNet ResNet18, frozen. Student: same architecture, random init,
trained to mimic the teacher on good boards only. Anomaly map = product of
the per-level (1 - cosine similarity) maps, upsampled to input size.

Run:
    torchrun --standalone --nproc_per_node=4 07_stfpm_pcb.py --cfg cfg/pcb_stfpm.json
"""
import argparse
import json
import os
import time
from dataclasses import dataclass, asdict, field
from typing import List

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from sklearn.metrics import roc_auc_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import models, transforms


@dataclass
class Config:
    train_dir: str = "/data/pcb/train/good"
    test_dir: str = "/data/pcb/test"
    out_dir: str = "/shared/pcb/stfpm"
    img_size: int = 256
    batch_size: int = 16          # per GPU
    epochs: int = 200
    lr: float = 0.4               # SGD, global batch 32 as in the STFPM paper
    momentum: float = 0.9
    weight_decay: float = 1e-4
    layers: List[str] = field(default_factory=lambda: ["layer1", "layer2", "layer3"])
    eval_interval: int = 10
    workers: int = 8


class ImageList(Dataset):
    def __init__(self, root, size, with_labels=False):
        exts = (".png", ".jpg", ".bmp")
        self.files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.lower().endswith(exts))
        self.with_labels = with_labels
        self.tf = transforms.Compose([transforms.Resize((size, size)), transforms.ToTensor(),
                                      transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x = self.tf(Image.open(self.files[i]).convert("RGB"))
        if not self.with_labels:
            return x
        label = 0 if os.path.basename(os.path.dirname(self.files[i])) == "good" else 1
        return x, label


class Pyramid(nn.Module):
    def __init__(self, pretrained, layers):
        super().__init__()
        net = models.resnet18(weights=models.ResNet18_Weights.IMAGENET1K_V1 if pretrained else None)
        self.stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        self.blocks = nn.ModuleDict({n: getattr(net, n) for n in ["layer1", "layer2", "layer3"]})
        self.layers = layers

    def forward(self, x):
        feats = []
        x = self.stem(x)
        for name, block in self.blocks.items():
            x = block(x)
            if name in self.layers:
                feats.append(x)
        return feats


class STFPM(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.teacher = Pyramid(True, layers)
        self.student = Pyramid(False, layers)
        for p in self.teacher.parameters():
            p.requires_grad_(False)
        self.teacher.eval()

    def train(self, mode=True):
        super().train(mode)
        self.teacher.eval()  # teacher BN stats must stay frozen
        return self

    def forward(self, x):
        with torch.no_grad():
            t_feats = self.teacher(x)
        s_feats = self.student(x)
        return t_feats, s_feats

    @staticmethod
    def loss(t_feats, s_feats):
        total = 0.0
        for t, s in zip(t_feats, s_feats):
            t, s = F.normalize(t, dim=1), F.normalize(s, dim=1)
            total = total + 0.5 * ((t - s) ** 2).sum(dim=1).mean()
        return total

    @torch.no_grad()
    def anomaly_map(self, x):
        t_feats, s_feats = self.forward(x)
        amap = torch.ones(x.shape[0], 1, x.shape[2], x.shape[3], device=x.device)
        for t, s in zip(t_feats, s_feats):
            sim = F.cosine_similarity(t, s, dim=1).unsqueeze(1)
            amap = amap * F.interpolate(1 - sim, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return amap


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    scores, labels = [], []
    for x, y in loader:
        amap = model.anomaly_map(x.to(device, non_blocking=True))
        scores.append(amap.flatten(1).max(1).values.cpu())
        labels.append(y)
    model.train()
    return roc_auc_score(torch.cat(labels).numpy(), torch.cat(scores).numpy())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default=None, help="json file overriding Config fields")
    cli = parser.parse_args()
    cfg = Config()
    if cli.cfg:
        with open(cli.cfg) as f:
            for k, v in json.load(f).items():
                setattr(cfg, k, v)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_ds = ImageList(cfg.train_dir, cfg.img_size)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                          pin_memory=True, drop_last=True)
    test_dl = None
    if rank == 0:
        test_dl = DataLoader(ImageList(cfg.test_dir, cfg.img_size, with_labels=True), batch_size=32,
                             num_workers=cfg.workers)
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)

    model = STFPM(cfg.layers)
    model.student = nn.SyncBatchNorm.convert_sync_batchnorm(model.student)
    model = model.to(device)
    model = DDP(model, device_ids=[local_rank])

    lr = cfg.lr * cfg.batch_size * world / 32
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr,
                          momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    best_auroc = 0.0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        running = torch.zeros(2, device=device)
        for x in train_dl:
            x = x.to(device, non_blocking=True)
            t_feats, s_feats = model(x)
            loss = STFPM.loss(t_feats, s_feats)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            running += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(running)

        if rank == 0:
            msg = f"epoch {epoch + 1}/{cfg.epochs} loss {(running[0] / running[1]).item():.4f} ({time.time() - t0:.0f}s)"
            if (epoch + 1) % cfg.eval_interval == 0:
                auroc = evaluate(model, test_dl, device)
                msg += f" | image AUROC {auroc:.4f}"
                if auroc > best_auroc:
                    best_auroc = auroc
                    torch.save({"student": model.module.student.state_dict(), "epoch": epoch, "auroc": auroc},
                               os.path.join(cfg.out_dir, "student_best.pth"))
            print(msg, flush=True)
        dist.barrier()

    if rank == 0:
        torch.save({"student": model.module.student.state_dict(), "epoch": cfg.epochs},
                   os.path.join(cfg.out_dir, "student_last.pth"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
