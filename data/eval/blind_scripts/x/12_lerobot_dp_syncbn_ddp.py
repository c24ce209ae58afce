"""
Image Diffusion Policy on LeRobot datasets (pusht / xarm / aloha single-arm), torchrun DDP.

    torchrun --nproc_per_node=8 train_dp_lerobot.py --repo_id lerobot/pusht --out outputs/dp_pusht
    # resume
    torchrun --nproc_per_node=8 train_dp_lerobot.py --repo_id lerobot/pusht --out outputs/dp_pusht --resume
"""
import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from diffusers import DDPMScheduler
from lerobot.common.datasets.lerobot_dataset import LeRobotDataset
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, DistributedSampler

import wandb


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo_id", default="lerobot/pusht")
    ap.add_argument("--out", default="outputs/dp_pusht")
    ap.add_argument("--n_obs", type=int, default=2)
    ap.add_argument("--horizon", type=int, default=16)
    ap.add_argument("--batch_size", type=int, default=64, help="per-GPU micro batch")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--base_lr", type=float, default=1e-4, help="lr for a global batch of 64")
    ap.add_argument("--steps", type=int, default=200_000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--val_every", type=int, default=5000)
    ap.add_argument("--save_every", type=int, default=10_000)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


class ObsEncoder(nn.Module):
    def __init__(self, state_dim):
        super().__init__()
        rn = torchvision.models.resnet18(weights="IMAGENET1K_V1")
        rn.fc = nn.Identity()
        self.rgb = rn
        self.state = nn.Linear(state_dim, 64)

    def forward(self, img, state):  # img [B, T, 3, H, W]
        B, T = img.shape[:2]
        f = self.rgb(img.flatten(0, 1)).view(B, T, -1)
        return torch.cat([f, self.state(state)], -1).flatten(1)


class ResBlock1d(nn.Module):
    def __init__(self, c, cond):
        super().__init__()
        self.b1 = nn.Sequential(nn.Conv1d(c, c, 5, padding=2), nn.GroupNorm(8, c), nn.Mish())
        self.b2 = nn.Sequential(nn.Conv1d(c, c, 5, padding=2), nn.GroupNorm(8, c), nn.Mish())
        self.film = nn.Linear(cond, 2 * c)

    def forward(self, x, c):
        s, b = self.film(c)[..., None].chunk(2, 1)
        return x + self.b2(self.b1(x) * (1 + s) + b)


class DP(nn.Module):
    def __init__(self, state_dim, act_dim, n_obs, width=512, depth=8, grad_ckpt=False):
        super().__init__()
        self.enc = ObsEncoder(state_dim)
        cond = n_obs * (512 + 64) + 128
        self.temb = nn.Sequential(nn.Linear(1, 128), nn.Mish(), nn.Linear(128, 128))
        self.inp = nn.Conv1d(act_dim, width, 1)
        self.blocks = nn.ModuleList([ResBlock1d(width, cond) for _ in range(depth)])
        self.outp = nn.Conv1d(width, act_dim, 1)
        self.grad_ckpt = grad_ckpt

    def forward(self, noisy, t, img, state):
        c = torch.cat([self.enc(img, state), self.temb(t[:, None].float() / 100)], -1)
        x = self.inp(noisy.transpose(1, 2))
        for blk in self.blocks:
            if self.grad_ckpt and self.training:
                x = checkpoint(blk, x, c, use_reentrant=False)
            else:
                x = blk(x, c)
        return self.outp(x).transpose(1, 2)


def batch_to(batch, device, stats, n_obs):
    img = batch["observation.image"][:, :n_obs].to(device, non_blocking=True)
    img = (img - 0.5) / 0.5
    st = (batch["observation.state"][:, :n_obs].to(device) - stats["s_min"]) / (stats["s_max"] - stats["s_min"]) * 2 - 1
    act = (batch["action"].to(device) - stats["a_min"]) / (stats["a_max"] - stats["a_min"]) * 2 - 1
    return img, st, act


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    fps = 10
    dt = {"observation.image": [-(args.n_obs - 1 - i) / fps for i in range(args.n_obs)],
          "observation.state": [-(args.n_obs - 1 - i) / fps for i in range(args.n_obs)],
          "action": [(i - args.n_obs + 1) / fps for i in range(args.horizon)]}
    # the first rank downloads the dataset and backbone weights, the others wait and then read the cache
    if rank != 0:
        dist.barrier()
    ds = LeRobotDataset(args.repo_id, delta_timestamps=dt)
    torchvision.models.ResNet18_Weights.IMAGENET1K_V1.get_state_dict(progress=False)
    if rank == 0:
        dist.barrier()

    st = ds.meta.stats
    stats = {k: v.to(device) for k, v in {"s_min": st["observation.state"]["min"], "s_max": st["observation.state"]["max"],
                                          "a_min": st["action"]["min"], "a_max": st["action"]["max"]}.items()}
    n_val = 2000
    g = torch.Generator().manual_seed(0)
    train_ds, val_ds = torch.utils.data.random_split(ds, [len(ds) - n_val, n_val], generator=g)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    tr_dl = DataLoader(train_ds, args.batch_size, sampler=tr_sampler, num_workers=8, pin_memory=True,
                       drop_last=True, persistent_workers=True)
    va_dl = DataLoader(val_ds, args.batch_size, sampler=va_sampler, num_workers=4, pin_memory=True)

    state_dim = ds.meta.features["observation.state"]["shape"][0]
    act_dim = ds.meta.features["action"]["shape"][0]
    model = DP(state_dim, act_dim, args.n_obs, grad_ckpt=args.grad_ckpt)
    # ResNet BatchNorm sees tiny per-GPU batches (B * n_obs images); sync statistics across ranks
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9995), use_buffers=True)

    global_bs = args.batch_size * args.accum * world
    lr = args.base_lr * global_bs / 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    step = 0
    ckpt_path = os.path.join(args.out, "last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        sd = ck["model"]
        consume_prefix_in_state_dict_if_present(sd, "module.")  # saved from the DDP wrapper
        model.load_state_dict(sd)
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]

    # wrapped after loading, so DDP's initial broadcast sees the resumed weights on every rank
    ddp = DDP(model, device_ids=[local_rank], gradient_as_bucket_view=True)
    torch.manual_seed(1 + rank)  # same init above, different noise/timesteps per rank from here
    noise_sched = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2", clip_sample=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="dp-lerobot", name=os.path.basename(args.out), config={**vars(args), "lr": lr}, resume="allow")

    epoch = step * args.accum // len(tr_dl)
    micro, t0 = 0, time.time()
    while step < args.steps:
        tr_sampler.set_epoch(epoch)
        ddp.train()
        for batch in tr_dl:
            img, s, a = batch_to(batch, device, stats, args.n_obs)
            noise = torch.randn_like(a)
            t = torch.randint(0, 100, (a.shape[0],), device=device)
            micro += 1
            sync = micro % args.accum == 0
            # skip the all-reduce on accumulation micro-steps
            ctx = ddp.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                pred = ddp(noise_sched.add_noise(a, noise, t), t, img, s)
                loss = F.mse_loss(pred, noise) / args.accum
                loss.backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            ema.update_parameters(model)
            step += 1

            if step % 100 == 0:
                l = loss.detach() * args.accum
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "lr": sched.get_last_lr()[0],
                               "s_per_step": (time.time() - t0) / 100}, step=step)
                t0 = time.time()

            if step % args.val_every == 0:
                ema.eval()
                acc = torch.zeros(2, device=device)
                with torch.no_grad():
                    for vb in va_dl:
                        img, s, a = batch_to(vb, device, stats, args.n_obs)
                        noise = torch.randn_like(a)
                        t = torch.randint(0, 100, (a.shape[0],), device=device)
                        pred = ema(noise_sched.add_noise(a, noise, t), t, img, s)
                        acc += torch.stack([F.mse_loss(pred, noise, reduction="sum"),
                                            torch.tensor(float(noise.numel()), device=device)])
                dist.all_reduce(acc)
                if rank == 0:
                    wandb.log({"val/ema_denoise_mse": (acc[0] / acc[1]).item()}, step=step)
                ddp.train()

            if step % args.save_every == 0:
                if rank == 0:
                    torch.save({"model": ddp.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "stats": {k: v.cpu() for k, v in stats.items()}},
                               ckpt_path + ".tmp")
                    os.replace(ckpt_path + ".tmp", ckpt_path)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
