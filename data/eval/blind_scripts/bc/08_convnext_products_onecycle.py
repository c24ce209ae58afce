"""ConvNeXt fine-tuning on the product-catalogue images (Hydra + MLflow).

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 \
        train_products.py optim.batch_size=96 trainer.epochs=40
"""
import logging
import math
import os
import time
from dataclasses import dataclass, field

import hydra
import mlflow
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from catalogue.data import CatalogueImages

log = logging.getLogger(__name__)


@dataclass
class DataCfg:
    root: str = "/mnt/lustre/catalogue/v12"
    num_classes: int = 4211
    workers: int = 10
    img_size: int = 224


@dataclass
class OptimCfg:
    lr: float = 4e-4
    weight_decay: float = 0.05
    batch_size: int = 96
    pct_warmup: float = 0.05
    mixup: float = 0.8
    cutmix: float = 1.0
    smoothing: float = 0.1


@dataclass
class TrainerCfg:
    epochs: int = 40
    log_every: int = 100
    out_dir: str = "/mnt/lustre/runs/catalogue"
    tracking_uri: str = "http://mlflow.ml-platform.svc:5000"
    experiment: str = "catalogue-convnext"


@dataclass
class Config:
    model: str = "convnext_small.fb_in22k"
    seed: int = 17
    data: DataCfg = field(default_factory=DataCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)


ConfigStore.instance().store(name="config", node=Config)


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    t = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(x).float()
        t[0] += nn.functional.cross_entropy(out, y, reduction="sum")
        t[1] += (out.argmax(-1) == y).sum()
        t[2] += y.numel()
    dist.all_reduce(t)
    net.train()
    return (t[0] / t[2]).item(), (t[1] / t[2]).item()


@hydra.main(config_path=None, config_name="config", version_base="1.3")
def main(cfg: Config):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    train_tf = create_transform(cfg.data.img_size, is_training=True, auto_augment="rand-m9-mstd0.5-inc1",
                                re_prob=0.25, interpolation="bicubic")
    val_tf = create_transform(cfg.data.img_size, is_training=False, interpolation="bicubic")
    train_ds = CatalogueImages(cfg.data.root, "train", train_tf)
    val_ds = CatalogueImages(cfg.data.root, "val", val_tf)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg.optim.batch_size, sampler=sampler,
                              num_workers=cfg.data.workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)),
                            batch_size=2 * cfg.optim.batch_size, num_workers=cfg.data.workers)

    net = timm.create_model(cfg.model, pretrained=True, num_classes=cfg.data.num_classes,
                            drop_path_rate=0.2).to(device)
    model = DDP(net, device_ids=[local_rank])
    mixup = Mixup(mixup_alpha=cfg.optim.mixup, cutmix_alpha=cfg.optim.cutmix,
                  label_smoothing=cfg.optim.smoothing, num_classes=cfg.data.num_classes)
    criterion = SoftTargetCrossEntropy()

    decay = [p for n, p in net.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in net.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.optim.lr)
    steps_per_epoch = math.ceil(len(train_ds) / cfg.optim.batch_size)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.optim.lr, total_steps=cfg.trainer.epochs * steps_per_epoch,
        pct_start=cfg.optim.pct_warmup, anneal_strategy="cos", div_factor=25, final_div_factor=1e3,
    )

    out_dir = cfg.trainer.out_dir
    ckpt_path = os.path.join(out_dir, "last.pt")
    start_epoch, best_acc, run_id = 0, 0.0, None
    if os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc, run_id = ckpt["epoch"] + 1, ckpt["best_acc"], ckpt["run_id"]
        del ckpt

    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        mlflow.set_tracking_uri(cfg.trainer.tracking_uri)
        mlflow.set_experiment(cfg.trainer.experiment)
        run_id = mlflow.start_run(run_id=run_id).info.run_id
        mlflow.log_params({"world_size": world, **OmegaConf.to_container(cfg.optim)})

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg.trainer.epochs):
        sampler.set_epoch(epoch)
        tic = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x, y_soft = mixup(x, y)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = criterion(model(x), y_soft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % cfg.trainer.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    mlflow.log_metrics({"train_loss": l.item(), "lr": scheduler.get_last_lr()[0]}, step=step)

        val_loss, val_acc = evaluate(net, val_loader, device)
        if rank == 0:
            mlflow.log_metrics({"val_loss": val_loss, "val_acc": val_acc,
                                "epoch_sec": time.time() - tic}, step=step)
            log.info("epoch %d val_acc %.4f", epoch, val_acc)
            if val_acc > best_acc:
                best_acc = val_acc
                torch.save(net.state_dict(), os.path.join(out_dir, "best.pt"))
            torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch, "best_acc": best_acc,
                        "run_id": run_id}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
