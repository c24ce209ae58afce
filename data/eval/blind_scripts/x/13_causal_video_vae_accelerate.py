"""
Causal 3D video VAE (4x temporal, 8x spatial compression) for a latent video world model.
Raw mp4 clips are decoded on the fly with decord.

    accelerate launch --multi_gpu --num_processes 8 --mixed_precision bf16 train_video_vae.py \
        --video_root /data/robot_videos --out runs/cvae_f4s8
"""
import argparse
import glob
import os
import pickle
import random

import decord
import lpips
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, Dataset

decord.bridge.set_bridge("torch")


def build_clip_index(video_root, num_frames, stride, cache_path):
    """List of (path, start) for every clip of `num_frames` frames; scanning 1M videos takes ~20 min,
    so the result is cached next to the data."""
    if os.path.exists(cache_path):
        with open(cache_path, "rb") as f:
            return pickle.load(f)
    index = []
    span = (num_frames - 1) * stride + 1
    for path in sorted(glob.glob(os.path.join(video_root, "**", "*.mp4"), recursive=True)):
        try:
            n = len(decord.VideoReader(path, num_threads=1))
        except Exception:
            continue
        index.extend((path, s) for s in range(0, n - span + 1, span))
    with open(cache_path, "wb") as f:
        pickle.dump(index, f)
    return index


class VideoClips(Dataset):
    def __init__(self, index, num_frames, stride, size):
        self.index, self.T, self.stride, self.size = index, num_frames, stride, size

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        path, s = self.index[i]
        vr = decord.VideoReader(path, num_threads=1)
        frames = vr.get_batch(list(range(s, s + (self.T - 1) * self.stride + 1, self.stride)))  # T H W C uint8
        x = frames.permute(3, 0, 1, 2).float() / 127.5 - 1.0
        x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", antialias=True, align_corners=False)
        return x  # C T H W


