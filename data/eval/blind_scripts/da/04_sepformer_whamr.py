"""SepFormer on WHAMR! (noisy + reverberant 2-speaker mixtures, anechoic targets).

torchrun --nnodes=1 --nproc_per_node=8 04_sepformer_whamr.py --config conf/sepformer_whamr.yaml
"""
import argparse
import itertools
import logging
import math
import os
import random

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    root="/data/whamr/wav8k/min", exp_dir="exp/sepformer_whamr", epochs=200, batch_size=1,
    lr=1.5e-4, clip=5.0, segment=4.0, enc_dim=256, kernel=16, chunk=250, nhead=8, ff=1024,
    intra_layers=8, inter_layers=8, repeats=2, num_workers=4, seed=1234,
)


class WhamrDataset(Dataset):
    def __init__(self, root, split, segment=None, sr=8000):
        self.dir = os.path.join(root, split)
        names = sorted(os.listdir(os.path.join(self.dir, "mix_both_reverb")))
        self.seg = int(segment * sr) if segment else None
        if self.seg:
            names = [n for n in names if sf.info(os.path.join(self.dir, "mix_both_reverb", n)).frames >= self.seg]
        self.names = names

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        n = self.names[i]
        total = sf.info(os.path.join(self.dir, "mix_both_reverb", n)).frames
        a = random.randint(0, total - self.seg) if self.seg else 0
        b = a + self.seg if self.seg else None
        read = lambda sub: sf.read(os.path.join(self.dir, sub, n), start=a, stop=b, dtype="float32")[0]
        mix = read("mix_both_reverb")
        srcs = np.stack([read("s1_anechoic"), read("s2_anechoic")])
        return torch.from_numpy(mix), torch.from_numpy(srcs)


class PositionalEncoding(nn.Module):
    def __init__(self, d, max_len=4000):
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(max_len, d)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)]


def transformer(d, nhead, ff, layers):
    layer = nn.TransformerEncoderLayer(d, nhead, ff, dropout=0.0, activation="relu", batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, layers)


class DualPathBlock(nn.Module):
    def __init__(self, d, nhead, ff, intra_layers, inter_layers):
        super().__init__()
        self.pos = PositionalEncoding(d)
        self.intra = transformer(d, nhead, ff, intra_layers)
        self.inter = transformer(d, nhead, ff, inter_layers)
        self.intra_norm = nn.GroupNorm(1, d, eps=1e-8)
        self.inter_norm = nn.GroupNorm(1, d, eps=1e-8)

    def forward(self, x):
        B, N, K, S = x.shape
        y = x.permute(0, 3, 2, 1).reshape(B * S, K, N)
        y = self.intra(self.pos(y)).reshape(B, S, K, N).permute(0, 3, 2, 1)
        x = x + self.intra_norm(y)
        y = x.permute(0, 2, 3, 1).reshape(B * K, S, N)
        y = self.inter(self.pos(y)).reshape(B, K, S, N).permute(0, 3, 1, 2)
        return x + self.inter_norm(y)


