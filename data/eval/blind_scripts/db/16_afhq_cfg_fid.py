"""
Sample from the EMA weights of a class-conditional latent diffusion model (AFHQ cat/dog/wild)
with DDIM + classifier-free guidance and compute FID against the AFHQ validation split.
Both the generated and the real Inception features are computed in parallel on all GPUs.

    torchrun --nproc_per_node=8 16_afhq_cfg_fid.py --ckpt runs/afhq_ldm/checkpoint.pt \
        --real_dir /data/afhq/val --num_samples 15000 --guidance 2.0
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, DDIMScheduler, UNet2DModel
from PIL import Image
from scipy import linalg
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms
from torchvision.models import Inception_V3_Weights, inception_v3


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--real_dir", required=True)
    ap.add_argument("--vae", default="stabilityai/sd-vae-ft-ema")
    ap.add_argument("--num_classes", type=int, default=3)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--num_samples", type=int, default=15_000)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--guidance", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save_images", default=None)
    return ap.parse_args()


class InceptionPool(torch.nn.Module):
    def __init__(self):
        super().__init__()
        net = inception_v3(weights=Inception_V3_Weights.IMAGENET1K_V1, aux_logits=True, transform_input=False)
        net.fc = torch.nn.Identity()
        self.net = net.eval()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    @torch.no_grad()
    def forward(self, x):  # x in [0, 1]
        x = torch.nn.functional.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
        return self.net((x - self.mean) / self.std)


def gather_rows(t, world):
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return torch.cat(out)


def fid_from_feats(f1, f2):
    mu1, mu2 = f1.mean(0), f2.mean(0)
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    covmean, _ = linalg.sqrtm(s1 @ s2, disp=False)
    covmean = covmean.real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))


@torch.no_grad()
def generate(unet, vae, sched, labels, guidance, steps, gen):
    n = labels.shape[0]
    z = torch.randn(n, 4, unet.config.sample_size, unet.config.sample_size, device=labels.device, generator=gen)
    null = torch.full_like(labels, unet.config.num_class_embeds - 1)
    sched.set_timesteps(steps, device=labels.device)
    for t in sched.timesteps:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            e = unet(torch.cat([z, z]), t, class_labels=torch.cat([labels, null])).sample.float()
        ec, eu = e.chunk(2)
        z = sched.step(eu + guidance * (ec - eu), t, z).prev_sample
    x = vae.decode(z / vae.config.scaling_factor).sample
    return ((x.clamp(-1, 1) + 1) / 2).float()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    unet = UNet2DModel(
        sample_size=args.resolution // 8, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(192, 384, 576, 768),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        num_class_embeds=args.num_classes + 1,
    )
    state = torch.load(args.ckpt, map_location="cpu")
    unet.load_state_dict(state["ema"])
    unet = unet.to(device).eval()
    vae = AutoencoderKL.from_pretrained(args.vae).to(device).eval()
    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                          beta_start=0.00085, beta_end=0.012, clip_sample=False, set_alpha_to_one=False)
    inception = InceptionPool().to(device)

    # ---- generated images: same number of batches on every rank, extra samples dropped at the end
    per_rank = math.ceil(args.num_samples / (world * args.batch)) * args.batch
    gen = torch.Generator(device=device).manual_seed(args.seed * world + rank)
    fake_feats = []
    for i in range(per_rank // args.batch):
        labels = torch.randint(0, args.num_classes, (args.batch,), device=device, generator=gen)
        imgs = generate(unet, vae, sched, labels, args.guidance, args.steps, gen)
        fake_feats.append(inception(imgs))
        if args.save_images:
            os.makedirs(args.save_images, exist_ok=True)
            arr = (imgs * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
            for j, a in enumerate(arr):
                Image.fromarray(a).save(os.path.join(args.save_images, f"{(i * world + rank) * args.batch + j:06d}.png"))
        if rank == 0 and i % 10 == 0:
            print(f"batch {i + 1}/{per_rank // args.batch}", flush=True)
    fake_feats = gather_rows(torch.cat(fake_feats), world)[: args.num_samples]

    # ---- real images: strided split of the validation folder
    tf = transforms.Compose([transforms.Resize(args.resolution), transforms.CenterCrop(args.resolution),
                             transforms.ToTensor()])
    real = datasets.ImageFolder(args.real_dir, transform=tf)
    shard = Subset(real, list(range(rank, len(real), world)))
    real_feats = []
    for x, _ in DataLoader(shard, batch_size=args.batch, num_workers=4, pin_memory=True):
        real_feats.append(inception(x.to(device, non_blocking=True)))
    real_feats = gather_rows(torch.cat(real_feats), world)

    if rank == 0:
        fid = fid_from_feats(fake_feats.double().cpu().numpy(), real_feats.double().cpu().numpy())
        print(f"FID({len(fake_feats)} generated vs {len(real_feats)} real) = {fid:.3f}  "
              f"[guidance {args.guidance}, {args.steps} DDIM steps]")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
