"""Full fine-tune of the SD-2.1-base UNet on an in-house captioned image set.

VAE + text encoder frozen in bf16, UNet trained in fp32 master weights with bf16 autocast,
channels_last, torch.compile on the UNet, EMA, 8-way DDP.

    torchrun --nproc_per_node=8 20_sd_unet_finetune.py --data /shared/products_captioned --out /shared/sd21_products
"""
import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import CLIPTextModel, CLIPTokenizer


class CaptionedImages(Dataset):
    def __init__(self, root, tokenizer, size=512):
        with open(os.path.join(root, "metadata.jsonl")) as f:
            self.rows = [json.loads(l) for l in f]
        self.root = root
        self.tok = tokenizer
        self.tf = transforms.Compose([
            transforms.Resize(size, interpolation=transforms.InterpolationMode.BILINEAR),
            transforms.RandomCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.tf(Image.open(os.path.join(self.root, r["file_name"])).convert("RGB"))
        ids = self.tok(r["text"], max_length=self.tok.model_max_length, padding="max_length",
                       truncation=True, return_tensors="pt").input_ids[0]
        return img, ids


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--pretrained", default="stabilityai/stable-diffusion-2-1-base")
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--bs", type=int, default=16, help="per GPU")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--ema", type=float, default=0.9995)
    p.add_argument("--snr-gamma", type=float, default=5.0)
    p.add_argument("--save-every-epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=8)
    return p.parse_args()


@torch.no_grad()
def ema_update(ema, model, decay):
    torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - decay)


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.backends.cuda.matmul.allow_tf32 = True

    tok = CLIPTokenizer.from_pretrained(args.pretrained, subfolder="tokenizer")
    text_enc = CLIPTextModel.from_pretrained(args.pretrained, subfolder="text_encoder",
                                             torch_dtype=torch.bfloat16).to(dev).requires_grad_(False).eval()
    vae = AutoencoderKL.from_pretrained(args.pretrained, subfolder="vae",
                                        torch_dtype=torch.bfloat16).to(dev).requires_grad_(False).eval()
    unet = UNet2DConditionModel.from_pretrained(args.pretrained, subfolder="unet").to(dev)
    unet.to(memory_format=torch.channels_last)
    noise_sched = DDPMScheduler.from_pretrained(args.pretrained, subfolder="scheduler")
    alphas_cumprod = noise_sched.alphas_cumprod.to(dev)
    ema_unet = copy.deepcopy(unet).requires_grad_(False)

    ddp = DDP(unet, device_ids=[local_rank], gradient_as_bucket_view=True, bucket_cap_mb=100)
    unet_fwd = torch.compile(ddp)

    ds = CaptionedImages(args.data, tok)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=args.workers, pin_memory=True,
                    drop_last=True, persistent_workers=True, prefetch_factor=4)

    opt = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=1e-2, fused=True)
    total = args.epochs * len(dl)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(ds)} images, {len(dl)} steps/epoch/GPU, global batch {args.bs * world}", flush=True)

    step = 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for epoch in range(args.epochs):
        unet_fwd.train()
        start.record()
        loss_sum = torch.zeros((), device=dev)
        for i, (img, ids) in enumerate(dl):
            img = img.to(dev, non_blocking=True)
            ids = ids.to(dev, non_blocking=True)
            with torch.no_grad():
                latents = vae.encode(img.to(torch.bfloat16)).latent_dist.sample().float() * vae.config.scaling_factor
                cond = text_enc(ids)[0]
            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (latents.size(0),), device=dev)
            noisy = noise_sched.add_noise(latents, noise, t).contiguous(memory_format=torch.channels_last)
            if noise_sched.config.prediction_type == "v_prediction":
                target = noise_sched.get_velocity(latents, noise, t)
            else:
                target = noise

            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = unet_fwd(noisy, t, cond).sample
            # min-SNR-gamma weighting
            snr = alphas_cumprod[t] / (1 - alphas_cumprod[t])
            w = torch.clamp(snr, max=args.snr_gamma) / (snr + 1 if noise_sched.config.prediction_type == "v_prediction" else snr)
            loss = (F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3)) * w).mean()

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            opt.step()
            sched.step()
            ema_update(ema_unet, unet, args.ema)
            loss_sum += loss.detach()
            step += 1

            if (i + 1) % 50 == 0:
                end.record()
                end.synchronize()
                sec = start.elapsed_time(end) / 1000
                dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {loss_sum.item() / 50:.4f} "
                          f"{50 * args.bs * world / sec:.1f} img/s", flush=True)
                loss_sum.zero_()
                start.record()

        if (epoch + 1) % args.save_every_epochs == 0 or epoch + 1 == args.epochs:
            if rank == 0:
                unet.save_pretrained(os.path.join(args.out, f"epoch_{epoch}", "unet"))
                ema_unet.save_pretrained(os.path.join(args.out, f"epoch_{epoch}", "unet_ema"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