class SepFormer(nn.Module):
    def __init__(self, n_src=2, enc_dim=256, kernel=16, chunk=250, nhead=8, ff=1024,
                 intra_layers=8, inter_layers=8, repeats=2, **_):
        super().__init__()
        self.n_src, self.chunk, self.hop = n_src, chunk, chunk // 2
        self.encoder = nn.Conv1d(1, enc_dim, kernel, stride=kernel // 2, bias=False)
        self.norm = nn.GroupNorm(1, enc_dim, eps=1e-8)
        self.in_proj = nn.Conv1d(enc_dim, enc_dim, 1, bias=False)
        self.dual_path = nn.Sequential(*[DualPathBlock(enc_dim, nhead, ff, intra_layers, inter_layers)
                                         for _ in range(repeats)])
        self.prelu = nn.PReLU()
        self.mask_conv = nn.Conv2d(enc_dim, n_src * enc_dim, 1)
        self.gate_tanh = nn.Conv1d(enc_dim, enc_dim, 1)
        self.gate_sig = nn.Conv1d(enc_dim, enc_dim, 1)
        self.end_conv = nn.Conv1d(enc_dim, enc_dim, 1, bias=False)
        self.decoder = nn.ConvTranspose1d(enc_dim, 1, kernel, stride=kernel // 2, bias=False)

    def forward(self, mix):
        T = mix.size(-1)
        w = F.relu(self.encoder(mix.unsqueeze(1)))
        y = self.in_proj(self.norm(w))
        B, N, L = y.shape
        gap = (self.hop - L % self.hop) % self.hop
        Lp = L + gap + 2 * self.hop
        seg = F.pad(y, (self.hop, gap + self.hop)).unfold(-1, self.chunk, self.hop).transpose(2, 3)
        m = self.mask_conv(self.prelu(self.dual_path(seg)))
        m = F.fold(m.reshape(B, -1, m.size(-1)), (1, Lp), (1, self.chunk), stride=(1, self.hop))
        m = m.reshape(B * self.n_src, N, Lp)[..., self.hop:self.hop + L]
        m = torch.tanh(self.gate_tanh(m)) * torch.sigmoid(self.gate_sig(m))
        m = F.relu(self.end_conv(m)).view(B, self.n_src, N, L)
        est = self.decoder((m * w.unsqueeze(1)).flatten(0, 1)).view(B, self.n_src, -1)
        return F.pad(est, (0, max(0, T - est.size(-1))))[..., :T]

    @torch.no_grad()
    def separate(self, mix):
        """Inference helper: scale-normalised forward on a whole utterance."""
        std = mix.std(dim=-1, keepdim=True).clamp_min(1e-6)
        est = self.forward(mix / std) * std.unsqueeze(1)
        return est


def si_snr(est, ref, eps=1e-8):
    est = est - est.mean(-1, keepdim=True)
    ref = ref - ref.mean(-1, keepdim=True)
    s = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps) * ref
    return 10 * torch.log10(s.pow(2).sum(-1) / ((est - s).pow(2).sum(-1) + eps) + eps)


def pit_si_snr(est, ref):
    pair = si_snr(est.unsqueeze(2), ref.unsqueeze(1))
    idx = torch.arange(est.size(1), device=est.device)
    perms = itertools.permutations(range(est.size(1)))
    return torch.stack([pair[:, idx, list(p)].mean(-1) for p in perms], dim=1).max(dim=1).values


def validate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=device)
    for mix, srcs in loader:
        mix, srcs = mix.to(device), srcs.to(device)
        est = model.separate(mix)
        sisnr = pit_si_snr(est, srcs)
        base = pit_si_snr(mix.unsqueeze(1).expand_as(srcs), srcs)
        acc += torch.stack([sisnr.sum(), (sisnr - base).sum(), torch.tensor(float(mix.size(0)), device=device)]).double()
    dist.all_reduce(acc)
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cfg = dict(DEFAULTS)
    cli = ap.parse_args()
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    log = logging.getLogger("sepformer")

    random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    tr = WhamrDataset(cfg["root"], "tr", segment=cfg["segment"])
    cv = WhamrDataset(cfg["root"], "cv")
    tr_sampler = DistributedSampler(tr, shuffle=True, seed=cfg["seed"], drop_last=True)
    tr_loader = DataLoader(tr, batch_size=cfg["batch_size"], sampler=tr_sampler, num_workers=cfg["num_workers"],
                           pin_memory=True, drop_last=True)
    cv_loader = DataLoader(Subset(cv, list(range(rank, len(cv), world))), batch_size=1, num_workers=2)

    model = SepFormer(**cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=2)

    os.makedirs(cfg["exp_dir"], exist_ok=True)
    ck_path = os.path.join(cfg["exp_dir"], "ckpt.pt")
    epoch0, best = 0, -1e9
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        epoch0, best = ck["epoch"] + 1, ck["best"]

    for epoch in range(epoch0, cfg["epochs"]):
        tr_sampler.set_epoch(epoch)
        model.train()
        loss_sum = torch.zeros((), device=device)
        for i, (mix, srcs) in enumerate(tr_loader):
            mix, srcs = mix.to(device, non_blocking=True), srcs.to(device, non_blocking=True)
            loss = -pit_si_snr(model(mix), srcs).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
            opt.step()
            loss_sum += loss.detach()
            if rank == 0 and i % 500 == 0:
                log.info("ep %d it %d/%d loss %.2f", epoch, i, len(tr_loader), loss.item())
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)

        cv_sisnr, cv_sisnri = validate(model, cv_loader, device)
        sched.step(cv_sisnri)
        log.info("epoch %d train %.2f | cv SI-SNR %.2f SI-SNRi %.2f | lr %.2e", epoch,
                 loss_sum.item() / len(tr_loader), cv_sisnr, cv_sisnri, opt.param_groups[0]["lr"])
        if rank == 0:
            best = max(best, cv_sisnri)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "best": best}, ck_path)
            if best == cv_sisnri:
                torch.save(model.module.state_dict(), os.path.join(cfg["exp_dir"], "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
