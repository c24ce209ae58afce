"""
Unconditional pixel-space diffusion (DDPM, diffusers UNet2DModel) at 128x128 on WebDataset shards.

    torchrun --nproc_per_node=8 17_wds_diffusion_unet.py \
        --shards "/datasets/ffhq_wds/train-{00000..00139}.tar" --out /shared/diffusion/ffhq128 \
        --resume
"""
import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision.transforms as T
import webdataset as wds
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.training_utils import EMAModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter
from torchvision.utils import save_image


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resolution", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=32, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max_steps", type=int, default=500_000)
    ap.add_argument("--ema_decay", type=float, default=0.9999)
    ap.add_argument("--save_every", type=int, default=10_000)
    ap.add_argument("--sample_every", type=int, default=5_000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def make_loader(args):
    tf = T.Compose([
        T.Resize(args.resolution, interpolation=T.InterpolationMode.BILINEAR),
        T.RandomCrop(args.resolution),
        T.RandomHorizontalFlip(),
        T.ToTensor(),
        T.Normalize([0.5], [0.5]),
    ])
    ds = (wds.WebDataset(args.shards, resampled=True, handler=wds.warn_and_continue)
          .shuffle(2000)
          .decode("pilrgb", handler=wds.warn_and_continue)
          .to_tuple("png;jpg;jpeg")
          .map_tuple(tf)
          .batched(args.batch_size, partial=False))
    return wds.WebLoader(ds, batch_size=None, num_workers=args.workers, pin_memory=True,
                         persistent_workers=True)


def build_unet(res):
    return UNet2DModel(
        sample_size=res, in_channels=3, out_channels=3, layers_per_block=2,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D",
                          "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D", "UpBlock2D"),
    )


@torch.no_grad()
def sample_grid(unet, scheduler, n, res, device, steps=250):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, 3, res, res, generator=gen, device=device)
    sch = copy.deepcopy(scheduler)
    sch.set_timesteps(steps)
    for t in sch.timesteps:
        eps = unet(x, t).sample
        x = sch.step(eps, t, x, generator=gen).prev_sample
    return (x.clamp(-1, 1) + 1) / 2


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    unet = build_unet(args.resolution).to(device)
    ema = EMAModel(unet.parameters(), decay=args.ema_decay, model_cls=UNet2DModel, model_config=unet.config)
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    opt = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=0.0)

    step = 0
    ckpt_path = os.path.join(args.out, "checkpoint.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        unet.load_state_dict(ck["unet"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
    ema.to(device)

    unet = DDP(unet, device_ids=[local_rank])
    loader = make_loader(args)
    torch.manual_seed(args.seed + 1000 * step + rank)  # different noise / timesteps on every rank

    writer = None
    if rank == 0:
        os.makedirs(os.path.join(args.out, "samples"), exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    data = iter(loader)
    unet.train()
    t0 = time.time()
    while step < args.max_steps:
        (x0,) = next(data)
        x0 = x0.to(device, non_blocking=True)
        noise = torch.randn_like(x0)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (x0.size(0),), device=device)
        xt = noise_sched.add_noise(x0, noise, t)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = unet(xt, t).sample
        loss = F.mse_loss(pred.float(), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
        ema.step(unet.parameters())
        step += 1

        if step % 100 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                writer.add_scalar("loss", l.item(), step)
                writer.add_scalar("img_per_s", 100 * args.batch_size * world / (time.time() - t0), step)
                t0 = time.time()

        if step % args.sample_every == 0 and rank == 0:
            ema_unet = build_unet(args.resolution).to(device)
            ema.copy_to(ema_unet.parameters())
            ema_unet.eval()
            imgs = sample_grid(ema_unet, noise_sched, 16, args.resolution, device)
            save_image(imgs, os.path.join(args.out, "samples", f"{step:07d}.png"), nrow=4)
            del ema_unet

        if step % args.save_every == 0:
            if rank == 0:
                torch.save({"unet": unet.state_dict(), "ema": ema.state_dict(),
                            "opt": opt.state_dict(), "step": step}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
