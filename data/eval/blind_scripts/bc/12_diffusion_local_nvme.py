"""Latent diffusion UNet training on the 256px product renders.

sbatch scripts/ldm.sbatch (2 nodes x 8 GPUs, --requeue), which runs on every node:
    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 \
        --rdzv-id=$SLURM_JOB_ID train_ldm.py --config conf/ldm_256.yaml
"""
import argparse
import copy
import os
import shutil
import tarfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from ldm_data import RenderCaptionDataset, load_text_encoder


def get_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("opts", nargs="*")
    a = ap.parse_args()
    return OmegaConf.merge(OmegaConf.load(a.config), OmegaConf.from_cli(a.opts))


def node_local_root():
    # fast NVMe on each compute node, per job
    job = os.environ.get("SLURM_JOB_ID", "interactive")
    return os.path.join("/local_nvme", os.environ.get("USER", "ml"), job)


def stage_dataset(cfg, local_rank):
    """Copy the packed tarball from Lustre to local NVMe once per node."""
    dst = os.path.join(node_local_root(), "data")
    done = os.path.join(dst, ".staged")
    if local_rank == 0 and not os.path.exists(done):
        os.makedirs(dst, exist_ok=True)
        t0 = time.time()
        with tarfile.open(cfg.data.tarball) as tf:
            tf.extractall(dst)
        open(done, "w").close()
        print(f"[{os.uname().nodename}] staged dataset in {time.time() - t0:.0f}s", flush=True)
    dist.barrier()
    return dst


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.lerp_(pm.detach(), 1 - decay)


def main():
    cfg = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    data_dir = stage_dataset(cfg, local_rank)
    ckpt_dir = os.path.join(node_local_root(), "checkpoints")
    ds = RenderCaptionDataset(data_dir, size=cfg.data.resolution)
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.train.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    vae = AutoencoderKL.from_pretrained(cfg.model.vae).to(device).eval().requires_grad_(False)
    text_encoder = load_text_encoder(cfg.model.text_encoder, device)
    unet = UNet2DConditionModel(**cfg.model.unet).to(device)
    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")
    model = DDP(unet, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(unet.parameters(), lr=cfg.train.lr, weight_decay=1e-2)
    scaler = torch.cuda.amp.GradScaler()
    torch.manual_seed(cfg.seed + rank)  # different noise / timesteps / caption drop per rank

    step, start_epoch = 0, 0
    last = os.path.join(ckpt_dir, "last.pt")
    if os.path.exists(last):
        s = torch.load(last, map_location="cpu")
        unet.load_state_dict(s["unet"])
        ema.load_state_dict(s["ema"])
        optimizer.load_state_dict(s["optimizer"])
        scaler.load_state_dict(s["scaler"])
        step, start_epoch = s["step"], s["epoch"]
        print(f"rank {rank}: resumed from step {step}", flush=True)

    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        wandb.init(project=cfg.wandb.project, name=cfg.name, id=f"{cfg.name}-{os.environ.get('SLURM_JOB_ID')}",
                   resume="allow", config=OmegaConf.to_container(cfg))

    for epoch in range(start_epoch, cfg.train.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for images, captions in loader:
            images = images.to(device, non_blocking=True)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                latents = vae.encode(images).latent_dist.sample() * vae.config.scaling_factor
                cond = text_encoder(captions)
                if cfg.train.uncond_prob > 0:
                    drop = torch.rand(cond.size(0), device=device) < cfg.train.uncond_prob
                    cond = torch.where(drop[:, None, None], torch.zeros_like(cond), cond)
            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (latents.size(0),), device=device)
            noisy = noise_sched.add_noise(latents, noise, t)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(noisy, t, encoder_hidden_states=cond).sample
            loss = F.mse_loss(pred.float(), noise.float())
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            ema_update(ema, unet, cfg.train.ema_decay)
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": l.item(), "scale": scaler.get_scale(),
                               "img_s": 100 * cfg.train.batch_size * world / (time.time() - t0)}, step=step)
                    t0 = time.time()

            if step % cfg.train.ckpt_every == 0 and rank == 0:
                tmp = last + ".tmp"
                torch.save({"unet": unet.state_dict(), "ema": ema.state_dict(),
                            "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                            "step": step, "epoch": epoch}, tmp)
                os.replace(tmp, last)

        if rank == 0:
            torch.save(ema.state_dict(), os.path.join(ckpt_dir, f"ema_epoch{epoch:03d}.pt"))
            shutil.copy(os.path.join(ckpt_dir, f"ema_epoch{epoch:03d}.pt"),
                        os.path.join(cfg.export_dir, f"{cfg.name}_ema_latest.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
