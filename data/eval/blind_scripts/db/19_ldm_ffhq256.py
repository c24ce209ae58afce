"""
Unconditional latent diffusion on FFHQ-256 (LDM-4 style: f=8 KL-VAE, UNet2DModel in latent space).
Periodic checkpoints, resume, and an EMA export that can be loaded into a DDIMPipeline-like sampler.

    torchrun --nproc_per_node=8 19_ldm_ffhq256.py --data /data/ffhq256 --workdir /shared/ldm_ffhq
    torchrun --nproc_per_node=8 19_ldm_ffhq256.py --data /data/ffhq256 --workdir /shared/ldm_ffhq --resume
"""
import argparse
import glob
import os
import time
from copy import deepcopy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DModel
from diffusers.optimization import get_cosine_schedule_with_warmup
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import transforms


class FFHQ(Dataset):
    def __init__(self, root, res):
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.png"), recursive=True))
        self.tf = transforms.Compose([transforms.Resize(res), transforms.RandomHorizontalFlip(),
                                      transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB"))


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--vae", default="stabilityai/sd-vae-ft-mse")
    p.add_argument("--res", type=int, default=256)
    p.add_argument("--batch_per_gpu", type=int, default=48)
    p.add_argument("--base_lr", type=float, default=2e-6, help="per-sample lr, scaled by the global batch")
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--max_steps", type=int, default=300_000)
    p.add_argument("--ema_decay", type=float, default=0.9999)
    p.add_argument("--ckpt_every", type=int, default=10_000)
    p.add_argument("--log_every", type=int, default=100)
    p.add_argument("--seed", type=int, default=23)
    return p.parse_args()


def latest_checkpoint(workdir):
    ckpts = sorted(glob.glob(os.path.join(workdir, "ckpt_*.pt")))
    return ckpts[-1] if ckpts else None


def main():
    args = parse()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    vae = AutoencoderKL.from_pretrained(args.vae).to(device).eval().requires_grad_(False)
    scale = vae.config.scaling_factor
    net = UNet2DModel(
        sample_size=args.res // 8, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(224, 448, 672, 896),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=32,
    ).to(device)
    ema = deepcopy(net).eval().requires_grad_(False)

    lr = args.base_lr * args.batch_per_gpu * world
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.max_steps)
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                beta_start=0.0015, beta_end=0.0195)

    step = 0
    if args.resume and (path := latest_checkpoint(args.workdir)):
        ckpt = torch.load(path, map_location="cpu")
        net.load_state_dict(ckpt["model"])
        ema.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resuming from {path} (step {step})", flush=True)

    model = DDP(net, device_ids=[local_rank])
    ds = FFHQ(args.data, args.res)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                    drop_last=True, persistent_workers=True)
    if rank == 0:
        os.makedirs(args.workdir, exist_ok=True)
        print(f"{len(ds)} images, global batch {args.batch_per_gpu * world}, lr {lr:.2e}", flush=True)

    epoch = step // len(dl)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x in dl:
            x = x.to(device, non_blocking=True)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                z = vae.encode(x).latent_dist.sample().float() * scale
            noise = torch.randn_like(z)
            t = torch.randint(0, 1000, (z.shape[0],), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(noise_sched.add_noise(z, noise, t), t).sample
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                torch._foreach_mul_(list(ema.parameters()), args.ema_decay)
                torch._foreach_add_(list(ema.parameters()), list(net.parameters()), alpha=1 - args.ema_decay)
            step += 1

            if step % args.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{args.log_every / (time.time() - t0):.2f} it/s", flush=True)
                t0 = time.time()

            if step % args.ckpt_every == 0 or step == args.max_steps:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               os.path.join(args.workdir, f"ckpt_{step:07d}.pt"))
                    ema.save_pretrained(os.path.join(args.workdir, "unet_ema"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
