"""Semantic segmentation (DeepLabV3+) on our aerial tiles.

    torchrun --nproc_per_node=8 07_segmentation_syncbn.py model=deeplabv3p_r50 data.crop=512
"""
import logging
import os
import random
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

IGNORE_INDEX = 255


class TileDataset(Dataset):
    def __init__(self, root, transform=None):
        self.images = sorted(Path(root, "images").glob("*.png"))
        self.masks = [Path(root, "masks", p.name) for p in self.images]
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        img = np.asarray(Image.open(self.images[i]).convert("RGB"))
        mask = np.asarray(Image.open(self.masks[i]))
        if self.transform is not None:
            out = self.transform(image=img, mask=mask)
            img, mask = out["image"], out["mask"]
        return img, mask.long()


class TransformedSubset(Dataset):
    def __init__(self, subset, transform):
        self.subset, self.transform = subset, transform

    def __len__(self):
        return len(self.subset)

    def __getitem__(self, i):
        ds = self.subset.dataset
        idx = self.subset.indices[i]
        img = np.asarray(Image.open(ds.images[idx]).convert("RGB"))
        mask = np.asarray(Image.open(ds.masks[idx]))
        out = self.transform(image=img, mask=mask)
        return out["image"], out["mask"].long()


def worker_init_fn(worker_id):
    # numpy / random state differs per worker and per rank for augmentation
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def split_indices(n, val_fraction, seed):
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    n_val = int(n * val_fraction)
    return perm[n_val:], perm[:n_val]


@torch.no_grad()
def evaluate(model, loader, device, num_classes):
    model.eval()
    hist = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    for img, mask in loader:
        img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        logits = model(img)
        logits = F.interpolate(logits, size=mask.shape[-2:], mode="bilinear", align_corners=False)
        pred = logits.argmax(1)
        valid = mask != IGNORE_INDEX
        hist += torch.bincount(mask[valid] * num_classes + pred[valid],
                               minlength=num_classes ** 2).view(num_classes, num_classes)
    dist.all_reduce(hist)
    iou = hist.diag().float() / (hist.sum(0) + hist.sum(1) - hist.diag()).float().clamp(min=1)
    model.train()
    return iou.mean().item(), iou.cpu().tolist()


@hydra.main(version_base="1.3", config_path="configs", config_name="seg")
def main(cfg: DictConfig):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    # identical model init on every rank; augmentation RNG is made per-rank below
    torch.manual_seed(cfg.seed)
    # each rank resolves ${now:...} in hydra.run.dir on its own; use rank 0's directory everywhere
    obj = [HydraConfig.get().runtime.output_dir]
    dist.broadcast_object_list(obj, src=0)
    out_dir = Path(obj[0])

    full = TileDataset(to_absolute_path(cfg.data.root))
    train_idx, val_idx = split_indices(len(full), cfg.data.val_fraction, cfg.seed)
    train_set = TransformedSubset(Subset(full, train_idx), instantiate(cfg.data.train_transform))
    val_set = TransformedSubset(Subset(full, val_idx), instantiate(cfg.data.val_transform))

    torch.manual_seed(cfg.seed + rank)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    # strided shard instead of DistributedSampler so no tile is counted twice in the mIoU
    val_shard = Subset(val_set, list(range(rank, len(val_set), world)))
    train_loader = DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True,
                              worker_init_fn=worker_init_fn, persistent_workers=True)
    val_loader = DataLoader(val_shard, batch_size=1, shuffle=False, num_workers=2, pin_memory=True)

    model = instantiate(cfg.model, num_classes=cfg.data.num_classes)
    # per-GPU batch is small for 512 crops, so BN statistics are synchronised across GPUs
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    backbone_params = [p for n, p in model.module.named_parameters() if n.startswith("backbone.")]
    head_params = [p for n, p in model.module.named_parameters() if not n.startswith("backbone.")]
    optimizer = torch.optim.SGD(
        [{"params": backbone_params, "lr": cfg.optim.lr}, {"params": head_params, "lr": cfg.optim.lr * 10}],
        lr=cfg.optim.lr, momentum=0.9, weight_decay=cfg.optim.weight_decay)
    max_iter = cfg.train.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=max_iter, power=0.9)
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    start_epoch, best_miou = 0, 0.0
    last_ckpt = out_dir / "last.pt"
    if last_ckpt.exists():
        ckpt = torch.load(last_ckpt, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_miou = ckpt["epoch"] + 1, ckpt["best_miou"]
        if rank == 0:
            log.info("resuming from epoch %d", start_epoch)

    for epoch in range(start_epoch, cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        for it, (img, mask) in enumerate(train_loader):
            img, mask = img.to(device, non_blocking=True), mask.to(device, non_blocking=True)
            out = model(img)
            out = F.interpolate(out, size=mask.shape[-2:], mode="bilinear", align_corners=False)
            loss = criterion(out, mask)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % cfg.train.log_every == 0:
                log.info("epoch %d it %d/%d loss %.4f lr %.5f", epoch, it, len(train_loader),
                         loss.item(), optimizer.param_groups[0]["lr"])

        if (epoch + 1) % cfg.train.eval_every == 0 or epoch + 1 == cfg.train.epochs:
            miou, per_class = evaluate(model, val_loader, device, cfg.data.num_classes)
            if rank == 0:
                log.info("epoch %d mIoU %.4f per-class %s", epoch, miou, np.round(per_class, 3).tolist())
            best_miou = max(best_miou, miou)

        if rank == 0:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "best_miou": best_miou,
                     "cfg": OmegaConf.to_container(cfg, resolve=True)}
            torch.save(state, out_dir / "last.pt.tmp")
            os.replace(out_dir / "last.pt.tmp", last_ckpt)
        dist.barrier()

    if rank == 0:
        log.info("done, best mIoU %.4f", best_miou)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
