"""
DIAMOND-style diffusion world model for Atari (EDM preconditioning, pixel space 64x64):
the denoiser sees the last 4 frames + the last action and denoises the next frame.

    accelerate launch --num_processes 4 --mixed_precision bf16 train_diamond_wm.py \
        --episodes /data/atari100k/Breakout --out runs/wm_breakout
"""
import argparse
import glob
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import UNet2DModel
from diffusers.training_utils import EMAModel
from torch.utils.data import DataLoader, Dataset

import wandb

N_CTX = 4
SIGMA_DATA = 0.5


class AtariSegments(Dataset):
    """episodes/*.npz with obs [T, 64, 64, 3] uint8, act [T] int64."""

    def __init__(self, files, horizon):
        self.eps = [dict(np.load(f)) for f in files]
        self.h = horizon
        self.idx = [(e, t) for e, ep in enumerate(self.eps) for t in range(len(ep["act"]) - N_CTX - horizon + 1)]

    def __len__(self):
        return len(self.idx)

    def __getitem__(self, i):
        e, t = self.idx[i]
        ep = self.eps[e]
        obs = torch.from_numpy(ep["obs"][t:t + N_CTX + self.h]).permute(0, 3, 1, 2).float() / 127.5 - 1
        act = torch.from_numpy(ep["act"][t:t + N_CTX + self.h])
        return obs, act


class Denoiser(torch.nn.Module):
    def __init__(self, n_actions):
        super().__init__()
        self.unet = UNet2DModel(sample_size=64, in_channels=3 * (N_CTX + 1), out_channels=3,
                                block_out_channels=(64, 64, 128, 256), layers_per_block=2,
                                down_block_types=("DownBlock2D",) * 4, up_block_types=("UpBlock2D",) * 4,
                                class_embed_type=None, num_class_embeds=n_actions)

    def forward(self, noisy, sigma, ctx_obs, action):
        # EDM preconditioning
        c_skip = SIGMA_DATA ** 2 / (sigma ** 2 + SIGMA_DATA ** 2)
        c_out = sigma * SIGMA_DATA / (sigma ** 2 + SIGMA_DATA ** 2).sqrt()
        c_in = 1 / (sigma ** 2 + SIGMA_DATA ** 2).sqrt()
        c_noise = sigma.log() / 4
        s = lambda v: v.view(-1, 1, 1, 1)
        x = torch.cat([ctx_obs.flatten(1, 2), s(c_in) * noisy], 1)
        F_x = self.unet(x, c_noise, class_labels=action).sample
        return s(c_skip) * noisy + s(c_out) * F_x


