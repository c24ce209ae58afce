"""
Surface-defect classifier for the line-3 inspection cameras (7 classes).
Small in-house trainer: callbacks, EMA weights, AMP, rotating checkpoints.

    torchrun --nproc_per_node=4 12_defect_trainer_ema_amp.py --data /mnt/nas/defects/v7 --out runs/effb2_v7
"""
import argparse
import copy
import glob
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

logger = logging.getLogger("defect")


class ModelEMA:
    def __init__(self, model, decay=0.9998):
        self.ema = copy.deepcopy(model).eval()
        self.decay = decay
        for p in self.ema.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def update(self, model):
        msd = model.state_dict()
        for k, v in self.ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(self.decay).add_(msd[k].detach(), alpha=1 - self.decay)
            else:
                v.copy_(msd[k])


class CheckpointManager:
    def __init__(self, dirpath, keep_last=3, monitor="val_f1", mode="max"):
        self.dirpath, self.keep_last, self.monitor, self.mode = dirpath, keep_last, monitor, mode
        self.best = -math.inf if mode == "max" else math.inf
        os.makedirs(dirpath, exist_ok=True)

    def _better(self, v):
        return v > self.best if self.mode == "max" else v < self.best

    def save(self, state, epoch, metrics):
        path = os.path.join(self.dirpath, f"epoch_{epoch:03d}.pt")
        torch.save(state, path)
        if self._better(metrics[self.monitor]):
            self.best = metrics[self.monitor]
            torch.save(state, os.path.join(self.dirpath, "best.pt"))
        for old in sorted(glob.glob(os.path.join(self.dirpath, "epoch_*.pt")))[: -self.keep_last]:
            os.remove(old)


class Callback:
    def on_epoch_end(self, trainer, metrics):
        pass


class LogCallback(Callback):
    def on_epoch_end(self, trainer, metrics):
        if trainer.is_main:
            logger.info("epoch %d | %s", trainer.epoch, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))


class CheckpointCallback(Callback):
    def __init__(self, manager):
        self.manager = manager

    def on_epoch_end(self, trainer, metrics):
        self.manager.save(trainer.state_dict(), trainer.epoch, metrics)


class Trainer:
    def __init__(self, model, train_set, val_set, cfg, callbacks):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.device = torch.device("cuda", self.local_rank)
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(self.device)
        self.ema = ModelEMA(model, cfg.ema_decay)
        self.model = DDP(model, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.05)
        self.scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)
        self.train_sampler = DistributedSampler(train_set, shuffle=True)
        self.train_loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=self.train_sampler,
                                       num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
        self.val_loader = DataLoader(val_set, batch_size=cfg.batch_size * 2,
                                     sampler=DistributedSampler(val_set, shuffle=False), num_workers=8)
        total = cfg.epochs * len(self.train_loader)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=cfg.lr, total_steps=total, pct_start=0.05)
        self.callbacks, self.epoch, self.num_classes = callbacks, 0, len(train_set.classes)

    def state_dict(self):
        return {"model": self.model.module.state_dict(), "ema": self.ema.ema.state_dict(),
                "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                "scaler": self.scaler.state_dict(), "epoch": self.epoch}

    def load(self, path):
        st = torch.load(path, map_location=self.device)
        self.model.module.load_state_dict(st["model"]); self.ema.ema.load_state_dict(st["ema"])
        self.opt.load_state_dict(st["opt"]); self.sched.load_state_dict(st["sched"])
        self.scaler.load_state_dict(st["scaler"]); self.epoch = st["epoch"] + 1

    def train_one_epoch(self):
        self.model.train()
        self.train_sampler.set_epoch(self.epoch)
        loss_sum = torch.zeros(2, device=self.device)
        for x, y in self.train_loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                loss = F.cross_entropy(self.model(x), y, label_smoothing=0.1)
            self.opt.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            nn.utils.clip_grad_norm_(self.model.parameters(), 2.0)
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            self.ema.update(self.model.module)
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        dist.all_reduce(loss_sum)
        return (loss_sum[0] / loss_sum[1]).item()

    @torch.no_grad()
    def validate(self):
        net = self.ema.ema
        conf = torch.zeros(self.num_classes, self.num_classes, device=self.device, dtype=torch.long)
        for x, y in self.val_loader:
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16, enabled=self.cfg.amp):
                pred = net(x).argmax(1)
            conf += torch.bincount(y * self.num_classes + pred, minlength=self.num_classes ** 2).view_as(conf)
        dist.all_reduce(conf)
        tp = conf.diag().float()
        prec = tp / conf.sum(0).clamp(min=1)
        rec = tp / conf.sum(1).clamp(min=1)
        f1 = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
        return {"val_acc": (tp.sum() / conf.sum()).item(), "val_f1": f1.mean().item()}

    def fit(self):
        while self.epoch < self.cfg.epochs:
            t0 = time.time()
            metrics = {"train_loss": self.train_one_epoch(), **self.validate()}
            metrics["epoch_time"] = time.time() - t0
            for cb in self.callbacks:
                cb.on_epoch_end(self, metrics)
            self.epoch += 1


def build_datasets(root, img_size):
    norm = transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(img_size, scale=(0.6, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.RandomVerticalFlip(),
                                   transforms.ColorJitter(0.2, 0.2, 0.1), transforms.ToTensor(), norm])
    val_tf = transforms.Compose([transforms.Resize(img_size), transforms.CenterCrop(img_size),
                                 transforms.ToTensor(), norm])
    return (datasets.ImageFolder(os.path.join(root, "train"), train_tf),
            datasets.ImageFolder(os.path.join(root, "val"), val_tf))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/defect")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--img-size", type=int, default=288)
    ap.add_argument("--ema-decay", type=float, default=0.9998)
    ap.add_argument("--no-amp", dest="amp", action="store_false")
    ap.add_argument("--resume", default=None)
    cfg = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    logging.basicConfig(level=logging.INFO if dist.get_rank() == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    train_set, val_set = build_datasets(cfg.data, cfg.img_size)
    weights = models.EfficientNet_B2_Weights.IMAGENET1K_V1
    if local_rank == 0:
        weights.get_state_dict(progress=False)          # fill the per-node torch hub cache once
    dist.barrier()
    model = models.efficientnet_b2(weights=weights)
    model.classifier[-1] = nn.Linear(model.classifier[-1].in_features, len(train_set.classes))
    callbacks = [LogCallback(), CheckpointCallback(CheckpointManager(cfg.out, keep_last=3))]
    trainer = Trainer(model, train_set, val_set, cfg, callbacks)
    if cfg.resume:
        trainer.load(cfg.resume)
    trainer.fit()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
