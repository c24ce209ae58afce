#!/usr/bin/env python3
"""DDPM training on 64x64 images, with a tiny built-in process launcher.

    python 10_ddpm_popen_launcher.py launch --nproc 8 -- --data /data/celeba64 --out /shared/ddpm/celeba64

`launch` forks one `train` subprocess per GPU, restarts the group on failure
and writes stdout/stderr of each rank to <out>/logs/rank<k>.log.
"""
import argparse
import copy
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import DDPMScheduler, UNet2DModel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.utils import save_image


# ---------------------------------------------------------------- launcher
def launch(argv):
    ap = argparse.ArgumentParser(prog="launch")
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--port", type=int, default=29612)
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    la = ap.parse_args(argv)
    train_argv = la.rest[1:] if la.rest[:1] == ["--"] else la.rest
    out = train_argv[train_argv.index("--out") + 1]
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)

    group = []

    def stop_all(sig=signal.SIGTERM):
        for p in group:
            if p.poll() is None:
                p.send_signal(sig)
        for p in group:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    def on_signal(signum, _):
        stop_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    for attempt in range(la.max_restarts + 1):
        group.clear()
        for rank in range(la.nproc):
            env = os.environ.copy()
            env["RANK"] = str(rank)
            env["WORLD_SIZE"] = str(la.nproc)
            env["MASTER_ADDR"] = "127.0.0.1"
            env["MASTER_PORT"] = str(la.port)
            logf = open(os.path.join(out, "logs", f"rank{rank}.log"), "a")
            logf.write(f"==== attempt {attempt} ====\n")
            logf.flush()
            group.append(subprocess.Popen([sys.executable, __file__, "train", *train_argv], env=env,
                                          stdout=logf, stderr=subprocess.STDOUT))
            logf.close()
        while True:
            rcs = [p.poll() for p in group]
            if all(rc == 0 for rc in rcs):
                print("training finished")
                return 0
            if any(rc not in (None, 0) for rc in rcs):
                print(f"attempt {attempt}: exit codes {rcs}, restarting", file=sys.stderr)
                stop_all()
                break
            time.sleep(5)
    return 1


# ---------------------------------------------------------------- training
def train(argv):
    ap = argparse.ArgumentParser(prog="train")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--batch-per-gpu", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--steps", type=int, default=300_000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--sample-every", type=int, default=10_000)
    args = ap.parse_args(argv)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1000)

    tf = transforms.Compose([transforms.Resize(args.res), transforms.CenterCrop(args.res),
                             transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                             transforms.Normalize([0.5] * 3, [0.5] * 3)])
    ds = datasets.ImageFolder(args.data, tf)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, num_workers=8,
                    pin_memory=True, drop_last=True, persistent_workers=True)

    unet = UNet2DModel(sample_size=args.res, in_channels=3, out_channels=3, layers_per_block=2,
                       block_out_channels=(128, 256, 256, 512),
                       down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D", "UpBlock2D")).to(device)
    ema = copy.deepcopy(unet).requires_grad_(False).eval()
    model = DDP(unet, device_ids=[local_rank])
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    torch.manual_seed(1000 + rank)  # different noise / timesteps per rank

    ckpt_path = os.path.join(args.out, "ckpt.pt")
    step, epoch = 0, 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ck["unet"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        step, epoch = ck["step"], ck["epoch"]
        if rank == 0:
            print(f"resumed from step {step}", flush=True)

    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, _ in dl:
            x = x.to(device, non_blocking=True)
            noise = torch.randn_like(x)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (x.size(0),), device=device)
            noisy = noise_sched.add_noise(x, noise, t)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(noisy, t).sample
            loss = F.mse_loss(pred.float(), noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.module.parameters()):
                    pe.lerp_(pm, 1 - args.ema)
            step += 1

            if step % 500 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} {(time.time() - t0) / 500:.3f}s/it", flush=True)
                t0 = time.time()
            if step % args.sample_every == 0:
                if rank == 0:
                    sample(ema, noise_sched, device, os.path.join(args.out, f"samples_{step:07d}.png"), args.res)
                    torch.save({"unet": model.module.state_dict(), "ema": ema.state_dict(),
                                "opt": opt.state_dict(), "step": step, "epoch": epoch}, ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


@torch.no_grad()
def sample(net, sched, device, path, res, n=64):
    sched = copy.deepcopy(sched)
    sched.set_timesteps(250)
    x = torch.randn(n, 3, res, res, device=device)
    for t in sched.timesteps:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eps = net(x, t).sample
        x = sched.step(eps.float(), t, x).prev_sample
    save_image((x.clamp(-1, 1) + 1) / 2, path, nrow=8)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("launch", "train"):
        sys.exit(f"usage: {sys.argv[0]} launch|train ...")
    cmd, rest = sys.argv[1], sys.argv[2:]
    sys.exit(launch(rest) if cmd == "launch" else train(rest))
