"""
Latent diffusion on a folder of images: encode once with the SD VAE, then train a
class-conditional UNet2DModel on the cached latents.

torchrun --nproc_per_node=8 03_ldm_lsun_church.py --train_dir /data/lsun_church --cache_dir /data/cache
"""
import argparse
import logging
import os
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_cosine_schedule_with_warmup
from diffusers.training_utils import EMAModel
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset
from torchvision import transforms
from tqdm import tqdm

logger = logging.getLogger("ldm")

IMG_EXTS = (".jpg", ".jpeg", ".png", ".webp")


class ImageDir(Dataset):
    def __init__(self, root, resolution):
        self.files = sorted(
            os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.lower().endswith(IMG_EXTS)
        )
        classes = sorted({os.path.basename(os.path.dirname(f)) for f in self.files})
        self.class_to_idx = {c: i for i, c in enumerate(classes)}
        self.tf = transforms.Compose([
            transforms.Resize(resolution, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(resolution),
            transforms.ToTensor(),
            transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        path = self.files[i]
        img = Image.open(path).convert("RGB")
        return self.tf(img), self.class_to_idx[os.path.basename(os.path.dirname(path))]


@torch.no_grad()
def prepare_latents(args, vae, device):
    """Encode the whole image folder to VAE latents once and keep them on disk."""
    os.makedirs(args.cache_dir, exist_ok=True)
    lat_path = os.path.join(args.cache_dir, f"latents_{args.resolution}.npy")
    lab_path = os.path.join(args.cache_dir, f"labels_{args.resolution}.npy")
    if os.path.exists(lat_path) and os.path.exists(lab_path):
        logger.info(f"loading cached latents from {lat_path}")
        return np.load(lat_path), np.load(lab_path)

    ds = ImageDir(args.train_dir, args.resolution)
    dl = DataLoader(ds, batch_size=64, shuffle=False, num_workers=args.num_workers)
    lats, labs = [], []
    for x, y in tqdm(dl, desc="encoding", disable=dist.get_rank() != 0):
        z = vae.encode(x.to(device, dtype=vae.dtype)).latent_dist.mean * vae.config.scaling_factor
        lats.append(z.float().cpu().numpy())
        labs.append(y.numpy())
    lats, labs = np.concatenate(lats), np.concatenate(labs)
    np.save(lat_path, lats)
    np.save(lab_path, labs)
    return lats, labs


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_dir", required=True)
    ap.add_argument("--cache_dir", required=True)
    ap.add_argument("--output_dir", default="ldm-out")
    ap.add_argument("--vae", default="stabilityai/sd-vae-ft-mse")
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--num_classes", type=int, default=10)
    ap.add_argument("--train_batch_size", type=int, default=32, help="per GPU")
    ap.add_argument("--learning_rate", type=float, default=1e-4)
    ap.add_argument("--lr_warmup_steps", type=int, default=1000)
    ap.add_argument("--max_train_steps", type=int, default=200_000)
    ap.add_argument("--ema_decay", type=float, default=0.9999)
    ap.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="bf16")
    ap.add_argument("--checkpointing_steps", type=int, default=10_000)
    ap.add_argument("--num_workers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(args.seed + rank)

    vae = AutoencoderKL.from_pretrained(args.vae, torch_dtype=torch.float16).to(device).eval()
    latents, labels = prepare_latents(args, vae, device)
    del vae
    torch.cuda.empty_cache()

    train_ds = TensorDataset(torch.from_numpy(latents), torch.from_numpy(labels).long())
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.train_batch_size, sampler=sampler, drop_last=True,
                        num_workers=2, pin_memory=True)

    lat_size = args.resolution // 8
    unet = UNet2DModel(
        sample_size=lat_size, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(256, 512, 768, 768),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        num_class_embeds=args.num_classes,
    ).to(device)
    ema = EMAModel(unet.parameters(), decay=args.ema_decay, model_cls=UNet2DModel, model_config=unet.config)
    ema.to(device)
    model = DDP(unet, device_ids=[local_rank])

    noise_scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")
    # lr follows the global batch (per-GPU batch x GPUs), reference is 256
    lr = args.learning_rate * args.train_batch_size * world / 256
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    lr_sched = get_cosine_schedule_with_warmup(optimizer, args.lr_warmup_steps, args.max_train_steps)
    amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.mixed_precision)
    scaler = torch.cuda.amp.GradScaler(enabled=args.mixed_precision == "fp16")

    step, epoch = 0, 0
    progress = tqdm(total=args.max_train_steps, disable=rank != 0)
    while step < args.max_train_steps:
        sampler.set_epoch(epoch)
        for z0, y in loader:
            z0, y = z0.to(device, non_blocking=True), y.to(device, non_blocking=True)
            noise = torch.randn_like(z0)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (z0.shape[0],), device=device)
            zt = noise_scheduler.add_noise(z0, noise, t)
            with torch.autocast("cuda", dtype=amp_dtype, enabled=amp_dtype is not None):
                pred = model(zt, t, class_labels=y).sample
            loss = F.mse_loss(pred.float(), noise)

            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            lr_sched.step()
            ema.step(unet.parameters())
            step += 1
            progress.update(1)

            if step % 50 == 0:
                avg = loss.detach()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                progress.set_postfix(loss=f"{avg.item():.4f}", lr=f"{lr_sched.get_last_lr()[0]:.2e}")

            if step % args.checkpointing_steps == 0 or step == args.max_train_steps:
                if rank == 0:
                    save_dir = os.path.join(args.output_dir, f"checkpoint-{step}")
                    unet.save_pretrained(os.path.join(save_dir, "unet"))
                    ema.save_pretrained(os.path.join(save_dir, "unet_ema"))
                    torch.save({"optimizer": optimizer.state_dict(), "lr_sched": lr_sched.state_dict(),
                                "scaler": scaler.state_dict(), "step": step},
                               os.path.join(save_dir, "train_state.pt"))
                    logger.info(f"saved {save_dir}")
                dist.barrier()
            if step >= args.max_train_steps:
                break
        epoch += 1

    progress.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