@torch.no_grad()
def sample_next(model, ctx_obs, action, steps=3, sigma_min=2e-3, sigma_max=5.0, rho=7):
    """Euler sampler over the EDM sigma schedule (DIAMOND uses very few steps)."""
    B = ctx_obs.shape[0]
    i = torch.arange(steps, device=ctx_obs.device)
    sigmas = (sigma_max ** (1 / rho) + i / (steps - 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
    x = torch.randn(B, 3, 64, 64, device=ctx_obs.device) * sigmas[0]
    for k in range(steps):
        den = model(x, sigmas[k].expand(B), ctx_obs, action)
        x = x + (x - den) / sigmas[k] * (sigmas[k + 1] - sigmas[k])
    return x.clamp(-1, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n_actions", type=int, default=18)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--eval_every", type=int, default=5000)
    ap.add_argument("--eval_horizon", type=int, default=15)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    accelerator = Accelerator(log_with="wandb")
    set_seed(0, device_specific=True)
    accelerator.init_trackers("diamond-wm", config=vars(args))

    files = sorted(glob.glob(os.path.join(args.episodes, "*.npz")))
    n_val = max(1, len(files) // 10)
    train_ds = AtariSegments(files[n_val:], horizon=1)
    val_ds = AtariSegments(files[:n_val], horizon=args.eval_horizon)
    val_ds.idx = val_ds.idx[:: max(1, len(val_ds.idx) // 512)][:512]
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True,
                          pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=64, shuffle=False, num_workers=2)

    model = Denoiser(args.n_actions)
    ema = EMAModel(model.parameters(), decay=0.999)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8, weight_decay=1e-2)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    model, opt, train_dl, val_dl, warm = accelerator.prepare(model, opt, train_dl, val_dl, warm)
    ema.to(accelerator.device)
    accelerator.register_for_checkpointing(ema)

    step, best_psnr = 0, -1.0
    state_dir = os.path.join(args.out, "state")
    if args.resume and os.path.isdir(state_dir):
        accelerator.load_state(state_dir)
        meta = torch.load(os.path.join(state_dir, "meta.pt"))
        step, best_psnr = meta["step"], meta["best_psnr"]

    model.train()
    while step < args.steps:
        for obs, act in train_dl:
            ctx, target, a = obs[:, :N_CTX], obs[:, N_CTX], act[:, N_CTX - 1]
            # sigma ~ lognormal(-0.4, 1.2) as in EDM/DIAMOND; small noise augmentation on the context
            sigma = (torch.randn(target.shape[0], device=target.device) * 1.2 - 0.4).exp()
            ctx = ctx + 0.1 * torch.rand(ctx.shape[0], 1, 1, 1, 1, device=ctx.device) * torch.randn_like(ctx)
            noisy = target + sigma.view(-1, 1, 1, 1) * torch.randn_like(target)
            with accelerator.autocast():
                den = model(noisy, sigma, ctx, a)
            w = (sigma ** 2 + SIGMA_DATA ** 2) / (sigma * SIGMA_DATA) ** 2
            loss = (w.view(-1, 1, 1, 1) * (den.float() - target) ** 2).mean()
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            warm.step()
            opt.zero_grad(set_to_none=True)
            ema.step(model.parameters())
            step += 1

            if step % 100 == 0:
                accelerator.log({"train/loss": accelerator.reduce(loss.detach(), "mean").item()}, step=step)

            if step % args.eval_every == 0:
                # imagination rollouts with the EMA weights: PSNR vs. ground truth over the horizon
                net = accelerator.unwrap_model(model)
                ema.store(net.parameters())
                ema.copy_to(net.parameters())
                net.eval()
                psnr_sum, n = torch.zeros(args.eval_horizon, device=accelerator.device), 0
                for vobs, vact in val_dl:
                    ctx = vobs[:, :N_CTX]
                    for k in range(args.eval_horizon):
                        with accelerator.autocast():
                            nxt = sample_next(net, ctx, vact[:, N_CTX - 1 + k]).float()
                        gt = vobs[:, N_CTX + k]
                        mse = ((nxt - gt) ** 2).flatten(1).mean(1)
                        psnr_sum[k] += (10 * torch.log10(4.0 / mse)).sum()
                        ctx = torch.cat([ctx[:, 1:], nxt[:, None]], 1)
                    n += vobs.shape[0]
                psnr = psnr_sum / n
                ema.restore(net.parameters())
                net.train()
                accelerator.log({"val/psnr_1": psnr[0].item(), "val/psnr_h": psnr[-1].item(),
                                 "val/psnr_mean": psnr.mean().item()}, step=step)
                accelerator.wait_for_everyone()
                accelerator.save_state(state_dir)
                if accelerator.is_main_process:
                    if psnr.mean().item() > best_psnr:
                        best_psnr = psnr.mean().item()
                        torch.save(ema.state_dict(), os.path.join(args.out, "best_ema.pt"))
                        wandb.run.summary["best_psnr"] = best_psnr
                    torch.save({"step": step, "best_psnr": best_psnr}, os.path.join(state_dir, "meta.pt"))
            if step >= args.steps:
                break

    accelerator.end_training()


if __name__ == "__main__":
    main()
