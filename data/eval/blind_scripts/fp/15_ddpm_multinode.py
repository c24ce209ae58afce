"""DDPM training (diffusers UNet2DModel) at 256px, two p4d nodes.

    # on each node
    torchrun --nnodes=2 --nproc-per-node=8 --max-restarts=5 \
        --rdzv-id=ddpm256 --rdzv-backend=c10d --rdzv-endpoint=$HEAD_IP:29400 \
        15_ddpm_multinode.py --data /fsx/datasets/ffhq256 --run ddpm-ffhq256

Checkpoints go to the instance NVMe (much faster than writing multi-GB files to
FSx every 30 minutes); samples and the final model are copied to FSx.
"""
import argparse
import copy
import glob
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from torchvision.utils import save_image

_stop = False


def _sigterm(*_):
    global _stop
    _stop = True


class ImageDir(Dataset):
    def __init__(self, root, size):
        self.files = sorted(glob.glob(os.path.join(root, "**", "*.png"), recursive=True))
        self.tf = transforms.Compose([
            transforms.Resize(size), transforms.CenterCrop(size), transforms.RandomHorizontalFlip(),
            transforms.ToTensor(), transforms.Normalize([0.5] * 3, [0.5] * 3)])

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return self.tf(Image.open(self.files[i]).convert("RGB"))


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--ckpt-dir", default="/opt/dlami/nvme/checkpoints")
    p.add_argument("--results-dir", default="/fsx/results")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--bs", type=int, default=16, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-4, help="global batch 16 GPUs x 16 = 256")
    p.add_argument("--ema", type=float, default=0.9999)
    p.add_argument("--steps", type=int, default=500000)
    p.add_argument("--ckpt-every", type=int, default=5000)
    p.add_argument("--sample-every", type=int, default=20000)
    return p.parse_args()


@torch.no_grad()
def ema_update(ema, model, decay):
    for pe, pm in zip(ema.parameters(), model.parameters()):
        pe.mul_(decay).add_(pm.detach(), alpha=1 - decay)


@torch.no_grad()
def sample(ema, scheduler, n, size, device):
    x = torch.randn(n, 3, size, size, device=device)
    scheduler.set_timesteps(250)
    for t in scheduler.timesteps:
        x = scheduler.step(ema(x, t).sample, t, x).prev_sample
    return (x.clamp(-1, 1) + 1) / 2


def main():
    args = options()
    signal.signal(signal.SIGTERM, _sigterm)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    run_ckpt = os.path.join(args.ckpt_dir, args.run)
    run_results = os.path.join(args.results_dir, args.run)
    if rank == 0:
        os.makedirs(run_ckpt, exist_ok=True)
        os.makedirs(run_results, exist_ok=True)

    ds = ImageDir(args.data, args.size)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)

    model = UNet2DModel(sample_size=args.size, in_channels=3, out_channels=3, layers_per_block=2,
                        block_out_channels=(128, 128, 256, 256, 512, 512),
                        down_block_types=("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4).to(device)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    noise_sched = DDPMScheduler(num_train_timesteps=1000)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

    step, epoch = 0, 0
    ckpt_path = os.path.join(run_ckpt, "latest.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ck["model"])
        ema.load_state_dict(ck["ema"])
        optimizer.load_state_dict(ck["opt"])
        step, epoch = ck["step"], ck["epoch"]
        print(f"[rank {rank}] resumed from step {step}", flush=True)

    ddp = DDP(model, device_ids=[local_rank])
    torch.manual_seed(1234 + rank + step)  # different noise / timesteps per rank
    scaler = torch.cuda.amp.GradScaler()
    stop = torch.zeros(1, device=device)

    def checkpoint():
        if rank == 0:
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.state_dict(), "ema": ema.state_dict(),
                        "opt": optimizer.state_dict(), "step": step, "epoch": epoch}, tmp)
            os.replace(tmp, ckpt_path)
        dist.barrier()

    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x0 in loader:
            x0 = x0.to(device, non_blocking=True)
            noise = torch.randn_like(x0)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (x0.size(0),), device=device)
            xt = noise_sched.add_noise(x0, noise, t)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = ddp(xt, t).sample
            loss = F.mse_loss(pred.float(), noise)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            ema_update(ema, model, args.ema)
            step += 1

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.5f} {100 * args.bs * world / (time.time() - t0):.1f} img/s",
                          flush=True)
                    t0 = time.time()

            stop[0] = float(_stop)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() or step % args.ckpt_every == 0:
                checkpoint()
            if step % args.sample_every == 0 and rank == 0:
                imgs = sample(ema, DDPMScheduler(num_train_timesteps=1000), 16, args.size, device)
                save_image(imgs, os.path.join(run_results, f"samples_{step:07d}.png"), nrow=4)
            if stop.item() or step >= args.steps:
                break
        if stop.item():
            break
        epoch += 1

    if rank == 0:
        if stop.item():
            print(f"SIGTERM at step {step}, checkpoint written, exiting", flush=True)
        else:
            ema.save_pretrained(os.path.join(run_results, "ema_unet"))
            shutil.copy(ckpt_path, os.path.join(run_results, "final_state.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
