"""CTS-Net-lite: two-stage speech enhancement.

Stage 1 (coarse): a TCN estimates a magnitude gain; with the noisy phase this
gives a coarse complex spectrum. Stage 2 (refine): a conv network takes the
coarse and noisy spectra and predicts a complex residual.

Curriculum: for the first --coarse-epochs epochs only stage 1 is trained,
afterwards the full pipeline is trained end to end.

    torchrun --nproc_per_node=4 17_ctsnet_lite.py --config configs/ctsnet_lite.json
"""
import argparse
import json
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR, N_FFT, HOP, WIN = 16000, 320, 160, 320

DEFAULT_CFG = {
    "clean_scp": "data/train_clean.scp", "noise_scp": "data/train_noise.scp",
    "valid_scp": "data/valid_pairs.scp", "exp_dir": "exp/ctsnet_lite",
    "epochs": 60, "coarse_epochs": 15, "batch_size": 16, "lr": 1e-3,
    "segment": 4.0, "snr": [-5, 15], "num_workers": 8,
}


def load_scp(path):
    with open(path) as f:
        return [line.split() for line in f if line.strip()]


class SCPMix(Dataset):
    def __init__(self, clean_scp, noise_scp, segment, snr):
        self.clean = [p[-1] for p in load_scp(clean_scp)]
        self.noise = [p[-1] for p in load_scp(noise_scp)]
        self.n, self.snr = int(segment * SR), snr

    def __len__(self):
        return len(self.clean)

    def _crop(self, path):
        x, _ = sf.read(path, dtype="float32")
        if len(x) < self.n:
            x = np.pad(x, (0, self.n - len(x)), mode="wrap")
        o = random.randint(0, len(x) - self.n)
        return x[o:o + self.n]

    def __getitem__(self, i):
        s, v = self._crop(self.clean[i]), self._crop(random.choice(self.noise))
        snr = random.uniform(*self.snr)
        v = v * np.sqrt(np.sum(s ** 2) / (np.sum(v ** 2) + 1e-8)) * 10 ** (-snr / 20)
        return torch.from_numpy((s + v).astype(np.float32)), torch.from_numpy(s.astype(np.float32))


class TCNLayer(nn.Module):
    def __init__(self, ch, hid, dil):
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(ch, hid, 1), nn.PReLU(), nn.GroupNorm(1, hid),
                                 nn.Conv1d(hid, hid, 3, padding=dil, dilation=dil, groups=hid),
                                 nn.PReLU(), nn.GroupNorm(1, hid), nn.Conv1d(hid, ch, 1))

    def forward(self, x):
        return x + self.net(x)


class CoarseNet(nn.Module):
    def __init__(self, n_freq=N_FFT // 2 + 1, ch=256, repeats=2, layers=6):
        super().__init__()
        self.inp = nn.Conv1d(n_freq, ch, 1)
        self.tcn = nn.Sequential(*[TCNLayer(ch, 512, 2 ** l) for _ in range(repeats) for l in range(layers)])
        self.out = nn.Conv1d(ch, n_freq, 1)

    def forward(self, mag):
        return torch.sigmoid(self.out(self.tcn(self.inp(mag.pow(0.5)))))


class RefineNet(nn.Module):
    def __init__(self, ch=48):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(4, ch, (3, 5), padding=(1, 2)), nn.GroupNorm(4, ch), nn.PReLU(ch),
            nn.Conv2d(ch, ch, (3, 5), padding=(2, 4), dilation=(2, 2)), nn.GroupNorm(4, ch), nn.PReLU(ch),
            nn.Conv2d(ch, ch, (3, 5), padding=(4, 8), dilation=(4, 4)), nn.GroupNorm(4, ch), nn.PReLU(ch),
            nn.Conv2d(ch, 2, 1))

    def forward(self, coarse, noisy):
        x = torch.cat([torch.view_as_real(coarse), torch.view_as_real(noisy)], -1).permute(0, 3, 1, 2)
        res = self.body(x).permute(0, 2, 3, 1).contiguous()
        return coarse + torch.view_as_complex(res)


class CTSNetLite(nn.Module):
    def __init__(self):
        super().__init__()
        self.coarse = CoarseNet()
        self.refine = RefineNet()

    def forward(self, spec, refine=True):
        gain = self.coarse(spec.abs())
        coarse = spec * gain
        if not refine:
            return coarse
        return self.refine(coarse, spec)


def spec_loss(est, ref):
    # magnitude + real/imag loss on power-compressed spectra
    em, rm = est.abs().clamp_min(1e-8), ref.abs().clamp_min(1e-8)
    ec, rc = est * em.pow(-0.5), ref * rm.pow(-0.5)
    return F.mse_loss(em.pow(0.5), rm.pow(0.5)) + F.mse_loss(torch.view_as_real(ec), torch.view_as_real(rc))


@torch.no_grad()
def validate(net, pairs, window, refine, device):
    net.eval()
    tot = torch.zeros(3, dtype=torch.float64, device=device)
    for noisy_path, clean_path in pairs:
        noisy, _ = sf.read(noisy_path, dtype="float32")
        clean, _ = sf.read(clean_path, dtype="float32")
        x = torch.from_numpy(noisy).to(device)[None]
        spec = torch.stft(x, N_FFT, HOP, WIN, window, return_complex=True)
        est = torch.istft(net(spec, refine=refine), N_FFT, HOP, WIN, window, length=x.shape[-1])
        est = est[0].cpu().numpy()
        tot[0] += pesq(SR, clean, est, "wb")
        tot[1] += stoi(clean, est, SR)
        tot[2] += 1
    dist.all_reduce(tot)
    net.train()
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    cfg = dict(DEFAULT_CFG)
    if args.config:
        with open(args.config) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    random.seed(rank)

    train_set = SCPMix(cfg["clean_scp"], cfg["noise_scp"], cfg["segment"], cfg["snr"])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=sampler,
                        num_workers=cfg["num_workers"], pin_memory=True, drop_last=True)
    valid_pairs = [tuple(p) for p in load_scp(cfg["valid_scp"])][rank::world]

    net = CTSNetLite().to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    window = torch.hann_window(WIN, device=device)
    os.makedirs(cfg["exp_dir"], exist_ok=True)

    best = 0.0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        refine = epoch >= cfg["coarse_epochs"]
        if epoch == cfg["coarse_epochs"]:
            for g in opt.param_groups:
                g["lr"] = cfg["lr"] * 0.5
        model.train()
        for step, (noisy, clean) in enumerate(loader):
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            n_spec = torch.stft(noisy, N_FFT, HOP, WIN, window, return_complex=True)
            c_spec = torch.stft(clean, N_FFT, HOP, WIN, window, return_complex=True)
            est = model(n_spec, refine=refine)
            loss = spec_loss(est, c_spec)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} refine={refine}", flush=True)

        p, s = validate(net, valid_pairs, window, refine, device)
        if rank == 0:
            print(f"epoch {epoch} PESQ {p:.3f} STOI {s:.4f}", flush=True)
            torch.save({"epoch": epoch, "model": net.state_dict(), "opt": opt.state_dict()},
                       os.path.join(cfg["exp_dir"], "last.pt"))
            if refine and p > best:
                best = p
                torch.save(net.state_dict(), os.path.join(cfg["exp_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
