"""Fine-tune a HiFi-GAN-style vocoder on the TTS model's predicted mels (MPD + mel L1 + feature matching).

torchrun --nproc_per_node=4 20_vocoder_gan_finetune.py --train_list data/voc_ft/train.txt \
    --init ckpt/hifigan_universal.pt --global_batch 64
"""
import argparse
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


@dataclass
class VocCfg:
    train_list: str
    init: str = ""
    out: str = "ckpt/voc_ft"
    global_batch: int = 64
    segment: int = 8192
    hop: int = 256
    lr: float = 1e-4
    steps: int = 100_000
    mel_weight: float = 45.0
    upsample: list = field(default_factory=lambda: [8, 8, 2, 2])
    per_gpu_batch: int = field(init=False)

    def __post_init__(self):
        world = dist.get_world_size() if dist.is_available() else 1
        assert self.global_batch % world == 0, f"global_batch {self.global_batch} not divisible by {world} GPUs"
        self.per_gpu_batch = self.global_batch // world


class MelWavPairs(Dataset):
    """train.txt lines: wav_path|predicted_mel.npy (mel frames aligned to hop)"""

    def __init__(self, list_path, segment, hop):
        self.items = [l.strip().split("|") for l in open(list_path) if l.strip()]
        self.seg, self.hop = segment, hop

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        wav_path, mel_path = self.items[i]
        wav, _ = sf.read(wav_path, dtype="float32")
        mel = np.load(mel_path)  # (80, T)
        frames = self.seg // self.hop
        if mel.shape[1] > frames:
            s = random.randint(0, mel.shape[1] - frames)
            mel = mel[:, s:s + frames]
            wav = wav[s * self.hop:(s + frames) * self.hop]
        wav = np.pad(wav, (0, self.seg - len(wav)))[: self.seg]
        mel = np.pad(mel, ((0, 0), (0, frames - mel.shape[1])), mode="edge")
        return torch.from_numpy(mel).float(), torch.from_numpy(wav)[None]


class ResBlock(nn.Module):
    def __init__(self, ch, k=3, dil=(1, 3, 5)):
        super().__init__()
        self.convs = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, dilation=d, padding=d * (k - 1) // 2))
                                    for d in dil])

    def forward(self, x):
        for c in self.convs:
            x = x + c(F.leaky_relu(x, 0.1))
        return x


class Generator(nn.Module):
    def __init__(self, upsample, ch=512):
        super().__init__()
        self.pre = weight_norm(nn.Conv1d(80, ch, 7, padding=3))
        ups, res = [], []
        for u in upsample:
            ups.append(weight_norm(nn.ConvTranspose1d(ch, ch // 2, 2 * u, u, padding=u // 2)))
            ch //= 2
            res.append(ResBlock(ch))
        self.ups, self.res = nn.ModuleList(ups), nn.ModuleList(res)
        self.post = weight_norm(nn.Conv1d(ch, 1, 7, padding=3))

    def forward(self, mel):
        x = self.pre(mel)
        for up, rb in zip(self.ups, self.res):
            x = rb(up(F.leaky_relu(x, 0.1)))
        return torch.tanh(self.post(F.leaky_relu(x)))


class PeriodDisc(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p
        chs = [1, 32, 128, 512, 1024]
        self.convs = nn.ModuleList([weight_norm(nn.Conv2d(chs[i], chs[i + 1], (5, 1), (3, 1), (2, 0)))
                                    for i in range(4)])
        self.out = weight_norm(nn.Conv2d(1024, 1, (3, 1), 1, (1, 0)))

    def forward(self, x):
        b, c, t = x.shape
        if t % self.p:
            x = F.pad(x, (0, self.p - t % self.p), "reflect")
        x = x.view(b, c, -1, self.p)
        feats = []
        for conv in self.convs:
            x = F.leaky_relu(conv(x), 0.1)
            feats.append(x)
        return self.out(x).flatten(1), feats


class MPD(nn.Module):
    def __init__(self):
        super().__init__()
        self.discs = nn.ModuleList([PeriodDisc(p) for p in (2, 3, 5, 7, 11)])

    def forward(self, y):
        return [d(y) for d in self.discs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_list", required=True)
    ap.add_argument("--init", default="")
    ap.add_argument("--global_batch", type=int, default=64)
    ap.add_argument("--out", default="ckpt/voc_ft")
    cfg = VocCfg(**vars(ap.parse_args()))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    dev = torch.device("cuda", local_rank)

    G, D = Generator(cfg.upsample).to(dev), MPD().to(dev)
    if cfg.init:
        ck = torch.load(cfg.init, map_location="cpu")
        G.load_state_dict(ck["generator"])
        if "mpd" in ck:
            D.load_state_dict(ck["mpd"])
    G = DDP(G, device_ids=[local_rank])
    D = DDP(D, device_ids=[local_rank])
    opt_g = torch.optim.AdamW(G.parameters(), cfg.lr, betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(D.parameters(), cfg.lr, betas=(0.8, 0.99))
    mel_fn = torchaudio.transforms.MelSpectrogram(22050, n_fft=1024, hop_length=cfg.hop, n_mels=80,
                                                  f_min=0, f_max=8000).to(dev)

    ds = MelWavPairs(cfg.train_list, cfg.segment, cfg.hop)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=cfg.per_gpu_batch, sampler=sampler, num_workers=4, pin_memory=True,
                    drop_last=True)
    tb = SummaryWriter(os.path.join(cfg.out, "tb")) if rank == 0 else None

    step, epoch = 0, 0
    t0 = time.time()
    while step < cfg.steps:
        sampler.set_epoch(epoch)
        for mel, wav in dl:
            mel, wav = mel.to(dev, non_blocking=True), wav.to(dev, non_blocking=True)
            fake = G(mel)

            # discriminator (LSGAN)
            opt_d.zero_grad(set_to_none=True)
            d_loss = 0.0
            for (r, _), (f, _) in zip(D(wav), D(fake.detach())):
                d_loss = d_loss + ((1 - r) ** 2).mean() + (f ** 2).mean()
            d_loss.backward()
            opt_d.step()

            # generator: adversarial + feature matching + mel L1
            opt_g.zero_grad(set_to_none=True)
            mel_l = F.l1_loss(torch.log(mel_fn(fake.squeeze(1)) + 1e-5), torch.log(mel_fn(wav.squeeze(1)) + 1e-5))
            adv, fm = 0.0, 0.0
            for (f, f_feats), (_, r_feats) in zip(D(fake), D(wav)):
                adv = adv + ((1 - f) ** 2).mean()
                fm = fm + sum(F.l1_loss(a, b.detach()) for a, b in zip(f_feats, r_feats))
            g_loss = adv + 2 * fm + cfg.mel_weight * mel_l
            g_loss.backward()
            nn.utils.clip_grad_norm_(G.parameters(), 100.0)
            opt_g.step()
            step += 1

            if step % 100 == 0:
                s = torch.stack([d_loss.detach(), adv.detach(), fm.detach(), mel_l.detach()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    for k, v in zip(["d", "adv", "fm", "mel"], s.tolist()):
                        tb.add_scalar(f"loss/{k}", v, step)
                    print(f"step {step} mel {s[3]:.4f} d {s[0]:.3f} {(time.time() - t0) / 100:.2f}s/it", flush=True)
                t0 = time.time()
            if step % 5000 == 0 and rank == 0:
                os.makedirs(cfg.out, exist_ok=True)
                torch.save({"generator": G.module.state_dict(), "mpd": D.module.state_dict(), "step": step},
                           os.path.join(cfg.out, f"voc_{step:07d}.pt"))
            if step >= cfg.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
