"""DDPM training (epsilon prediction) with a diffusers UNet2DModel, fp16 autocast, EMA.

    torchrun --nproc_per_node=4 15_diffusion_unet.py data=ffhq64 unet=ddpm_64 train.max_steps=400000
"""
import copy
import logging
import os

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision.utils import save_image

log = logging.getLogger(__name__)

OmegaConf.register_new_resolver("tuple", lambda *xs: tuple(xs), replace=True)


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)
    for be, bm in zip(ema.buffers(), model.buffers()):
        be.copy_(bm)


@torch.no_grad()
def sample(unet, scheduler, n, size, device, steps):
    scheduler.set_timesteps(steps)
    x = torch.randn(n, 3, size, size, device=device)
    for t in scheduler.timesteps:
        eps = unet(x, t).sample
        x = scheduler.step(eps, t, x).prev_sample
    return (x.clamp(-1, 1) + 1) / 2


def infinite(loader, sampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@hydra.main(version_base="1.3", config_path="configs", config_name="ddpm")
def main(cfg: DictConfig):
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed + rank)
    out_dir = HydraConfig.get().runtime.output_dir
    if rank == 0:
        os.makedirs(os.path.join(out_dir, "samples"), exist_ok=True)

    dataset = instantiate(cfg.data.dataset, root=to_absolute_path(cfg.data.root))
    sampler = DistributedSampler(dataset, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=cfg.train.batch_size, sampler=sampler,
                        num_workers=cfg.data.workers, pin_memory=True, drop_last=True, persistent_workers=True)

    unet = UNet2DModel(**OmegaConf.to_container(cfg.unet, resolve=True))
    # DDP broadcasts rank 0's weights at construction, so the per-rank seed above is fine
    unet = unet.to(device)
    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    model = DDP(unet, device_ids=[local_rank])

    noise_sched = DDPMScheduler(num_train_timesteps=cfg.diffusion.timesteps, beta_schedule=cfg.diffusion.beta_schedule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.optim.warmup))
    scaler = torch.cuda.amp.GradScaler()

    step = 0
    ckpt_path = os.path.join(out_dir, "state.pt")
    if os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(state["model"])
        ema.load_state_dict(state["ema"])
        optimizer.load_state_dict(state["optimizer"])
        lr_sched.load_state_dict(state["lr_sched"])
        scaler.load_state_dict(state["scaler"])
        step = state["step"]

    data_iter = infinite(loader, sampler)
    model.train()
    while step < cfg.train.max_steps:
        x0, _ = next(data_iter)
        x0 = x0.to(device, non_blocking=True)
        noise = torch.randn_like(x0)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (x0.size(0),), device=device)
        xt = noise_sched.add_noise(x0, noise, t)

        with torch.autocast("cuda", dtype=torch.float16):
            pred = model(xt, t).sample
        loss = F.mse_loss(pred.float(), noise)

        if not torch.isfinite(loss):
            log.warning("rank %d: non-finite loss at step %d, skipping batch", rank, step)
            optimizer.zero_grad(set_to_none=True)
            continue

        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip)
        scaler.step(optimizer)
        scaler.update()
        lr_sched.step()
        ema_update(ema, model.module, cfg.train.ema_decay)
        step += 1

        if step % cfg.train.log_every == 0:
            l = loss.detach().clone()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                log.info("step %d loss %.5f lr %.2e scale %.0f", step, l.item(), lr_sched.get_last_lr()[0],
                         scaler.get_scale())

        if step % cfg.train.sample_every == 0 and rank == 0:
            imgs = sample(ema, DDPMScheduler.from_config(noise_sched.config), 64, cfg.unet.sample_size,
                          device, cfg.train.sample_steps)
            save_image(imgs, os.path.join(out_dir, "samples", f"{step:07d}.png"), nrow=8)

        if step % cfg.train.ckpt_every == 0:
            if rank == 0:
                torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                            "optimizer": optimizer.state_dict(), "lr_sched": lr_sched.state_dict(),
                            "scaler": scaler.state_dict(), "step": step}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    if rank == 0:
        torch.save(ema.state_dict(), os.path.join(out_dir, "ema_final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
