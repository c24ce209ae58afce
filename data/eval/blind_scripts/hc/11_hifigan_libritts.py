"""HiFi-GAN (V1 generator, MPD + MSD) on LibriTTS 24 kHz.

torchrun --nnodes 1 --nproc_per_node 8 11_hifigan_libritts.py --config configs/libritts_24k.yaml --exp exp/hifigan_libritts
"""
import argparse
import itertools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import remove_weight_norm, spectral_norm, weight_norm
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from vocoder_data import SegmentDataset, mel_spectrogram

LRELU = 0.1


def get_padding(k, d=1):
    return (k * d - d) // 2


class ResBlock(nn.Module):
    def __init__(self, ch, k, dilations):
        super().__init__()
        self.c1 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, 1, get_padding(k, d), d)) for d in dilations])
        self.c2 = nn.ModuleList([weight_norm(nn.Conv1d(ch, ch, k, 1, get_padding(k))) for _ in dilations])
        for m in itertools.chain(self.c1, self.c2):
            m.weight.data.normal_(0.0, 0.01)

    def forward(self, x):
        for a, b in zip(self.c1, self.c2):
            x = x + b(F.leaky_relu(a(F.leaky_relu(x, LRELU)), LRELU))
        return x


class Generator(nn.Module):
    def __init__(self, n_mels, up_rates, up_kernels, up_ch, rb_kernels, rb_dilations):
        super().__init__()
        self.pre = weight_norm(nn.Conv1d(n_mels, up_ch, 7, 1, 3))
        self.ups, self.rbs = nn.ModuleList(), nn.ModuleList()
        ch = up_ch
        for u, k in zip(up_rates, up_kernels):
            self.ups.append(weight_norm(nn.ConvTranspose1d(ch, ch // 2, k, u, (k - u) // 2)))
            ch //= 2
            self.rbs.append(nn.ModuleList([ResBlock(ch, rk, rd) for rk, rd in zip(rb_kernels, rb_dilations)]))
        self.post = weight_norm(nn.Conv1d(ch, 1, 7, 1, 3))

    def forward(self, x):
        x = self.pre(x)
        for up, rbs in zip(self.ups, self.rbs):
            x = up(F.leaky_relu(x, LRELU))
            x = sum(rb(x) for rb in rbs) / len(rbs)
        return torch.tanh(self.post(F.leaky_relu(x)))


class DiscP(nn.Module):
    def __init__(self, period):
        super().__init__()
        self.period = period
        chs = [1, 32, 128, 512, 1024]
        self.convs = nn.ModuleList([weight_norm(nn.Conv2d(chs[i], chs[i + 1], (5, 1), (3, 1), (2, 0)))
                                    for i in range(4)] + [weight_norm(nn.Conv2d(1024, 1024, (5, 1), 1, (2, 0)))])
        self.post = weight_norm(nn.Conv2d(1024, 1, (3, 1), 1, (1, 0)))

    def forward(self, x):
        b, c, t = x.shape
        if t % self.period:
            x = F.pad(x, (0, self.period - t % self.period), "reflect")
        x = x.view(b, c, -1, self.period)
        fmap = []
        for l in self.convs:
            x = F.leaky_relu(l(x), LRELU)
            fmap.append(x)
        x = self.post(x)
        fmap.append(x)
        return x.flatten(1), fmap


class DiscS(nn.Module):
    def __init__(self, sn=False):
        super().__init__()
        norm = spectral_norm if sn else weight_norm
        cfg = [(1, 128, 15, 1, 1), (128, 128, 41, 2, 4), (128, 256, 41, 2, 16), (256, 512, 41, 4, 16),
               (512, 1024, 41, 4, 16), (1024, 1024, 41, 1, 16), (1024, 1024, 5, 1, 1)]
        self.convs = nn.ModuleList([norm(nn.Conv1d(i, o, k, s, k // 2, groups=g)) for i, o, k, s, g in cfg])
        self.post = norm(nn.Conv1d(1024, 1, 3, 1, 1))

    def forward(self, x):
        fmap = []
        for l in self.convs:
            x = F.leaky_relu(l(x), LRELU)
            fmap.append(x)
        x = self.post(x)
        fmap.append(x)
        return x.flatten(1), fmap


class Discriminators(nn.Module):
    """MPD (periods 2,3,5,7,11) + MSD (3 scales) behind one module so one DDP wrapper covers both."""

    def __init__(self):
        super().__init__()
        self.mpd = nn.ModuleList([DiscP(p) for p in (2, 3, 5, 7, 11)])
        self.msd = nn.ModuleList([DiscS(sn=True), DiscS(), DiscS()])
        self.pool = nn.AvgPool1d(4, 2, padding=2)

    def forward(self, y):
        outs, fmaps = [], []
        for d in self.mpd:
            o, f = d(y)
            outs.append(o); fmaps.append(f)
        for i, d in enumerate(self.msd):
            if i > 0:
                y = self.pool(y)
            o, f = d(y)
            outs.append(o); fmaps.append(f)
        return outs, fmaps


def d_loss(real, fake):
    return sum(torch.mean((1 - r) ** 2) + torch.mean(g ** 2) for r, g in zip(real, fake))


def g_loss(fake):
    return sum(torch.mean((1 - g) ** 2) for g in fake)


def fm_loss(fr, fg):
    return 2 * sum(torch.mean(torch.abs(a.detach() - b)) for da, dg in zip(fr, fg) for a, b in zip(da, dg))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--exp", required=True)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))
    a = cfg["audio"]

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    def to_mel(wav):
        return mel_spectrogram(wav, a["n_fft"], a["num_mels"], a["sr"], a["hop"], a["win"], a["fmin"], a["fmax_loss"])

    train_set = SegmentDataset(cfg["train_list"], a, segment_size=cfg["segment_size"], train=True)
    val_set = SegmentDataset(cfg["val_list"], a, segment_size=None, train=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=1, sampler=val_sampler, num_workers=2)

    gen = Generator(a["num_mels"], **cfg["generator"]).to(dev)
    disc = Discriminators().to(dev)
    opt_g = torch.optim.AdamW(gen.parameters(), cfg["lr"], betas=(0.8, 0.99))
    opt_d = torch.optim.AdamW(disc.parameters(), cfg["lr"], betas=(0.8, 0.99))

    ckpt_dir = os.path.join(args.exp, "ckpt")
    step, epoch, best_val = 0, 0, float("inf")
    last = os.path.join(ckpt_dir, "last.pt")
    if os.path.exists(last):
        ck = torch.load(last, map_location="cpu")
        gen.load_state_dict(ck["gen"]); disc.load_state_dict(ck["disc"])
        opt_g.load_state_dict(ck["opt_g"]); opt_d.load_state_dict(ck["opt_d"])
        step, epoch, best_val = ck["step"], ck["epoch"], ck["best_val"]

    gen = DDP(gen, device_ids=[local_rank])
    disc = DDP(disc, device_ids=[local_rank])
    sch_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, cfg["lr_decay"])
    sch_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, cfg["lr_decay"])
    for _ in range(epoch):
        sch_g.step(); sch_d.step()

    writer = SummaryWriter(os.path.join(args.exp, "tb")) if rank == 0 else None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    while step < cfg["max_steps"]:
        train_sampler.set_epoch(epoch)
        gen.train(); disc.train()
        for mel, wav in train_loader:
            mel, wav = mel.to(dev, non_blocking=True), wav.to(dev, non_blocking=True).unsqueeze(1)
            wav_hat = gen(mel)
            mel_hat = to_mel(wav_hat.squeeze(1))

            real_out, _ = disc(wav)
            fake_out, _ = disc(wav_hat.detach())
            loss_d = d_loss(real_out, fake_out)
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()

            real_out, fmap_r = disc(wav)
            fake_out, fmap_g = disc(wav_hat)
            loss_mel = F.l1_loss(to_mel(wav.squeeze(1)), mel_hat)
            loss_g = g_loss(fake_out) + fm_loss(fmap_r, fmap_g) + 45 * loss_mel
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                writer.add_scalar("train/loss_g", loss_g.item(), step)
                writer.add_scalar("train/loss_d", loss_d.item(), step)
                writer.add_scalar("train/mel_l1", loss_mel.item(), step)

            if step % cfg["val_interval"] == 0:
                gen.eval()
                total, count = 0.0, 0
                with torch.no_grad():
                    for vmel, vwav in val_loader:
                        vmel, vwav = vmel.to(dev), vwav.to(dev)
                        vhat = gen.module(vmel).squeeze(1)
                        T = min(vhat.size(-1), vwav.size(-1))
                        total += F.l1_loss(to_mel(vhat[..., :T]), to_mel(vwav[..., :T])).item()
                        count += 1
                val_mel = total / max(count, 1)
                gen.train()
                if rank == 0:
                    writer.add_scalar("val/mel_l1", val_mel, step)
                    state = {"gen": gen.module.state_dict(), "disc": disc.module.state_dict(),
                             "opt_g": opt_g.state_dict(), "opt_d": opt_d.state_dict(),
                             "step": step, "epoch": epoch, "best_val": min(best_val, val_mel)}
                    torch.save(state, last)
                    if val_mel < best_val:
                        best_val = val_mel
                        torch.save({"gen": gen.module.state_dict(), "step": step}, os.path.join(ckpt_dir, "best.pt"))
                        print(f"step {step}: new best val mel L1 {val_mel:.4f}")
            if step >= cfg["max_steps"]:
                break
        sch_g.step(); sch_d.step()
        epoch += 1

    if rank == 0:
        g = gen.module
        for m in g.modules():
            if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d)) and hasattr(m, "weight_g"):
                remove_weight_norm(m)
        torch.save({"gen": g.state_dict()}, os.path.join(args.exp, "generator_inference.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
