"""Causal CRN (conv-LSTM encoder/decoder) for real-time speech enhancement.

Optional multi-task frame VAD head (enable with vad_weight > 0 in the yaml).

    torchrun --standalone --nproc_per_node=4 11_crn_enhance_vad_aux.py --conf conf/crn_16k.yaml
"""
import argparse
import glob
import os
import random

import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULT_CONF = {
    "train_dir": "/data/dns_synth/train", "valid_dir": "/data/dns_synth/valid", "exp_dir": "exp/crn",
    "sr": 16000, "segment": 4.0, "n_fft": 320, "hop": 160, "batch_size": 16, "lr": 6e-4, "epochs": 80,
    "vad_weight": 0.0, "num_workers": 8, "grad_clip": 5.0,
}


class PairDataset(Dataset):
    def __init__(self, root, sr, segment=None):
        self.noisy = sorted(glob.glob(os.path.join(root, "noisy", "*.wav")))
        self.clean_dir = os.path.join(root, "clean")
        self.seg = int(sr * segment) if segment else None

    def __len__(self):
        return len(self.noisy)

    def __getitem__(self, i):
        path = self.noisy[i]
        n = sf.info(path).frames
        a = 0
        if self.seg and n > self.seg:
            a = random.randint(0, n - self.seg)
        b = a + self.seg if self.seg else None
        x, _ = sf.read(path, start=a, stop=b, dtype="float32")
        y, _ = sf.read(os.path.join(self.clean_dir, os.path.basename(path)), start=a, stop=b, dtype="float32")
        if self.seg and len(x) < self.seg:
            x, y = F.pad(torch.from_numpy(x), (0, self.seg - len(x))), F.pad(torch.from_numpy(y), (0, self.seg - len(y)))
            return x, y
        return torch.from_numpy(x), torch.from_numpy(y)


class CRN(nn.Module):
    def __init__(self, n_fft=320, hop=160, chans=(16, 32, 64, 128, 256), lstm_hidden=1024):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("win", torch.hann_window(n_fft), persistent=False)
        c = (1,) + chans
        self.enc = nn.ModuleList([
            nn.Sequential(nn.Conv2d(c[i], c[i + 1], (2, 3), (1, 2)), nn.BatchNorm2d(c[i + 1]), nn.ELU())
            for i in range(len(chans))
        ])
        out_pad = {1: (0, 1)}
        self.dec = nn.ModuleList()
        for i in reversed(range(len(chans))):
            layers = [nn.ConvTranspose2d(2 * c[i + 1], max(c[i], 1), (2, 3), (1, 2), output_padding=out_pad.get(i, (0, 0)))]
            layers += [nn.BatchNorm2d(c[i]), nn.ELU()] if i > 0 else [nn.Softplus()]
            self.dec.append(nn.Sequential(*layers))
        feat = chans[-1] * 4
        self.lstm = nn.LSTM(feat, lstm_hidden, num_layers=2, batch_first=True)
        self.lstm_out = nn.Linear(lstm_hidden, feat)
        self.vad_head = nn.Linear(lstm_hidden, 1)

    def forward(self, wav, return_vad=False):
        spec = torch.stft(wav, self.n_fft, self.hop, window=self.win, return_complex=True)
        mag, phase = spec.abs(), spec.angle()
        x = mag.transpose(1, 2).unsqueeze(1)  # B,1,T,F
        skips = []
        for layer in self.enc:
            x = layer(F.pad(x, (0, 0, 1, 0)))
            skips.append(x)
        B, C, T, Fq = x.shape
        h, _ = self.lstm(x.permute(0, 2, 1, 3).reshape(B, T, C * Fq))
        x = self.lstm_out(h).reshape(B, T, C, Fq).permute(0, 2, 1, 3)
        for layer in self.dec:
            x = layer(torch.cat([x, skips.pop()], dim=1))[:, :, :-1]
        est_mag = mag * x.squeeze(1).transpose(1, 2)
        est = torch.istft(torch.polar(est_mag, phase), self.n_fft, self.hop, window=self.win, length=wav.size(-1))
        vad_logits = self.vad_head(h).squeeze(-1) if return_vad else None
        return est, vad_logits


def si_snr(est, ref, eps=1e-8):
    est, ref = est - est.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    s = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(s.pow(2).sum(-1) / ((est - s).pow(2).sum(-1) + eps) + eps)


def frame_vad_targets(clean, n_fft, hop, thresh_db=-40.0):
    frames = F.pad(clean, (n_fft // 2, n_fft // 2), mode="reflect").unfold(-1, n_fft, hop)
    energy_db = 10 * torch.log10(frames.pow(2).mean(-1) + 1e-10)
    ref = energy_db.max(dim=-1, keepdim=True).values
    return (energy_db > ref + thresh_db).float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conf", default=None)
    conf = dict(DEFAULT_CONF)
    a = ap.parse_args()
    if a.conf:
        conf.update(yaml.safe_load(open(a.conf)))

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train = PairDataset(conf["train_dir"], conf["sr"], conf["segment"])
    valid = PairDataset(conf["valid_dir"], conf["sr"], None)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, batch_size=conf["batch_size"], sampler=sampler, num_workers=conf["num_workers"],
                          pin_memory=True, drop_last=True)
    valid_idx = list(range(rank, len(valid), world))

    net = CRN(conf["n_fft"], conf["hop"])
    net = nn.SyncBatchNorm.convert_sync_batchnorm(net).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=conf["lr"])
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=3)
    use_vad = conf["vad_weight"] > 0
    bce = nn.BCEWithLogitsLoss()

    if rank == 0:
        os.makedirs(conf["exp_dir"], exist_ok=True)
        with open(os.path.join(conf["exp_dir"], "conf.yaml"), "w") as f:
            yaml.safe_dump(conf, f)

    best = -1e9
    for epoch in range(conf["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for noisy, clean in train_dl:
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            est, vad_logits = model(noisy, return_vad=use_vad)
            loss = -si_snr(est, clean).mean()
            if use_vad:
                target = frame_vad_targets(clean, conf["n_fft"], conf["hop"])
                loss = loss + conf["vad_weight"] * bce(vad_logits, target[:, : vad_logits.size(1)])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), conf["grad_clip"])
            opt.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])

        model.eval()
        acc = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for i in valid_idx:
                noisy, clean = valid[i]
                est, _ = model.module(noisy[None].to(device))
                acc[0] += si_snr(est[0], clean.to(device)).double()
                acc[1] += 1
        dist.all_reduce(run)
        dist.all_reduce(acc)
        val = (acc[0] / acc[1]).item()
        sched.step(val)
        if rank == 0:
            print(f"epoch {epoch}: train loss {(run[0] / run[1]).item():.3f}  valid SI-SNR {val:.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch,
                        "conf": conf}, os.path.join(conf["exp_dir"], "last.pt"))
            if val > best:
                best = val
                torch.save(model.module.state_dict(), os.path.join(conf["exp_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
