"""SimCLR pre-training on STL-10 (unlabeled split).

Usage:
    torchrun --nproc_per_node=4 01_simclr_pretrain.py model=resnet50 data.batch_size=256
"""
import logging
import math
import os
import time

import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("mul", lambda a, b: a * b, replace=True)


class TwoCropTransform:
    def __init__(self, base):
        self.base = base

    def __call__(self, x):
        return self.base(x), self.base(x)


def simclr_augment(size):
    color = transforms.ColorJitter(0.8, 0.8, 0.8, 0.2)
    return transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.2, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.RandomApply([color], p=0.8),
        transforms.RandomGrayscale(p=0.2),
        transforms.GaussianBlur(kernel_size=9),
        transforms.ToTensor(),
        transforms.Normalize((0.4467, 0.4398, 0.4066), (0.2603, 0.2566, 0.2713)),
    ])


class ProjectionHead(nn.Module):
    def __init__(self, in_dim, hidden_dim=2048, out_dim=128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(inplace=True),
            nn.Linear(hidden_dim, out_dim),
        )

    def forward(self, x):
        return self.net(x)


class SimCLR(nn.Module):
    def __init__(self, backbone, feat_dim, proj_dim=128):
        super().__init__()
        self.backbone = backbone
        self.backbone.fc = nn.Identity()
        self.head = ProjectionHead(feat_dim, out_dim=proj_dim)

    def forward(self, x):
        return self.head(self.backbone(x))


class GatherLayer(torch.autograd.Function):
    """all_gather that keeps the gradient for the local slice."""

    @staticmethod
    def forward(ctx, x):
        out = [torch.zeros_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        all_grads = torch.stack(grads)
        dist.all_reduce(all_grads)
        return all_grads[dist.get_rank()]


def nt_xent(z1, z2, temperature):
    z1 = F.normalize(z1, dim=1)
    z2 = F.normalize(z2, dim=1)
    z1_all = torch.cat(GatherLayer.apply(z1), dim=0)
    z2_all = torch.cat(GatherLayer.apply(z2), dim=0)
    z = torch.cat([z1_all, z2_all], dim=0)
    n = z1_all.shape[0]
    sim = z @ z.t() / temperature
    sim.fill_diagonal_(float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(sim, targets)


def cosine_lr(step, total, warmup, base_lr):
    if step < warmup:
        return base_lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def setup_distributed():
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return dist.get_rank(), dist.get_world_size(), local_rank


@hydra.main(version_base="1.3", config_path="configs", config_name="simclr")
def main(cfg: DictConfig) -> None:
    rank, world_size, local_rank = setup_distributed()
    device = torch.device("cuda", local_rank)
    out_dir = HydraConfig.get().runtime.output_dir
    torch.manual_seed(cfg.seed + rank)

    run = wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        name=cfg.exp_name,
        config=OmegaConf.to_container(cfg, resolve=True),
        dir=out_dir,
    )

    train_set = datasets.STL10(
        to_absolute_path(cfg.data.root),
        split="unlabeled",
        transform=TwoCropTransform(simclr_augment(cfg.data.image_size)),
        download=False,
    )
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(
        train_set,
        batch_size=cfg.data.batch_size,
        sampler=sampler,
        num_workers=cfg.data.num_workers,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
    )

    backbone = instantiate(cfg.model.backbone)
    model = SimCLR(backbone, feat_dim=cfg.model.feat_dim, proj_dim=cfg.model.proj_dim)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = instantiate(cfg.optimizer, params=model.parameters())
    scaler = torch.cuda.amp.GradScaler(enabled=cfg.amp)

    steps_per_epoch = len(loader)
    total_steps = cfg.epochs * steps_per_epoch
    warmup_steps = cfg.warmup_epochs * steps_per_epoch
    start_epoch = 0

    ckpt_path = os.path.join(out_dir, "last.pt")
    if cfg.resume and os.path.isfile(to_absolute_path(cfg.resume)):
        state = torch.load(to_absolute_path(cfg.resume), map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        start_epoch = state["epoch"] + 1
        log.info("resumed from %s at epoch %d", cfg.resume, start_epoch)

    global_step = start_epoch * steps_per_epoch
    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for (x1, x2), _ in loader:
            x1 = x1.to(device, non_blocking=True)
            x2 = x2.to(device, non_blocking=True)

            lr = cosine_lr(global_step, total_steps, warmup_steps, cfg.optimizer.lr)
            for g in optimizer.param_groups:
                g["lr"] = lr

            with torch.autocast("cuda", dtype=torch.float16, enabled=cfg.amp):
                loss = nt_xent(model(x1), model(x2), cfg.temperature)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

            if global_step % cfg.log_every == 0:
                wandb.log({"train/loss": loss.item(), "train/lr": lr, "epoch": epoch}, step=global_step)
                if rank == 0:
                    log.info("ep %d step %d loss %.4f lr %.2e", epoch, global_step, loss.item(), lr)
            global_step += 1

        if rank == 0:
            log.info("epoch %d took %.1fs", epoch, time.time() - t0)
            torch.save(
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                    "epoch": epoch,
                    "cfg": OmegaConf.to_container(cfg, resolve=True),
                },
                ckpt_path,
            )
            if (epoch + 1) % cfg.save_every == 0:
                torch.save(model.module.backbone.state_dict(),
                           os.path.join(out_dir, f"backbone_ep{epoch + 1:04d}.pt"))
        dist.barrier()

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
