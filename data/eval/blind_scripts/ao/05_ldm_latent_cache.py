# Latent diffusion on a small class-labelled image folder (e.g. our 40k product shots).
# Images are encoded once with the SD VAE and cached, then a class-conditional UNet is
# trained on the latents with v-prediction and CFG label dropout.
#
#   torchrun --nproc_per_node=8 train_ldm.py --images /mnt/data/products --work_dir work/ldm_products
import argparse
import copy
import glob
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDIMScheduler, UNet2DModel
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.utils import save_image
from tqdm import tqdm


def list_images(root):
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    items = []
    for ci, c in enumerate(classes):
        for f in sorted(glob.glob(os.path.join(root, c, "*"))):
            if f.lower().endswith((".jpg", ".jpeg", ".png", ".webp")):
                items.append((f, ci))
    return items, classes


@torch.no_grad()
def build_latent_cache(image_root, cache_path, vae, device, res=256, bs=32):
    if os.path.exists(cache_path):
        return torch.load(cache_path, map_location="cpu")
    items, classes = list_images(image_root)
    tf = transforms.Compose([
        transforms.Resize(res, interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.CenterCrop(res),
        transforms.ToTensor(),
        transforms.Normalize([0.5] * 3, [0.5] * 3),
    ])
    lat, lab = [], []
    for i in tqdm(range(0, len(items), bs), desc="encoding"):
        chunk = items[i:i + bs]
        x = torch.stack([tf(Image.open(p).convert("RGB")) for p, _ in chunk]).to(device)
        # keep both the image and its mirror so we can flip in latent space for free
        x = torch.cat([x, x.flip(-1)])
        z = vae.encode(x).latent_dist.mean * vae.config.scaling_factor
        z, zf = z.chunk(2)
        lat.append(torch.stack([z, zf], 1).half().cpu())
        lab.append(torch.tensor([c for _, c in chunk]))
    cache = {"latents": torch.cat(lat), "labels": torch.cat(lab), "classes": classes}
    os.makedirs(os.path.dirname(cache_path), exist_ok=True)
    torch.save(cache, cache_path)
    return cache


def build_unet(num_classes, sample_size=32):
    return UNet2DModel(
        sample_size=sample_size,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(192, 384, 576, 768),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        num_class_embeds=num_classes + 1,
        attention_head_dim=64,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", required=True)
    ap.add_argument("--work_dir", default="work/ldm")
    ap.add_argument("--vae", default="stabilityai/sd-vae-ft-mse")
    ap.add_argument("--res", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max_steps", type=int, default=300_000)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--ema_decay", type=float, default=0.9999)
    ap.add_argument("--save_every", type=int, default=10_000)
    ap.add_argument("--sample_every", type=int, default=2_500)
    ap.add_argument("--guidance", type=float, default=3.0)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)

    vae = AutoencoderKL.from_pretrained(args.vae).to(device).eval().requires_grad_(False)
    cache = build_latent_cache(args.images, os.path.join(args.work_dir, f"latents_{args.res}.pt"),
                               vae, device, res=args.res)
    latents, labels = cache["latents"], cache["labels"]
    num_classes = len(cache["classes"])
    if rank == 0:
        print(f"{len(latents)} latents, {num_classes} classes, shape {tuple(latents.shape[2:])}", flush=True)

    ds = TensorDataset(latents, labels)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=2,
                        pin_memory=True, drop_last=True)

    unet = build_unet(num_classes, sample_size=args.res // 8).to(device)
    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    opt = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=0.01)
    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", prediction_type="v_prediction",
                          clip_sample=False)
    step = 0
    ckpt_file = os.path.join(args.work_dir, "ckpt", "last.pt")
    if os.path.exists(ckpt_file):
        ck = torch.load(ckpt_file, map_location="cpu")
        unet.load_state_dict(ck["unet"]); ema.load_state_dict(ck["ema"]); opt.load_state_dict(ck["opt"])
        step = ck["step"]
    unet = DDP(unet, device_ids=[local_rank])
    alphas = sched.alphas_cumprod.to(device)

    epoch = step // len(loader)
    t_last = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for z, y in loader:
            z = z.to(device, non_blocking=True).float()
            flip = torch.randint(0, 2, (z.size(0),))
            z = z[torch.arange(z.size(0)), flip]
            y = y.to(device)
            y = torch.where(torch.rand(y.shape, device=device) < args.p_uncond, torch.full_like(y, num_classes), y)

            noise = torch.randn_like(z)
            t = torch.randint(0, 1000, (z.size(0),), device=device)
            a = alphas[t].view(-1, 1, 1, 1)
            zt = a.sqrt() * z + (1 - a).sqrt() * noise
            v = a.sqrt() * noise - (1 - a).sqrt() * z
            pred = unet(zt, t, class_labels=y).sample
            loss = F.mse_loss(pred.float(), v)

            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), unet.module.parameters()):
                    pe.lerp_(p, 1 - args.ema_decay)
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} {(time.time() - t_last) / 100:.3f}s/it", flush=True)
                    t_last = time.time()

            if rank == 0 and step % args.sample_every == 0:
                sampler_sched = DDIMScheduler.from_config(sched.config)
                sampler_sched.set_timesteps(50)
                n = min(num_classes, 8) * 4
                cls = torch.arange(n, device=device) % num_classes
                x = torch.randn(n, 4, args.res // 8, args.res // 8, device=device)
                with torch.no_grad():
                    for tt in sampler_sched.timesteps:
                        inp = torch.cat([x, x])
                        yy = torch.cat([cls, torch.full_like(cls, num_classes)])
                        out_c, out_u = ema(inp, tt.to(device), class_labels=yy).sample.chunk(2)
                        out = out_u + args.guidance * (out_c - out_u)
                        x = sampler_sched.step(out, tt, x).prev_sample
                    img = vae.decode(x / vae.config.scaling_factor).sample
                save_image(img * 0.5 + 0.5, os.path.join(args.work_dir, f"samples_{step:07d}.png"), nrow=8)

            if step % args.save_every == 0:
                if rank == 0:
                    os.makedirs(os.path.dirname(ckpt_file), exist_ok=True)
                    torch.save({"unet": unet.module.state_dict(), "ema": ema.state_dict(),
                                "opt": opt.state_dict(), "step": step}, ckpt_file)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
