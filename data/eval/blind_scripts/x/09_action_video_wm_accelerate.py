"""
Action-conditioned video prediction (latent diffusion world model) on Bridge / RT-1 episodes.

Frames are stored as SD-VAE latents in HDF5 episodes: /ep_xxxx/latents [T,4,32,32], /ep_xxxx/actions [T,7].
The model predicts the next latent frame from `ctx` past latents + the action chunk, autoregressively at
eval time.

    accelerate launch --num_processes 8 --mixed_precision bf16 train_wm.py --data /data/bridge_latents.h5
"""
import argparse
import math
import os

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_cosine_schedule_with_warmup
from diffusers.training_utils import EMAModel
from torch.utils.data import DataLoader, Dataset

import wandb


class LatentEpisodes(Dataset):
    def __init__(self, path, keys, ctx, horizon=1):
        self.path, self.ctx, self.horizon = path, ctx, horizon
        self.samples = []
        with h5py.File(path, "r") as f:
            for k in keys:
                T = f[k]["latents"].shape[0]
                self.samples += [(k, t) for t in range(ctx, T - horizon + 1)]
        self.f = None

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        k, t = self.samples[i]
        lat = torch.from_numpy(self.f[k]["latents"][t - self.ctx:t + self.horizon]).float()
        act = torch.from_numpy(self.f[k]["actions"][t - 1:t + self.horizon - 1]).float()
        return {"context": lat[: self.ctx], "target": lat[self.ctx:], "actions": act}


class ActionEncoder(nn.Module):
    def __init__(self, action_dim, dim, n_tokens=4):
        super().__init__()
        self.n = n_tokens
        self.net = nn.Sequential(nn.Linear(action_dim, dim), nn.SiLU(), nn.Linear(dim, dim * n_tokens))

    def forward(self, a):  # [B, H, A] -> [B, H*n, D]
        B, H, _ = a.shape
        return self.net(a).view(B, H * self.n, -1)


class WorldModel(nn.Module):
    def __init__(self, ctx, action_dim):
        super().__init__()
        self.ctx = ctx
        self.unet = UNet2DConditionModel(
            sample_size=32, in_channels=4 * (ctx + 1), out_channels=4, layers_per_block=2,
            block_out_channels=(256, 512, 768, 768), cross_attention_dim=768,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)
        self.act_enc = ActionEncoder(action_dim, 768)

    def forward(self, noisy, t, context, actions):
        x = torch.cat([context.flatten(1, 2), noisy], dim=1)
        return self.unet(x, t, encoder_hidden_states=self.act_enc(actions)).sample


@torch.no_grad()
def rollout(model, scheduler, context, actions, steps, n_inference=25):
    """Autoregressive rollout: predict `steps` frames given the first `ctx` latents and per-step actions."""
    scheduler.set_timesteps(n_inference)
    frames = []
    ctx = context
    for s in range(steps):
        x = torch.randn_like(ctx[:, -1])
        for t in scheduler.timesteps:
            eps = model(x, t.expand(x.shape[0]).to(x.device), ctx, actions[:, s:s + 1])
            x = scheduler.step(eps, t, x).prev_sample
        frames.append(x)
        ctx = torch.cat([ctx[:, 1:], x[:, None]], dim=1)
    return torch.stack(frames, 1)


