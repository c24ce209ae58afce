"""Active learning on Oxford Flowers-102 with test-time-augmentation entropy.

Uncertainty = entropy of the prediction averaged over a few flipped / cropped
views. EfficientNet-B2 (ImageNet weights) is fine-tuned from scratch each round.

    torchrun --standalone --nproc_per_node=4 16_al_flowers_tta_entropy.py --config flowers.yaml
"""
import argparse
import logging
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms as T


@dataclass
class Config:
    root: str = "/datasets"
    out: str = "/shared/al/flowers_tta"
    init_per_class: int = 2
    query: int = 204
    rounds: int = 10
    epochs: int = 40
    batch_size: int = 16          # per GPU
    lr: float = 0.02              # for 4 GPUs x 16
    label_smoothing: float = 0.1
    tta_views: int = 4
    workers: int = 6
    seed: int = 31


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.config:
        with open(a.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, type(getattr(cfg, k))(v))
    return cfg


def build_model(n_classes=102):
    m = torchvision.models.efficientnet_b2(weights=torchvision.models.EfficientNet_B2_Weights.IMAGENET1K_V1)
    m.classifier[1] = nn.Linear(m.classifier[1].in_features, n_classes)
    return m


def tta_views(x, n):
    views = [x, torch.flip(x, dims=[3])]
    if n > 2:
        s = x.shape[-1]
        c = int(s * 0.875)
        o = (s - c) // 2
        crop = F.interpolate(x[..., o:o + c, o:o + c], size=(s, s), mode="bilinear", align_corners=False)
        views += [crop, torch.flip(crop, dims=[3])]
    return views[:n]


@torch.no_grad()
def tta_entropy(net, ds, idx, device, n_views, rank, world):
    chunk = -(-len(idx) // world)
    mine = idx[rank * chunk:(rank + 1) * chunk]
    loader = DataLoader(Subset(ds, mine.tolist()), batch_size=64, num_workers=4, pin_memory=True)
    net.eval()
    out = torch.full((chunk,), -1.0, device=device)
    k = 0
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        p = torch.stack([F.softmax(net(v), 1) for v in tta_views(x, n_views)]).mean(0)
        out[k:k + len(p)] = -(p * p.clamp_min(1e-12).log()).sum(1)
        k += len(p)
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out)
    return torch.cat(parts)[: len(idx)]


@torch.no_grad()
def accuracy(net, ds, device, rank, world):
    part = np.array_split(np.arange(len(ds)), world)[rank]
    net.eval()
    acc = torch.zeros(2, device=device)
    for x, y in DataLoader(Subset(ds, part.tolist()), batch_size=128, num_workers=4):
        y = y.to(device)
        acc[0] += (net(x.to(device)).argmax(1) == y).sum()
        acc[1] += len(y)
    dist.all_reduce(acc)
    return (acc[0] / acc[1]).item()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR,
                        format="%(asctime)s | %(message)s")
    log = logging.getLogger("al")
    tb = SummaryWriter(os.path.join(cfg.out, "tb")) if rank == 0 else None

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    tr = T.Compose([T.RandomResizedCrop(288, scale=(0.3, 1)), T.RandomHorizontalFlip(),
                    T.ColorJitter(0.2, 0.2, 0.2, 0.05), T.ToTensor(), norm])
    ev = T.Compose([T.Resize(320), T.CenterCrop(288), T.ToTensor(), norm])
    # train + val form the pool (1020 + 1020 images); test (6149) is held out
    train_ds = ConcatDataset([torchvision.datasets.Flowers102(cfg.root, split=s, transform=tr) for s in ("train", "val")])
    pool_ds = ConcatDataset([torchvision.datasets.Flowers102(cfg.root, split=s, transform=ev) for s in ("train", "val")])
    test_ds = torchvision.datasets.Flowers102(cfg.root, split="test", transform=ev)
    targets = np.concatenate([np.asarray(d._labels) for d in pool_ds.datasets])

    rng = np.random.default_rng(cfg.seed)
    labelled = np.sort(np.concatenate([rng.choice(np.flatnonzero(targets == c), cfg.init_per_class, replace=False)
                                       for c in range(102)]))
    everything = np.arange(len(pool_ds))

    for rnd in range(cfg.rounds):
        t0 = time.time()
        torch.manual_seed(cfg.seed + rnd)
        model = DDP(build_model().to(device), device_ids=[local_rank])
        sub = Subset(train_ds, labelled.tolist())
        sampler = DistributedSampler(sub, shuffle=True, seed=cfg.seed + rnd, drop_last=True)
        loader = DataLoader(sub, batch_size=cfg.batch_size, sampler=sampler, num_workers=cfg.workers,
                            pin_memory=True, drop_last=True)
        lr = cfg.lr * world / 4
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, epochs=cfg.epochs,
                                                    steps_per_epoch=len(loader), pct_start=0.2)
        scaler = torch.cuda.amp.GradScaler()

        for epoch in range(cfg.epochs):
            model.train()
            epoch_loss = torch.zeros(2, device=device)
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(model(x), y, label_smoothing=cfg.label_smoothing)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                epoch_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            dist.all_reduce(epoch_loss)
            if tb is not None:
                tb.add_scalar(f"round{rnd}/train_loss", (epoch_loss[0] / epoch_loss[1]).item(), epoch)

        acc = accuracy(model.module, test_ds, device, rank, world)
        unl = np.setdiff1d(everything, labelled)
        ent = tta_entropy(model.module, pool_ds, unl, device, cfg.tta_views, rank, world)
        q = unl[torch.topk(ent, min(cfg.query, len(unl))).indices.cpu().numpy()]
        labelled = np.union1d(labelled, q)

        if rank == 0:
            log.info("round %d  labelled %d  test acc %.4f  (%.0fs)", rnd, len(sub), acc, time.time() - t0)
            tb.add_scalar("al/test_acc", acc, len(sub))
            os.makedirs(cfg.out, exist_ok=True)
            torch.save({"cfg": asdict(cfg), "round": rnd, "model": model.module.state_dict(),
                        "labelled": labelled.tolist()}, os.path.join(cfg.out, "last.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
