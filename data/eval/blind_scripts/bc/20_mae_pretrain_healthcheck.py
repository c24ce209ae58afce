"""MAE (ViT-L/16) self-supervised pretraining on the unlabeled inspection-camera images.

Before loading any data every job runs a short NCCL all-reduce check and each node exports
Prometheus metrics (step time, GPU memory, loss) so bad nodes get drained quickly.

    torchrun --nnodes=4 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d \
        --rdzv-endpoint=$HEAD:29500 --rdzv-id=$SLURM_JOB_ID pretrain_mae.py run=mae_vitl_800ep
"""
import logging
import math
import os
import socket
import sys
import time

import hydra
import timm.optim
import torch
import torch.distributed as dist
import torchvision.transforms as T
import wandb
from omegaconf import DictConfig, OmegaConf
from prometheus_client import Gauge, start_http_server
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.datasets import ImageFolder

from mae import models_mae

log = logging.getLogger("mae")

STEP_TIME = Gauge("mae_step_seconds", "seconds per optimizer step", ["rank"])
GPU_MEM = Gauge("mae_gpu_mem_gb", "max allocated GPU memory", ["rank"])
LOSS = Gauge("mae_loss", "reconstruction loss", ["rank"])


def init_distributed():
    dist.init_process_group(backend="nccl")
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def startup_health_check(world, size_mb=256):
    """One large all-reduce: catches dead NICs / broken GPUs before hours of data loading."""
    n = size_mb * 1024 * 1024 // 4
    buf = torch.ones(n, device="cuda")
    dist.all_reduce(buf)  # warm up the communicator
    torch.cuda.synchronize()
    t0 = time.time()
    dist.all_reduce(buf)
    torch.cuda.synchronize()
    dt = time.time() - t0
    ok = bool(buf[0].item() == world * world)
    # the slowest rank decides, so every rank takes the same exit path
    bw = torch.tensor([2 * (world - 1) / world * n * 4 / dt / 1e9], device="cuda")
    dist.all_reduce(bw, op=dist.ReduceOp.MIN)
    return ok, bw.item()


def cosine_lr(cfg, it, iters_per_epoch, base_lr):
    e = it / iters_per_epoch
    if e < cfg.optim.warmup_epochs:
        return base_lr * e / cfg.optim.warmup_epochs
    return cfg.optim.min_lr + (base_lr - cfg.optim.min_lr) * 0.5 * (
        1 + math.cos(math.pi * (e - cfg.optim.warmup_epochs) / (cfg.optim.epochs - cfg.optim.warmup_epochs)))


@hydra.main(config_path="conf", config_name="pretrain", version_base="1.3")
def main(cfg: DictConfig):
    rank, world, local_rank = init_distributed()
    ok, busbw = startup_health_check(world)
    host = socket.gethostname()
    if not ok or busbw < cfg.health.min_busbw_gbps:
        if rank == 0:
            print(f"health check failed ok={ok} min busbw={busbw:.1f} GB/s", flush=True)
        dist.destroy_process_group()
        sys.exit(3)

    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    if local_rank == 0:
        start_http_server(cfg.metrics.port)
        log.info("metrics on %s:%d, busbw %.1f GB/s", host, cfg.metrics.port, busbw)
    torch.manual_seed(cfg.seed + rank)

    tf = T.Compose([T.RandomResizedCrop(224, scale=(0.2, 1.0), interpolation=T.InterpolationMode.BICUBIC),
                    T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = ImageFolder(cfg.data.root, tf)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.optim.batch_size, sampler=sampler, num_workers=cfg.data.workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    net = models_mae.__dict__[cfg.model.arch](norm_pix_loss=True).to(device)
    model = DDP(net, device_ids=[local_rank])
    eff_batch = cfg.optim.batch_size * cfg.optim.accum * world
    base_lr = cfg.optim.blr * eff_batch / 256
    param_groups = timm.optim.param_groups_weight_decay(net, cfg.optim.weight_decay)
    optimizer = torch.optim.AdamW(param_groups, lr=base_lr, betas=(0.9, 0.95))
    scaler = torch.cuda.amp.GradScaler()

    ckpt_path = os.path.join(cfg.run.dir, "checkpoint-last.pth")
    start_epoch = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scaler.load_state_dict(ck["scaler"])
        start_epoch = ck["epoch"] + 1

    if rank == 0:
        os.makedirs(cfg.run.dir, exist_ok=True)
        wandb.init(project=cfg.wandb.project, name=cfg.run.name, id=cfg.run.name, resume="allow",
                   config=OmegaConf.to_container(cfg, resolve=True))

    iters = len(loader)
    for epoch in range(start_epoch, cfg.optim.epochs):
        sampler.set_epoch(epoch)
        t_step = time.time()
        for i, (imgs, _) in enumerate(loader):
            it = epoch * iters + i
            if i % cfg.optim.accum == 0:
                for g in optimizer.param_groups:
                    g["lr"] = cosine_lr(cfg, it, iters, base_lr)
            imgs = imgs.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss, _, _ = model(imgs, mask_ratio=cfg.model.mask_ratio)
            scaler.scale(loss / cfg.optim.accum).backward()
            if (i + 1) % cfg.optim.accum == 0:
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)

                dt = time.time() - t_step
                t_step = time.time()
                if local_rank == 0:  # the exporter lives in this process
                    STEP_TIME.labels(rank=str(rank)).set(dt)
                    GPU_MEM.labels(rank=str(rank)).set(torch.cuda.max_memory_allocated() / 2**30)
                    LOSS.labels(rank=str(rank)).set(loss.item())

            if i % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": l.item(), "lr": optimizer.param_groups[0]["lr"],
                               "epoch": epoch + i / iters}, step=it)

        if rank == 0:
            state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                     "scaler": scaler.state_dict(), "epoch": epoch, "config": OmegaConf.to_container(cfg)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if (epoch + 1) % cfg.run.keep_every == 0:
                torch.save(net.state_dict(), os.path.join(cfg.run.dir, f"mae-epoch{epoch + 1}.pth"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