def evaluate(accelerator, model, val_loader, vae, args, step):
    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", clip_sample=False)
    psnrs, shown = [], False
    for batch in val_loader:
        pred = rollout(model, sched, batch["context"], batch["actions"], args.eval_horizon)
        gt = batch["target"]
        dec = lambda z: vae.decode(z.flatten(0, 1) / vae.config.scaling_factor).sample.clamp(-1, 1)
        p_img, g_img = dec(pred), dec(gt)
        mse = ((p_img - g_img) ** 2).flatten(1).mean(1).view(gt.shape[0], -1).mean(1)
        psnrs.append(10 * torch.log10(4.0 / mse))
        if not shown:
            vid = torch.stack([g_img.view(*gt.shape[:2], 3, 256, 256), p_img.view(*gt.shape[:2], 3, 256, 256)], -1)
            vid = ((vid.flatten(-2)[:4] + 1) * 127.5).byte().cpu().numpy()
            accelerator.log({"val/rollouts": [wandb.Video(v, fps=4) for v in vid]}, step=step)
            shown = True
    psnr = accelerator.gather_for_metrics(torch.cat(psnrs)).mean().item()
    accelerator.log({"val/psnr": psnr}, step=step)
    return psnr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--output_dir", default="runs/bridge_wm")
    ap.add_argument("--vae", default="stabilityai/sd-vae-ft-mse")
    ap.add_argument("--ctx", type=int, default=2)
    ap.add_argument("--eval_horizon", type=int, default=8)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max_steps", type=int, default=300_000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--eval_every", type=int, default=5000)
    ap.add_argument("--save_every", type=int, default=10_000)
    ap.add_argument("--resume", default=None)
    args = ap.parse_args()

    accelerator = Accelerator(log_with="wandb",
                              project_config=ProjectConfiguration(project_dir=args.output_dir,
                                                                  automatic_checkpoint_naming=True,
                                                                  total_limit=5))
    set_seed(0, device_specific=True)
    accelerator.init_trackers("bridge-world-model", config=vars(args))

    with h5py.File(args.data, "r") as f:
        keys = sorted(f.keys())
    rng = np.random.RandomState(0)
    perm = rng.permutation(len(keys))
    val_keys = [keys[i] for i in perm[:64]]
    train_keys = [keys[i] for i in perm[64:]]
    train_ds = LatentEpisodes(args.data, train_keys, args.ctx)
    val_ds = LatentEpisodes(args.data, val_keys, args.ctx, horizon=args.eval_horizon)
    val_ds.samples = val_ds.samples[::50]
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=8, drop_last=True,
                          pin_memory=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=8, shuffle=False, num_workers=2)

    action_dim = 7
    model = WorldModel(args.ctx, action_dim)
    ema = EMAModel(model.parameters(), decay=0.9999, use_ema_warmup=True)
    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear")
    vae = AutoencoderKL.from_pretrained(args.vae).to(accelerator.device).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    lr_sched = get_cosine_schedule_with_warmup(opt, args.warmup * accelerator.num_processes,
                                               args.max_steps * accelerator.num_processes)
    model, opt, train_dl, val_dl, lr_sched = accelerator.prepare(model, opt, train_dl, val_dl, lr_sched)
    ema.to(accelerator.device)
    accelerator.register_for_checkpointing(ema)

    step = 0
    if args.resume:
        accelerator.load_state(args.resume)
        step = int(open(os.path.join(args.resume, "step.txt")).read())

    model.train()
    while step < args.max_steps:
        for batch in train_dl:
            x0 = batch["target"][:, 0]
            noise = torch.randn_like(x0)
            t = torch.randint(0, 1000, (x0.shape[0],), device=x0.device)
            noisy = noise_sched.add_noise(x0, noise, t)
            # context-frame noise augmentation, helps long rollouts
            ctx = batch["context"] + 0.05 * torch.randn_like(batch["context"])
            with accelerator.autocast():
                eps = model(noisy, t, ctx, batch["actions"])
            loss = F.mse_loss(eps.float(), noise)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            lr_sched.step()
            opt.zero_grad(set_to_none=True)
            ema.step(model.parameters())
            step += 1

            if step % 50 == 0:
                accelerator.log({"train/loss": accelerator.reduce(loss.detach(), "mean").item(),
                                 "lr": lr_sched.get_last_lr()[0]}, step=step)

            if step % args.eval_every == 0 and accelerator.is_main_process:
                unwrapped = accelerator.unwrap_model(model)
                ema.store(unwrapped.parameters())
                ema.copy_to(unwrapped.parameters())
                unwrapped.eval()
                with accelerator.autocast():
                    evaluate(accelerator, unwrapped, val_dl, vae, args, step)
                ema.restore(unwrapped.parameters())
                unwrapped.train()

            if step % args.save_every == 0:
                accelerator.save_state()
                if accelerator.is_main_process:
                    last = sorted(os.listdir(os.path.join(args.output_dir, "checkpoints")),
                                  key=lambda d: int(d.split("_")[-1]))[-1]
                    with open(os.path.join(args.output_dir, "checkpoints", last, "step.txt"), "w") as f:
                        f.write(str(step))
            if step >= args.max_steps:
                break

    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
