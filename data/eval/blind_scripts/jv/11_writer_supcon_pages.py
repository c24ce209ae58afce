"""Supervised-contrastive writer retrieval on CVL page images (writer-disjoint train / val lists).

Two random crops of the same page form a positive pair; all pages of the same writer are
positives too (SupCon). Retrieval mAP on the held-out writers is computed over the full
validation set, gathered from all ranks.

    torchrun --nproc_per_node=4 11_writer_supcon_pages.py cfg=configs/supcon_cvl.yaml
"""
import math
import os
import sys
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision.transforms as T
from omegaconf import OmegaConf
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

BASE_CFG = OmegaConf.create({
    "data": {"train_list": "lists/cvl_train.txt", "val_list": "lists/cvl_val_writers.txt", "crop": 320,
             "eval_size": 768, "workers": 8},
    "model": {"arch": "resnet50", "dim": 128, "temperature": 0.07},
    "optim": {"lr": 0.3, "ref_batch": 256, "weight_decay": 1e-4, "epochs": 100, "warmup_epochs": 5},
    "batch_per_gpu": 48,
    "out": "runs/supcon",
    "seed": 3,
})


def load_cfg():
    cli = OmegaConf.from_dotlist(sys.argv[1:])
    cfg = BASE_CFG
    if "cfg" in cli:
        cfg = OmegaConf.merge(cfg, OmegaConf.load(cli.pop("cfg")))
    return OmegaConf.merge(cfg, cli)


def read_list(path):
    """<image path> <writer id> per line"""
    rows = []
    with open(path) as f:
        for line in f:
            p, w = line.split()
            rows.append((p, w))
    return rows


class TwoCrops(Dataset):
    def __init__(self, rows, crop):
        self.rows = rows
        writers = sorted({w for _, w in rows})
        self.w2i = {w: i for i, w in enumerate(writers)}
        self.tf = T.Compose([T.Grayscale(), T.RandomCrop(crop, pad_if_needed=True, fill=255),
                             T.RandomApply([T.GaussianBlur(3)], p=0.3), T.ToTensor(), T.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        p, w = self.rows[i]
        img = Image.open(p)
        return torch.stack([self.tf(img), self.tf(img)]), self.w2i[w]


class EvalPages(Dataset):
    def __init__(self, rows, size):
        self.rows = rows
        writers = sorted({w for _, w in rows})
        self.w2i = {w: i for i, w in enumerate(writers)}
        self.tf = T.Compose([T.Grayscale(), T.Resize(size), T.CenterCrop(size), T.ToTensor(),
                             T.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        p, w = self.rows[i]
        return self.tf(Image.open(p)), self.w2i[w]


class Encoder(nn.Module):
    def __init__(self, arch, dim):
        super().__init__()
        self.backbone = timm.create_model(arch, pretrained=False, in_chans=1, num_classes=0, global_pool="avg")
        nf = self.backbone.num_features
        self.proj = nn.Sequential(nn.Linear(nf, nf), nn.ReLU(inplace=True), nn.Linear(nf, dim))

    def forward(self, x, project=True):
        h = self.backbone(x)
        return F.normalize(self.proj(h), dim=1) if project else F.normalize(h, dim=1)


def supcon_loss(z, labels, temperature):
    """z: (2B, D) normalised, labels: (2B,)"""
    sim = z @ z.t() / temperature
    self_mask = torch.eye(len(z), dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(self_mask, -1e9)
    pos = (labels[:, None] == labels[None, :]) & ~self_mask
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    return -((log_prob * pos).sum(1) / pos.sum(1).clamp(min=1)).mean()


def map_top1(feats, labels):
    sim = feats @ feats.t()
    sim.fill_diagonal_(-float("inf"))
    order = sim.argsort(1, descending=True)[:, :-1]
    rel = (labels[order] == labels[:, None]).float()
    cum = rel.cumsum(1) / torch.arange(1, rel.size(1) + 1, device=rel.device)
    n = rel.sum(1)
    valid = n > 0
    return ((cum * rel).sum(1)[valid] / n[valid]).mean().item(), rel[valid, 0].mean().item()


@torch.no_grad()
def evaluate(encoder, val_ds, rank, world, device, workers):
    encoder.eval()
    shard = torch.utils.data.Subset(val_ds, list(range(rank, len(val_ds), world)))
    loader = DataLoader(shard, batch_size=32, num_workers=workers)
    feats, labels = [], []
    for x, y in loader:
        feats.append(encoder(x.to(device, non_blocking=True), project=False))
        labels.append(y.to(device))
    feats, labels = torch.cat(feats), torch.cat(labels)
    all_feats = [torch.zeros_like(feats) for _ in range(world)]
    all_labels = [torch.zeros_like(labels) for _ in range(world)]
    dist.all_gather(all_feats, feats)
    dist.all_gather(all_labels, labels)
    encoder.train()
    return map_top1(torch.cat(all_feats), torch.cat(all_labels))


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(cfg.seed + rank)

    train_ds = TwoCrops(read_list(cfg.data.train_list), cfg.data.crop)
    val_ds = EvalPages(read_list(cfg.data.val_list), cfg.data.eval_size)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg.batch_per_gpu, sampler=sampler, num_workers=cfg.data.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    encoder = nn.SyncBatchNorm.convert_sync_batchnorm(Encoder(cfg.model.arch, cfg.model.dim)).to(device)
    model = DDP(encoder, device_ids=[local_rank])
    global_batch = cfg.batch_per_gpu * world
    base_lr = cfg.optim.lr * global_batch / cfg.optim.ref_batch
    opt = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=0.9, weight_decay=cfg.optim.weight_decay)
    steps_per_epoch = len(loader)
    total, warm = cfg.optim.epochs * steps_per_epoch, cfg.optim.warmup_epochs * steps_per_epoch

    def lr_at(step):
        if step < warm:
            return base_lr * (step + 1) / warm
        return base_lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))

    if rank == 0:
        os.makedirs(cfg.out, exist_ok=True)
        OmegaConf.save(cfg, os.path.join(cfg.out, "config.yaml"))
    best, step = 0.0, 0
    for epoch in range(cfg.optim.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for views, y in loader:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            b = views.shape[0]
            views = views.flatten(0, 1).to(device, non_blocking=True)   # (2B, 1, H, W), pairs adjacent
            y = y.to(device).repeat_interleave(2)
            z = model(views)
            loss = supcon_loss(z, y, cfg.model.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} lr {lr_at(step):.4f}", flush=True)

        if (epoch + 1) % 5 == 0 or epoch + 1 == cfg.optim.epochs:
            m_ap, top1 = evaluate(encoder, val_ds, rank, world, device, cfg.data.workers)
            if rank == 0:
                print(f"epoch {epoch} ({time.time() - t0:.0f}s): mAP {m_ap:.4f} top1 {top1:.4f}", flush=True)
                torch.save({"encoder": encoder.state_dict(), "epoch": epoch, "mAP": m_ap},
                           os.path.join(cfg.out, "last.pt"))
                if m_ap > best:
                    best = m_ap
                    torch.save({"encoder": encoder.state_dict(), "epoch": epoch, "mAP": m_ap},
                               os.path.join(cfg.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
