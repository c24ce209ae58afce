"""CIFAR-100 ResNet baseline (structured Hydra config, no yaml needed).

    torchrun --standalone --nproc_per_node=4 03_cifar_resnet.py optim.lr=0.2 train.epochs=200
"""
import logging
import os
from dataclasses import dataclass, field
from typing import Any, List

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import MISSING, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

log = logging.getLogger(__name__)


@dataclass
class DistConfig:
    backend: str = "nccl"
    local_rank: int = 0
    init_method: str = "env://"


@dataclass
class DataConfig:
    root: str = "data/cifar100"
    batch_size: int = 128
    num_workers: int = 8


@dataclass
class OptimConfig:
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    nesterov: bool = True


@dataclass
class TrainConfig:
    epochs: int = 200
    label_smoothing: float = 0.1
    log_every: int = 50
    milestones: List[int] = field(default_factory=lambda: [60, 120, 160])
    gamma: float = 0.2


@dataclass
class ModelConfig:
    _target_: str = "torchvision.models.resnet18"
    num_classes: int = 100


@dataclass
class Config:
    seed: int = 0
    dist: DistConfig = field(default_factory=DistConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    resume: Any = None


cs = ConfigStore.instance()
cs.store(name="cifar_config", node=Config)

MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def cifar_stem(model):
    # 3x3 stem without max-pool for 32x32 inputs
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_loaders(cfg):
    root = to_absolute_path(cfg.data.root)
    train_tf = transforms.Compose([
        transforms.RandomCrop(32, padding=4),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])
    test_tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train_set = datasets.CIFAR100(root, train=True, transform=train_tf, download=False)
    test_set = datasets.CIFAR100(root, train=False, transform=test_tf, download=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg.data.batch_size, sampler=train_sampler,
                              num_workers=cfg.data.num_workers, pin_memory=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler,
                             num_workers=cfg.data.num_workers, pin_memory=True)
    return train_loader, test_loader, train_sampler


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    stats = torch.zeros(3, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        out = model(x)
        stats[0] += F.cross_entropy(out, y, reduction="sum")
        stats[1] += (out.argmax(1) == y).sum()
        stats[2] += y.numel()
    dist.all_reduce(stats)
    return (stats[0] / stats[2]).item(), (stats[1] / stats[2]).item() * 100


@hydra.main(version_base=None, config_name="cifar_config")
def main(cfg: Config) -> None:
    dist.init_process_group(backend=cfg.dist.backend, init_method=cfg.dist.init_method)
    rank = dist.get_rank()
    torch.cuda.set_device(cfg.dist.local_rank)
    device = torch.device("cuda", cfg.dist.local_rank)
    torch.manual_seed(cfg.seed)

    out_dir = HydraConfig.get().runtime.output_dir
    writer = SummaryWriter(os.path.join(out_dir, "tb")) if rank == 0 else None
    if rank == 0:
        log.info("\n%s", OmegaConf.to_yaml(cfg))

    train_loader, test_loader, train_sampler = build_loaders(cfg)

    model = cifar_stem(instantiate(cfg.model)).to(device)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[cfg.dist.local_rank], output_device=cfg.dist.local_rank)

    optimizer = instantiate(cfg.optim, params=model.parameters())
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=list(cfg.train.milestones),
                                                     gamma=cfg.train.gamma)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)

    start_epoch, best_acc = 0, 0.0
    if cfg.resume:
        ckpt = torch.load(to_absolute_path(cfg.resume), map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, best_acc = ckpt["epoch"] + 1, ckpt["best_acc"]

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = criterion(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if rank == 0 and step % cfg.train.log_every == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], step)
            step += 1
        scheduler.step()

        test_loss, test_acc = evaluate(model, test_loader, device)
        if rank == 0:
            log.info("epoch %3d  test_loss %.4f  test_acc %.2f", epoch, test_loss, test_acc)
            writer.add_scalar("test/loss", test_loss, epoch)
            writer.add_scalar("test/acc", test_acc, epoch)
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,
                "best_acc": max(best_acc, test_acc),
            }
            torch.save(state, os.path.join(out_dir, "last.pt"))
            if test_acc > best_acc:
                torch.save(state, os.path.join(out_dir, "best.pt"))
        best_acc = max(best_acc, test_acc)

    if rank == 0:
        writer.close()
        log.info("best test acc %.2f", best_acc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
