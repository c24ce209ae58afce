#!/usr/bin/env python
"""Fine-tune SD 1.5 with offset noise + input perturbation (fp16 autocast, GradScaler, EMA).

torchrun --nproc_per_node 8 18_fp16_offset_noise_finetune.py --data_csv /data/photos/train.csv --out runs/offset
"""
import argparse
import copy
import logging
import os

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from transformers import CLIPTextModel, CLIPTokenizer

logger = logging.getLogger("offset_ft")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--data_csv", required=True)
    p.add_argument("--out", default="runs/offset")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--noise_offset", type=float, default=0.05)
    p.add_argument("--input_perturbation", type=float, default=0.1)
    p.add_argument("--uncond_prob", type=float, default=0.1)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--ckpt_every", type=int, default=3000)
    p.add_argument("--seed", type=int, default=3)
    return p.parse_args()


class CsvImageText(Dataset):
    def __init__(self, csv_path, tokenizer, uncond_prob, size=512):
        df = pd.read_csv(csv_path)
        self.paths = df["path"].tolist()
        self.captions = df["caption"].fillna("").tolist()
        self.tokenizer = tokenizer
        self.uncond_prob = uncond_prob
        self.tf = transforms.Compose([
            transforms.Resize(size, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.RandomCrop(size), transforms.ToTensor(), transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        caption = "" if torch.rand(()).item() < self.uncond_prob else self.captions[i]
        ids = self.tokenizer(caption, padding="max_length", truncation=True, max_length=77,
                             return_tensors="pt").input_ids[0]
        return self.tf(Image.open(self.paths[i]).convert("RGB")), ids


@torch.no_grad()
def ema_update(ema, model, decay):
    ema_p = list(ema.parameters())
    model_p = list(model.parameters())
    torch._foreach_mul_(ema_p, decay)
    torch._foreach_add_(ema_p, model_p, alpha=1 - decay)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed * 100 + rank)
    writer = SummaryWriter(os.path.join(args.out, "logs")) if rank == 0 else None

    tokenizer = CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.model, subfolder="text_encoder", torch_dtype=torch.float16)
    vae = AutoencoderKL.from_pretrained(args.model, subfolder="vae", torch_dtype=torch.float16)
    unet = UNet2DConditionModel.from_pretrained(args.model, subfolder="unet")
    scheduler = DDPMScheduler.from_pretrained(args.model, subfolder="scheduler")
    text_encoder.to(device).requires_grad_(False)
    vae.to(device).requires_grad_(False)
    unet.to(device)
    ema = copy.deepcopy(unet).requires_grad_(False)
    model = DDP(unet, device_ids=[local_rank])

    dataset = CsvImageText(args.data_csv, tokenizer, args.uncond_prob)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2, eps=1e-8)
    lr_scheduler = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=250)
    scaler = torch.cuda.amp.GradScaler(init_scale=2 ** 14)

    global_step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for pixels, ids in loader:
            pixels, ids = pixels.to(device, torch.float16, non_blocking=True), ids.to(device, non_blocking=True)
            with torch.no_grad():
                latents = vae.encode(pixels).latent_dist.sample().float() * vae.config.scaling_factor
                text_emb = text_encoder(ids)[0]

            noise = torch.randn_like(latents)
            if args.noise_offset > 0:
                noise += args.noise_offset * torch.randn(latents.shape[0], latents.shape[1], 1, 1, device=device)
            timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
            model_input_noise = noise
            if args.input_perturbation > 0:
                model_input_noise = noise + args.input_perturbation * torch.randn_like(noise)
            noisy = scheduler.add_noise(latents, model_input_noise, timesteps)

            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(noisy, timesteps, text_emb).sample
            loss = F.mse_loss(pred.float(), noise, reduction="mean")

            if not torch.isfinite(loss):
                logger.warning("rank %d: non-finite loss at step %d, skipping batch", rank, global_step)
                optimizer.zero_grad(set_to_none=True)
                continue

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            ema_update(ema, unet, args.ema_decay)
            global_step += 1

            if global_step % 100 == 0:
                vals = torch.stack([loss.detach(), grad_norm.float()])
                dist.all_reduce(vals, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", vals[0].item(), global_step)
                    writer.add_scalar("train/grad_norm", vals[1].item(), global_step)
                    writer.add_scalar("train/loss_scale", scaler.get_scale(), global_step)

            if global_step % args.ckpt_every == 0:
                if rank == 0:
                    d = os.path.join(args.out, f"checkpoint-{global_step}")
                    unet.save_pretrained(os.path.join(d, "unet"))
                    ema.save_pretrained(os.path.join(d, "unet_ema"))
                    torch.save({"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                                "lr_scheduler": lr_scheduler.state_dict(), "step": global_step},
                               os.path.join(d, "state.pt"))
                dist.barrier()

    if rank == 0:
        ema.save_pretrained(os.path.join(args.out, "final_ema"))
        writer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
