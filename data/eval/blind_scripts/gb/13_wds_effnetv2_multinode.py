"""EfficientNetV2-S on a 12M-image product catalogue stored as webdataset shards.

Two nodes, 8 GPUs each:
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node01:29500 \
      13_wds_effnetv2_multinode.py --cfg configs/effv2s_catalog.yaml
"""
import argparse
import os
import time
from dataclasses import dataclass, field

import kornia.augmentation as K
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision.transforms as T
import webdataset as wds
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP


@dataclass
class Config:
    train_shards: str = "/mnt/weka/catalog-wds/train-{000000..000999}.tar"
    val_shards: str = "/mnt/weka/catalog-wds/val-{000000..000015}.tar"
    num_classes: int = 11842
    model: str = "tf_efficientnetv2_s"
    epochs: int = 30
    batch_size: int = 96
    lr: float = 1e-3
    lr_ref_batch: int = 1024
    weight_decay: float = 0.05
    workers: int = 8
    img_size: int = 288
    out_dir: str = "/mnt/weka/experiments/effv2s_catalog"
    log_every: int = 50
    mean: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list = field(default_factory=lambda: [0.5, 0.5, 0.5])


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = Config()
    if a.cfg:
        with open(a.cfg) as f:
            for k, v in yaml.safe_load(f).items():
                setattr(cfg, k, v)
    return cfg


def make_loader(urls, cfg, train):
    size = cfg.img_size
    if train:
        tf = T.Compose([T.RandomResizedCrop(size, scale=(0.2, 1.0), antialias=True), T.PILToTensor()])
    else:
        tf = T.Compose([T.Resize(int(size * 1.14)), T.CenterCrop(size), T.PILToTensor()])
    ds = wds.WebDataset(urls, nodesplitter=wds.split_by_node, shardshuffle=train,
                        handler=wds.warn_and_continue)
    if train:
        ds = ds.shuffle(4000)
    ds = (ds.decode("pil", handler=wds.warn_and_continue)
          .to_tuple("jpg", "cls")
          .map_tuple(tf, int)
          .batched(cfg.batch_size, partial=not train))
    return wds.WebLoader(ds, batch_size=None, num_workers=cfg.workers, pin_memory=True,
                         persistent_workers=train)


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    train_loader = make_loader(cfg.train_shards, cfg, train=True)
    val_loader = make_loader(cfg.val_shards, cfg, train=False)

    aug = K.AugmentationSequential(
        K.RandomHorizontalFlip(),
        K.ColorJitter(0.2, 0.2, 0.2, 0.02, p=0.5),
        K.RandomAffine(degrees=10, translate=(0.05, 0.05), p=0.3),
    ).to(dev)
    mean = torch.tensor(cfg.mean, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(cfg.std, device=dev).view(1, 3, 1, 1)

    model = timm.create_model(cfg.model, num_classes=cfg.num_classes,
                              drop_path_rate=0.2)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(dev)
    model = DDP(model, device_ids=[local_rank])

    lr = cfg.lr * cfg.batch_size * world / cfg.lr_ref_batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.epochs, eta_min=lr * 0.01)
    scaler = torch.cuda.amp.GradScaler()
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)

    for epoch in range(cfg.epochs):
        model.train()
        t0, seen = time.time(), 0
        for step, (img, lbl) in enumerate(train_loader):
            img = img.to(dev, non_blocking=True).float().div_(255)
            lbl = lbl.to(dev, non_blocking=True)
            with torch.no_grad():
                img = (aug(img) - mean) / std
            with torch.autocast("cuda", dtype=torch.float16):
                loss = criterion(model(img), lbl)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            seen += img.size(0)
            if rank == 0 and step % cfg.log_every == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} "
                      f"{seen * world / (time.time() - t0):.0f} img/s", flush=True)
        scheduler.step()

        model.eval()
        counts = torch.zeros(2, device=dev)
        with torch.no_grad():
            for img, lbl in val_loader:
                img = (img.to(dev, non_blocking=True).float().div_(255) - mean) / std
                lbl = lbl.to(dev, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    pred = model.module(img).argmax(1)
                counts[0] += (pred == lbl).sum()
                counts[1] += lbl.numel()
        dist.all_reduce(counts)
        if rank == 0:
            print(f"epoch {epoch} val acc {100 * counts[0].item() / max(1, counts[1].item()):.2f} "
                  f"epoch time {time.time() - t0:.0f}s", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                       os.path.join(cfg.out_dir, f"epoch_{epoch:03d}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
