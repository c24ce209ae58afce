"""MDX-Net style TFC-TDF U-Net for vocal extraction, DDP + Weights & Biases.

    torchrun --nproc_per_node=8 09_mdx_tfc_wandb.py --config configs/mdx_vocals.yaml
"""
import argparse
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

STEMS = ["vocals", "bass", "drums", "other"]


def Norm(c):
    return nn.InstanceNorm2d(c, affine=True, eps=1e-8)


class TFC_TDF(nn.Module):
    def __init__(self, cin, c, f, bn=8):
        super().__init__()
        self.tfc1 = nn.Sequential(Norm(cin), nn.GELU(), nn.Conv2d(cin, c, 3, 1, 1, bias=False))
        self.tdf = nn.Sequential(Norm(c), nn.GELU(), nn.Linear(f, f // bn, bias=False),
                                 Norm(c), nn.GELU(), nn.Linear(f // bn, f, bias=False))
        self.tfc2 = nn.Sequential(Norm(c), nn.GELU(), nn.Conv2d(c, c, 3, 1, 1, bias=False))
        self.shortcut = nn.Conv2d(cin, c, 1, bias=False)

    def forward(self, x):  # B C T F
        s = self.shortcut(x)
        x = self.tfc1(x)
        x = x + self.tdf(x)
        return self.tfc2(x) + s


class TFCTDFNet(nn.Module):
    def __init__(self, n_fft, hop, dim_f, audio_ch=2, c=32, g=32, scales=4):
        super().__init__()
        self.n_fft, self.hop, self.dim_f, self.audio_ch = n_fft, hop, dim_f, audio_ch
        self.register_buffer("window", torch.hann_window(n_fft, periodic=True), persistent=False)
        self.first = nn.Conv2d(2 * audio_ch, c, 1, bias=False)
        self.enc, self.down, self.up, self.dec = nn.ModuleList(), nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        f, ch = dim_f, c
        for _ in range(scales):
            self.enc.append(TFC_TDF(ch, ch, f))
            self.down.append(nn.Sequential(Norm(ch), nn.GELU(), nn.Conv2d(ch, ch + g, 2, 2, bias=False)))
            f, ch = f // 2, ch + g
        self.bottleneck = TFC_TDF(ch, ch, f)
        for _ in range(scales):
            self.up.append(nn.Sequential(Norm(ch), nn.GELU(), nn.ConvTranspose2d(ch, ch - g, 2, 2, bias=False)))
            f, ch = f * 2, ch - g
            self.dec.append(TFC_TDF(2 * ch, ch, f))
        self.final = nn.Sequential(nn.Conv2d(ch + 2 * audio_ch, ch, 1, bias=False), nn.GELU(),
                                   nn.Conv2d(ch, 2 * audio_ch, 1, bias=False))

    def forward(self, wav):
        B, C, T = wav.shape
        z = torch.stft(wav.reshape(B * C, T), self.n_fft, self.hop, window=self.window, center=True, return_complex=True)
        n_bins, n_frames = z.shape[-2:]
        x = torch.view_as_real(z[:, :self.dim_f]).reshape(B, C, self.dim_f, n_frames, 2)
        x = x.permute(0, 1, 4, 3, 2).reshape(B, 2 * C, n_frames, self.dim_f)
        mix = x
        x = self.first(x)
        skips = []
        for enc, down in zip(self.enc, self.down):
            x = enc(x)
            skips.append(x)
            x = down(x)
        x = self.bottleneck(x)
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([up(x), skips.pop()], 1))
        x = self.final(torch.cat([mix, x], 1))
        x = x.reshape(B, C, 2, n_frames, self.dim_f).permute(0, 1, 4, 3, 2).contiguous()
        x = F.pad(torch.view_as_complex(x), (0, 0, 0, n_bins - self.dim_f))
        return torch.istft(x.reshape(B * C, n_bins, n_frames), self.n_fft, self.hop, window=self.window,
                           length=T).reshape(B, C, T)


class VocalRemix(Dataset):
    def __init__(self, root, names, chunk, items):
        self.root, self.names, self.chunk, self.items = root, names, chunk, items
        self.frames = {n: sf.info(os.path.join(root, n, "mixture.wav")).frames for n in names}

    def __len__(self):
        return self.items

    def clip(self, name, stem):
        start = random.randint(0, self.frames[name] - self.chunk)
        x, _ = sf.read(os.path.join(self.root, name, stem + ".wav"), start=start, frames=self.chunk,
                       dtype="float32", always_2d=True)
        return x.T * random.uniform(0.5, 1.5)

    def __getitem__(self, i):
        voc = self.clip(random.choice(self.names), "vocals")
        acc = sum(self.clip(random.choice(self.names), s) for s in STEMS[1:])
        if random.random() < 0.5:
            voc, acc = voc[::-1], acc[::-1]
        return torch.from_numpy(np.ascontiguousarray(voc + acc)), torch.from_numpy(np.ascontiguousarray(voc))


@torch.no_grad()
def demix(model, mix, chunk, overlap, device, batch=4):
    step = int(chunk * (1 - overlap))
    T = mix.shape[-1]
    pad_end = (step - (T - chunk) % step) % step if T > chunk else chunk - T
    x = F.pad(mix, (0, pad_end)).to(device)
    win = torch.hamming_window(chunk, device=device)
    out = torch.zeros_like(x)
    norm = torch.zeros(x.shape[-1], device=device)
    starts = list(range(0, x.shape[-1] - chunk + 1, step))
    for i in range(0, len(starts), batch):
        idx = starts[i:i + batch]
        y = model(torch.stack([x[:, s:s + chunk] for s in idx]))
        for s, yy in zip(idx, y):
            out[:, s:s + chunk] += yy * win
            norm[s:s + chunk] += win
    return (out / norm.clamp_min(1e-6))[:, :T]


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-name", default=None)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    seed_all(cfg["seed"])

    wandb.init(project=cfg.get("wandb_project", "mdx-vocals"), name=args.run_name, config=cfg)

    chunk = cfg["hop"] * (cfg["dim_t"] - 1)
    train_ds = VocalRemix(cfg["root"], cfg["train_tracks"], chunk, cfg["items_per_epoch"])
    sampler = DistributedSampler(train_ds, seed=cfg["seed"])
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, num_workers=cfg["num_workers"],
                        pin_memory=True, drop_last=True,
                        worker_init_fn=lambda w: seed_all(cfg["seed"] + 1000 * rank + w + 100000 * int(time.time() % 1000)))

    net = TFCTDFNet(cfg["n_fft"], cfg["hop"], cfg["dim_f"], c=cfg["ch"], g=cfg["growth"], scales=cfg["scales"]).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0))
    total_steps = cfg["epochs"] * len(loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=total_steps, pct_start=0.05)

    os.makedirs(cfg["ckpt_dir"], exist_ok=True)
    step, best = 0, -1e9
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        for mix, voc in loader:
            mix, voc = mix.to(device, non_blocking=True), voc.to(device, non_blocking=True)
            est = model(mix)
            loss = F.mse_loss(est, voc)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.get("grad_clip", 1.0))
            opt.step()
            sched.step()
            step += 1
            if step % cfg["log_every"] == 0:
                wandb.log({"train/loss": loss.item(), "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        net.eval()
        acc = torch.zeros(2, device=device)
        for name in cfg["valid_tracks"][rank::world]:
            mix, _ = sf.read(os.path.join(cfg["root"], name, "mixture.wav"), dtype="float32", always_2d=True)
            ref, _ = sf.read(os.path.join(cfg["root"], name, "vocals.wav"), dtype="float32", always_2d=True)
            est = demix(net, torch.from_numpy(mix.T), chunk, cfg.get("overlap", 0.5), device)
            ref = torch.from_numpy(ref.T).to(device)
            acc[0] += 10 * torch.log10(ref.pow(2).sum() / (ref - est).pow(2).sum().clamp_min(1e-9))
            acc[1] += 1
        dist.all_reduce(acc)
        net.train()
        sdr = (acc[0] / acc[1]).item()
        wandb.log({"valid/vocals_sdr": sdr, "epoch": epoch}, step=step)

        if rank == 0:
            print(f"epoch {epoch}: valid vocals SDR {sdr:.3f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "step": step}, os.path.join(cfg["ckpt_dir"], "last.ckpt"))
            if sdr > best:
                best = sdr
                torch.save(net.state_dict(), os.path.join(cfg["ckpt_dir"], "best.ckpt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