class CausalConv3d(nn.Module):
    def __init__(self, cin, cout, k=3, stride=(1, 1, 1)):
        super().__init__()
        self.pad_t = k - 1
        self.conv = nn.Conv3d(cin, cout, k, stride=stride, padding=(0, k // 2, k // 2))

    def forward(self, x):
        x = torch.cat([x[:, :, :1].expand(-1, -1, self.pad_t, -1, -1), x], dim=2)
        return self.conv(x)


class ResBlock3d(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), CausalConv3d(cin, cout)
        self.n2, self.c2 = nn.GroupNorm(32, cout), CausalConv3d(cout, cout)
        self.skip = nn.Conv3d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.c1(F.silu(self.n1(x)))
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class VideoVAE(nn.Module):
    def __init__(self, ch=(128, 256, 512, 512), z=16):
        super().__init__()
        self.inp = CausalConv3d(3, ch[0])
        enc = []
        for i in range(3):
            enc += [ResBlock3d(ch[i], ch[i + 1]),
                    CausalConv3d(ch[i + 1], ch[i + 1], stride=(2 if i < 2 else 1, 2, 2))]
        self.enc = nn.Sequential(*enc, ResBlock3d(ch[-1], ch[-1]), nn.GroupNorm(32, ch[-1]), nn.SiLU())
        self.to_moments = CausalConv3d(ch[-1], 2 * z)
        self.from_z = CausalConv3d(z, ch[-1])
        dec = []
        for i in reversed(range(3)):
            dec += [ResBlock3d(ch[i + 1], ch[i]),
                    nn.Upsample(scale_factor=(2 if i < 2 else 1, 2, 2), mode="nearest"),
                    CausalConv3d(ch[i], ch[i])]
        self.dec = nn.Sequential(*dec, nn.GroupNorm(32, ch[0]), nn.SiLU(), CausalConv3d(ch[0], 3))

    def encode(self, x):
        mean, logvar = self.to_moments(self.enc(self.inp(x))).chunk(2, 1)
        return mean, logvar.clamp(-30, 20)

    def decode(self, z):
        return self.dec(self.from_z(z))

    def forward(self, x):
        mean, logvar = self.encode(x)
        z = mean + torch.randn_like(mean) * (0.5 * logvar).exp()
        rec = self.decode(z)
        return rec[:, :, : x.shape[2]], mean, logvar


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--video_root", required=True)
    ap.add_argument("--out", default="runs/cvae")
    ap.add_argument("--num_frames", type=int, default=17)
    ap.add_argument("--stride", type=int, default=2)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=300_000)
    ap.add_argument("--kl_weight", type=float, default=1e-6)
    ap.add_argument("--lpips_weight", type=float, default=0.1)
    ap.add_argument("--save_every", type=int, default=5000)
    ap.add_argument("--log_every", type=int, default=50)
    args = ap.parse_args()

    accelerator = Accelerator(log_with="wandb", mixed_precision="bf16")
    set_seed(7, device_specific=True)
    accelerator.init_trackers("video-vae", config=vars(args), init_kwargs={"wandb": {"name": os.path.basename(args.out)}})

    cache = os.path.join(args.video_root, f"clip_index_T{args.num_frames}_s{args.stride}.pkl")
    index = build_clip_index(args.video_root, args.num_frames, args.stride, cache)
    accelerator.print(f"{len(index)} clips")
    random.Random(0).shuffle(index)
    val_index, train_index = index[:256], index[256:]

    train_dl = DataLoader(VideoClips(train_index, args.num_frames, args.stride, args.size),
                          batch_size=args.batch_size, shuffle=True, num_workers=10, pin_memory=True,
                          drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_dl = DataLoader(VideoClips(val_index, args.num_frames, args.stride, args.size), batch_size=args.batch_size,
                        shuffle=False, num_workers=4)

    vae = VideoVAE()
    perceptual = lpips.LPIPS(net="vgg").eval().requires_grad_(False)
    opt = torch.optim.AdamW(vae.parameters(), lr=args.lr, betas=(0.5, 0.9), weight_decay=0.0)
    vae, opt, train_dl, val_dl = accelerator.prepare(vae, opt, train_dl, val_dl)
    perceptual.to(accelerator.device)

    step = 0
    state_dir = os.path.join(args.out, "state")
    if os.path.isdir(state_dir):
        accelerator.load_state(state_dir)
        step = torch.load(os.path.join(state_dir, "step.pt"))["step"]
        accelerator.print(f"resumed at {step}")

    vae.train()
    while step < args.steps:
        for x in train_dl:
            with accelerator.autocast():
                rec, mean, logvar = vae(x)
                rec_loss = F.l1_loss(rec.float(), x)
                # LPIPS on a random frame per clip to keep memory in check
                fi = torch.randint(0, x.shape[2], (1,)).item()
                p_loss = perceptual(rec[:, :, fi].float(), x[:, :, fi]).mean()
                kl = 0.5 * (mean.float().pow(2) + logvar.float().exp() - 1 - logvar.float()).mean()
                loss = rec_loss + args.lpips_weight * p_loss + args.kl_weight * kl
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(vae.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                logs = accelerator.reduce(torch.stack([rec_loss.detach(), p_loss.detach(), kl.detach()]), "mean")
                accelerator.log({"train/l1": logs[0].item(), "train/lpips": logs[1].item(),
                                 "train/kl": logs[2].item()}, step=step)

            if step % args.save_every == 0:
                vae.eval()
                psnr_sum = torch.zeros(2, device=accelerator.device)
                with torch.no_grad(), accelerator.autocast():
                    for vx in val_dl:
                        vr, _, _ = vae(vx)
                        mse = (vr.float().clamp(-1, 1) - vx).pow(2).flatten(1).mean(1)
                        psnr = accelerator.gather_for_metrics(10 * torch.log10(4.0 / mse))
                        psnr_sum += torch.stack([psnr.sum(), torch.tensor(float(psnr.numel()), device=psnr.device)])
                accelerator.log({"val/psnr": (psnr_sum[0] / psnr_sum[1]).item()}, step=step)
                vae.train()
                accelerator.save_state(state_dir)
                if accelerator.is_main_process:
                    torch.save({"step": step}, os.path.join(state_dir, "step.pt"))
                    torch.save(accelerator.unwrap_model(vae).state_dict(),
                               os.path.join(args.out, f"vae_{step:07d}.pt"))
            if step >= args.steps:
                break

    accelerator.end_training()


if __name__ == "__main__":
    main()
