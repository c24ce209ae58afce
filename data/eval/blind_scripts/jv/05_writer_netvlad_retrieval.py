"""Writer identification / retrieval: ResNet-50 patch encoder + NetVLAD page descriptor.

Training is writer classification on random page patches (surrogate task); validation is
page-level retrieval (leave-one-out mAP / top-1) on writers never seen in training.

    torchrun --nproc_per_node=4 05_writer_netvlad_retrieval.py --config configs/cvl_netvlad.yaml
"""
import argparse
import csv
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T
import wandb
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    train_csv="data/cvl_train.csv",   # columns: path,writer  (writers 1-27 and 28-310 are disjoint sets)
    val_csv="data/cvl_val.csv",
    out_dir="runs/netvlad",
    patch=256,
    patches_per_page=8,
    batch_size=64,            # global
    epochs=40,
    lr=0.05,
    clusters=64,
    workers=8,
    project="writer-retrieval",
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ap.add_argument("--no-wandb", action="store_true")
    args = ap.parse_args()
    cfg = dict(DEFAULTS)
    if args.config:
        with open(args.config) as f:
            cfg.update(yaml.safe_load(f) or {})
    cfg["wandb"] = not args.no_wandb
    return argparse.Namespace(**cfg)


def read_csv(path):
    with open(path) as f:
        return [(r["path"], r["writer"]) for r in csv.DictReader(f)]


class PatchDataset(Dataset):
    """Each item is a stack of random patches from one page."""

    def __init__(self, rows, writer_ids, patch, n_patches, train):
        self.rows = rows
        self.labels = [writer_ids[w] for _, w in rows]
        self.n = n_patches
        crop = T.RandomCrop(patch, pad_if_needed=True, fill=255) if train else T.CenterCrop(patch)
        self.tf = T.Compose([T.Grayscale(3), crop, T.ToTensor(), T.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        img = Image.open(self.rows[i][0]).convert("L")
        return torch.stack([self.tf(img) for _ in range(self.n)]), self.labels[i]


class PageDataset(Dataset):
    """Whole page, downscaled, for page-level descriptors."""

    def __init__(self, rows, writer_ids, long_side=1024):
        self.rows = rows
        self.labels = [writer_ids[w] for _, w in rows]
        self.tf = T.Compose([T.Grayscale(3), T.Resize(long_side - 1, max_size=long_side), T.ToTensor(),
                             T.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.tf(Image.open(self.rows[i][0]).convert("L")), self.labels[i]


class NetVLAD(nn.Module):
    def __init__(self, k, dim):
        super().__init__()
        self.assign = nn.Conv2d(dim, k, 1)
        self.centroids = nn.Parameter(torch.randn(k, dim) * 0.1)

    def forward(self, x):
        b, c = x.shape[:2]
        x = F.normalize(x, dim=1)
        a = F.softmax(self.assign(x).flatten(2), dim=1)          # B, K, N
        x = x.flatten(2)                                          # B, C, N
        vlad = torch.einsum("bkn,bcn->bkc", a, x) - a.sum(-1, keepdim=True) * self.centroids[None]
        vlad = F.normalize(vlad, dim=2).flatten(1)
        return F.normalize(vlad, dim=1)


class WriterEncoder(nn.Module):
    def __init__(self, n_writers, clusters):
        super().__init__()
        r = torchvision.models.resnet50(weights=None)
        self.body = nn.Sequential(*list(r.children())[:-3])  # up to layer3 -> 1024 ch
        self.reduce = nn.Conv2d(1024, 256, 1)
        self.vlad = NetVLAD(clusters, 256)
        self.cls = nn.Linear(clusters * 256, n_writers)

    def descriptor(self, x):
        return self.vlad(self.reduce(self.body(x)))

    def forward(self, x):
        d = self.descriptor(x)
        return self.cls(d), d


def retrieval_scores(desc, labels):
    sim = desc @ desc.t()
    sim.fill_diagonal_(-2.0)
    order = sim.argsort(1, descending=True)[:, :-1]
    rel = (labels[order] == labels[:, None]).float()
    prec = rel.cumsum(1) / torch.arange(1, rel.shape[1] + 1, device=rel.device)
    n_rel = rel.sum(1)
    ok = n_rel > 0
    ap = (prec * rel).sum(1)[ok] / n_rel[ok]
    return ap.mean().item(), rel[ok, 0].mean().item()


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    descs, labels = [], []
    for page, y in loader:
        descs.append(model.descriptor(page.to(device)))
        labels.append(y.to(device))
    model.train()
    return retrieval_scores(torch.cat(descs), torch.cat(labels))


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train_rows, val_rows = read_csv(cfg.train_csv), read_csv(cfg.val_csv)
    train_writers = {w: i for i, w in enumerate(sorted({w for _, w in train_rows}))}
    val_writers = {w: i for i, w in enumerate(sorted({w for _, w in val_rows}))}
    train_ds = PatchDataset(train_rows, train_writers, cfg.patch, cfg.patches_per_page, train=True)
    val_ds = PageDataset(val_rows, val_writers)

    per_gpu = cfg.batch_size // world
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=per_gpu, sampler=train_sampler, num_workers=cfg.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=1, sampler=val_sampler, num_workers=4)

    model = WriterEncoder(len(train_writers), cfg.clusters)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs * len(train_loader))
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        if cfg.wandb:
            wandb.init(project=cfg.project, config=vars(cfg), dir=cfg.out_dir)

    best_map = 0.0
    for epoch in range(cfg.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (patches, y) in enumerate(train_loader):
            b, n = patches.shape[:2]
            patches = patches.flatten(0, 1).to(device, non_blocking=True)
            y = y.to(device).repeat_interleave(n)
            logits, _ = model(patches)
            loss = criterion(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 50 == 0 and cfg.wandb:
                wandb.log({"loss": loss.item(), "lr": sched.get_last_lr()[0],
                           "epoch": epoch + it / len(train_loader)})

        m_ap, top1 = evaluate(model.module, val_loader, device)
        if rank == 0:
            print(f"[{epoch:03d}] {time.time() - t0:.0f}s  mAP {m_ap:.4f}  top-1 {top1:.4f}", flush=True)
            if cfg.wandb:
                wandb.log({"val/mAP": m_ap, "val/top1": top1, "epoch": epoch + 1})
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                    "mAP": m_ap, "writers": train_writers}
            torch.save(ckpt, os.path.join(cfg.out_dir, "last.pt"))
            if m_ap > best_map:
                best_map = m_ap
                torch.save(ckpt, os.path.join(cfg.out_dir, "best.pt"))
        dist.barrier()

    if rank == 0 and cfg.wandb:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
