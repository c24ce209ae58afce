"""Matcha-style TTS: transformer text encoder + MAS durations + conditional flow matching mel decoder.

torchrun --nproc_per_node=4 13_matcha_cfm_train.py --config configs/ljspeech.yaml --resume runs/matcha/last.ckpt
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from monotonic_align import maximum_path
from text import text_to_sequence, symbols


class TextMelDataset(Dataset):
    def __init__(self, filelist, mel_dir, mel_mean, mel_std):
        with open(filelist, encoding="utf-8") as f:
            self.items = [l.strip().split("|") for l in f if l.strip()]
        self.mel_dir, self.mean, self.std = mel_dir, mel_mean, mel_std

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        utt, text = self.items[i][0], self.items[i][-1]
        x = torch.LongTensor(text_to_sequence(text, ["english_cleaners2"]))
        mel = torch.from_numpy(np.load(os.path.join(self.mel_dir, utt + ".npy"))).float()
        return x, (mel - self.mean) / self.std


def collate(batch):
    xs, ys = zip(*batch)
    x_len = torch.LongTensor([len(x) for x in xs])
    y_len = torch.LongTensor([y.size(1) for y in ys])
    y_max = int(math.ceil(y_len.max().item() / 4) * 4)  # decoder downsamples by 4
    x = nn.utils.rnn.pad_sequence(xs, batch_first=True)
    y = torch.zeros(len(ys), ys[0].size(0), y_max)
    for i, m in enumerate(ys):
        y[i, :, :m.size(1)] = m
    return x, x_len, y, y_len


def seq_mask(lens, max_len):
    return (torch.arange(max_len, device=lens.device)[None] < lens[:, None]).unsqueeze(1).float()


class TextEncoder(nn.Module):
    def __init__(self, n_vocab, n_feats, d=192, layers=6, heads=2):
        super().__init__()
        self.emb = nn.Embedding(n_vocab, d)
        self.prenet = nn.Sequential(*[nn.Sequential(nn.Conv1d(d, d, 5, padding=2), nn.ReLU()) for _ in range(3)])
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.proj_m = nn.Conv1d(d, n_feats, 1)
        self.dur = nn.Sequential(nn.Conv1d(d, 256, 3, padding=1), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Conv1d(256, 256, 3, padding=1), nn.ReLU(), nn.Dropout(0.1), nn.Conv1d(256, 1, 1))

    def forward(self, x, x_len):
        x_mask = seq_mask(x_len, x.size(1))
        h = self.emb(x).transpose(1, 2) * math.sqrt(self.emb.embedding_dim)
        h = self.prenet(h) * x_mask + h
        h = self.encoder(h.transpose(1, 2), src_key_padding_mask=x_mask[:, 0] == 0).transpose(1, 2) * x_mask
        return self.proj_m(h) * x_mask, self.dur(h.detach()) * x_mask, x_mask


class TimeEmbedding(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.d = d
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d))

    def forward(self, t):
        half = self.d // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device) / half)
        e = 1000 * t[:, None] * freqs[None]
        return self.mlp(torch.cat([e.sin(), e.cos()], -1))


class ResBlock1d(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(cin, cout, 3, padding=1), nn.Conv1d(cout, cout, 3, padding=1)
        self.n1, self.n2 = nn.GroupNorm(8, cout), nn.GroupNorm(8, cout)
        self.t = nn.Linear(tdim, cout)
        self.skip = nn.Conv1d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, mask, temb):
        h = F.mish(self.n1(self.c1(x * mask))) + self.t(temb)[..., None]
        h = F.mish(self.n2(self.c2(h * mask)))
        return (h + self.skip(x)) * mask


class Estimator(nn.Module):
    """Small 1D U-Net predicting the flow-matching vector field."""

    def __init__(self, n_feats, ch=(256, 256)):
        super().__init__()
        self.temb = TimeEmbedding(ch[0])
        self.down1 = ResBlock1d(2 * n_feats, ch[0], ch[0])
        self.down2 = ResBlock1d(ch[0], ch[1], ch[0])
        self.mid = ResBlock1d(ch[1], ch[1], ch[0])
        self.up2 = ResBlock1d(2 * ch[1], ch[0], ch[0])
        self.up1 = ResBlock1d(2 * ch[0], ch[0], ch[0])
        self.out = nn.Conv1d(ch[0], n_feats, 1)

    def forward(self, x, mask, mu, t):
        temb = self.temb(t)
        h1 = self.down1(torch.cat([x, mu], 1), mask, temb)
        m2 = mask[..., ::2]
        h2 = self.down2(F.avg_pool1d(h1, 2), m2, temb)
        m = self.mid(F.avg_pool1d(h2, 2), mask[..., ::4], temb)
        u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2.0), h2], 1), m2, temb)
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), h1], 1), mask, temb)
        return self.out(u1) * mask


class MatchaTTS(nn.Module):
    def __init__(self, n_vocab, n_feats=80, sigma_min=1e-4):
        super().__init__()
        self.encoder = TextEncoder(n_vocab, n_feats)
        self.estimator = Estimator(n_feats)
        self.sigma_min = sigma_min

    def forward(self, x, x_len, y, y_len):
        mu_x, logw, x_mask = self.encoder(x, x_len)
        y_mask = seq_mask(y_len, y.size(2))
        attn_mask = x_mask.unsqueeze(-1) * y_mask.unsqueeze(2)
        with torch.no_grad():
            const = -0.5 * math.log(2 * math.pi) * mu_x.size(1)
            logp = (const - 0.5 * (y ** 2).sum(1, keepdim=True).transpose(1, 2)
                    + torch.matmul(mu_x.transpose(1, 2), y) - 0.5 * (mu_x ** 2).sum(1).unsqueeze(-1))
            attn = maximum_path(logp, attn_mask.squeeze(1)).unsqueeze(1).detach()
        logw_ = torch.log(1e-8 + attn.sum(-1)) * x_mask
        dur_loss = torch.sum((logw - logw_) ** 2) / torch.sum(x_mask)
        mu_y = torch.matmul(attn.squeeze(1).transpose(1, 2), mu_x.transpose(1, 2)).transpose(1, 2)
        prior_loss = torch.sum(0.5 * ((y - mu_y) ** 2 + math.log(2 * math.pi)) * y_mask)
        prior_loss = prior_loss / (torch.sum(y_mask) * y.size(1))
        # conditional flow matching
        t = torch.rand(y.size(0), device=y.device)
        z = torch.randn_like(y)
        tt = t[:, None, None]
        x_t = (1 - (1 - self.sigma_min) * tt) * z + tt * y
        u = y - (1 - self.sigma_min) * z
        v = self.estimator(x_t, y_mask, mu_y, t)
        cfm_loss = F.mse_loss(v, u, reduction="sum") / (torch.sum(y_mask) * y.size(1))
        return dur_loss, prior_loss, cfm_loss, attn

    @torch.no_grad()
    def synthesise(self, x, x_len, n_steps=10, temperature=0.667, length_scale=1.0):
        mu_x, logw, x_mask = self.encoder(x, x_len)
        w = torch.ceil(torch.exp(logw) * x_mask * length_scale)
        y_len = torch.clamp_min(w.sum([1, 2]), 1).long()
        y_max = int(math.ceil(y_len.max().item() / 4) * 4)
        y_mask = seq_mask(y_len, y_max)
        attn_mask = x_mask.unsqueeze(-1) * y_mask.unsqueeze(2)
        cum = torch.cumsum(w.squeeze(1), -1)
        pos = torch.arange(y_max, device=x.device)[None, None]
        attn = ((pos < cum[..., None]) & (pos >= (cum - w.squeeze(1))[..., None])).float() * attn_mask.squeeze(1)
        mu_y = torch.matmul(attn.transpose(1, 2), mu_x.transpose(1, 2)).transpose(1, 2)
        y = torch.randn_like(mu_y) * temperature
        dt = 1.0 / n_steps
        for i in range(n_steps):
            t = torch.full((x.size(0),), i * dt, device=x.device)
            y = y + dt * self.estimator(y, y_mask, mu_y, t)
        return y * y_mask, y_len


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--out", default="runs/matcha")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    stats = cfg["data"]
    train_ds = TextMelDataset(stats["train_filelist"], stats["mel_dir"], stats["mel_mean"], stats["mel_std"])
    valid_ds = TextMelDataset(stats["valid_filelist"], stats["mel_dir"], stats["mel_mean"], stats["mel_std"])
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=cfg["batch_size"], sampler=sampler, collate_fn=collate,
                        num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)

    model = MatchaTTS(len(symbols), n_feats=cfg["n_feats"]).to(device)
    optim = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    step, epoch = 0, 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optimizer"])
        step, epoch = ckpt["step"], ckpt["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.resume} at step {step}")
    model = DDP(model, device_ids=[local_rank])

    writer = SummaryWriter(args.out) if rank == 0 else None
    while epoch < cfg["epochs"]:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for x, x_len, y, y_len in loader:
            x, x_len = x.to(device, non_blocking=True), x_len.to(device, non_blocking=True)
            y, y_len = y.to(device, non_blocking=True), y_len.to(device, non_blocking=True)
            dur_loss, prior_loss, cfm_loss, attn = model(x, x_len, y, y_len)
            loss = dur_loss + prior_loss + cfm_loss
            optim.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            optim.step()
            step += 1

            if step % cfg["log_every"] == 0:
                logs = torch.stack([dur_loss.detach(), prior_loss.detach(), cfm_loss.detach()])
                dist.all_reduce(logs)
                logs = (logs / world).tolist()
                if rank == 0:
                    writer.add_scalar("sub_loss/train_dur_loss", logs[0], step)
                    writer.add_scalar("sub_loss/train_prior_loss", logs[1], step)
                    writer.add_scalar("sub_loss/train_diff_loss", logs[2], step)
                    writer.add_scalar("train/grad_norm", gnorm.item(), step)
                    print(f"ep {epoch} step {step} dur {logs[0]:.3f} prior {logs[1]:.3f} cfm {logs[2]:.3f}")

        if rank == 0:
            net = model.module
            net.eval()
            for i in range(2):
                xv, yv = valid_ds[i]
                mel, _ = net.synthesise(xv[None].to(device), torch.LongTensor([len(xv)]).to(device))
                writer.add_image(f"generated/{i}", mel[0].flip(0).cpu().unsqueeze(0), step)
                if epoch == 0:
                    writer.add_image(f"original/{i}", yv.flip(0).unsqueeze(0), step)
            net.train()
            os.makedirs(args.out, exist_ok=True)
            torch.save({"model": net.state_dict(), "optimizer": optim.state_dict(), "step": step, "epoch": epoch},
                       os.path.join(args.out, "last.ckpt"))
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s")
        dist.barrier()
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
