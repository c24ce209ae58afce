"""DPRNN-TasNet denoiser (one output source).

Training mixtures are made on the fly (speech + noise at a random SNR).
Validation enhances every test utterance at full length on all GPUs; the
enhanced signals are collected on rank 0, written to disk and scored with
PESQ/STOI in a process pool.

    torchrun --nproc_per_node=4 10_dprnn_denoise.py --conf conf/dprnn.yaml
"""
import argparse
import os
import random
from multiprocessing import Pool

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from pesq import pesq
from pystoi import stoi
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SR = 16000


class OnlineMix(Dataset):
    def __init__(self, clean_list, noise_list, seg, snr_range):
        self.clean = [l.strip() for l in open(clean_list) if l.strip()]
        self.noise = [l.strip() for l in open(noise_list) if l.strip()]
        self.seg, self.snr_range = seg, snr_range

    def __len__(self):
        return len(self.clean)

    def _read(self, path):
        n = sf.info(path).frames
        st = random.randint(0, max(n - self.seg, 0))
        x, _ = sf.read(path, start=st, frames=self.seg, dtype="float32", fill_value=0.0)
        return x

    def __getitem__(self, i):
        s, v = self._read(self.clean[i]), self._read(random.choice(self.noise))
        snr = random.uniform(*self.snr_range)
        v = v * np.linalg.norm(s) / (np.linalg.norm(v) + 1e-8) / 10 ** (snr / 20)
        return torch.from_numpy((s + v).astype(np.float32)), torch.from_numpy(s)


class TestSet(Dataset):
    def __init__(self, root):
        self.root = root
        self.names = sorted(os.listdir(os.path.join(root, "noisy")))

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        noisy, _ = sf.read(os.path.join(self.root, "noisy", self.names[i]), dtype="float32")
        return torch.from_numpy(noisy), i


class DPRNNBlock(nn.Module):
    def __init__(self, n, hidden):
        super().__init__()
        self.intra = nn.LSTM(n, hidden, batch_first=True, bidirectional=True)
        self.intra_fc, self.intra_norm = nn.Linear(2 * hidden, n), nn.GroupNorm(1, n)
        self.inter = nn.LSTM(n, hidden, batch_first=True, bidirectional=True)
        self.inter_fc, self.inter_norm = nn.Linear(2 * hidden, n), nn.GroupNorm(1, n)

    def forward(self, x):
        # x: B, N, K (chunk length), S (number of chunks)
        B, N, K, S = x.shape
        h = x.permute(0, 3, 2, 1).reshape(B * S, K, N)
        h = self.intra_fc(self.intra(h)[0]).reshape(B, S, K, N).permute(0, 3, 2, 1)
        x = x + self.intra_norm(h)
        h = x.permute(0, 2, 3, 1).reshape(B * K, S, N)
        h = self.inter_fc(self.inter(h)[0]).reshape(B, K, S, N).permute(0, 3, 1, 2)
        return x + self.inter_norm(h)


class DPRNNTasNet(nn.Module):
    def __init__(self, n_filters=64, kernel=16, bn=64, hidden=128, chunk=100, n_blocks=6):
        super().__init__()
        self.kernel, self.chunk = kernel, chunk
        self.encoder = nn.Conv1d(1, n_filters, kernel, kernel // 2, bias=False)
        self.bottleneck = nn.Sequential(nn.GroupNorm(1, n_filters), nn.Conv1d(n_filters, bn, 1))
        self.blocks = nn.Sequential(*[DPRNNBlock(bn, hidden) for _ in range(n_blocks)])
        self.mask = nn.Sequential(nn.PReLU(), nn.Conv1d(bn, n_filters, 1), nn.ReLU())
        self.decoder = nn.ConvTranspose1d(n_filters, 1, kernel, kernel // 2, bias=False)

    def forward(self, wav):
        T = wav.shape[-1]
        hop = self.kernel // 2
        wav = F.pad(wav, (0, (hop - (T - self.kernel) % hop) % hop))
        w = F.relu(self.encoder(wav.unsqueeze(1)))              # B, N, L
        x = self.bottleneck(w)
        L, K, P = x.shape[-1], self.chunk, self.chunk // 2
        pad = (K - (L + 2 * P - K) % P) % P
        x = F.pad(x, (P, P + pad))
        chunks = x.unfold(-1, K, P)                               # B, N, S, K
        y = self.blocks(chunks.transpose(2, 3).contiguous())      # B, N, K, S
        y = F.fold(y.reshape(y.shape[0], -1, y.shape[-1]), (1, x.shape[-1]), (1, K), stride=(1, P))
        y = y.reshape(y.shape[0], -1, x.shape[-1])[..., P:P + L]
        return self.decoder(w * self.mask(y)).squeeze(1)[..., :T]


def si_snr(est, ref, eps=1e-8):
    est, ref = est - est.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    s = (est * ref).sum(-1, keepdim=True) / (ref.pow(2).sum(-1, keepdim=True) + eps) * ref
    return 10 * torch.log10(s.pow(2).sum(-1) / ((est - s).pow(2).sum(-1) + eps) + eps)


def score_one(args):
    clean_path, est = args
    clean, _ = sf.read(clean_path, dtype="float32")
    return pesq(SR, clean, est, "wb"), stoi(clean, est, SR)


@torch.no_grad()
def validate(net, test_set, loader, out_dir, rank, world, device):
    net.eval()
    collected = {}
    for noisy, idx in loader:
        noisy, idx = noisy.to(device), idx.to(device)
        est = net(noisy)[0]
        est_all = [torch.empty_like(est) for _ in range(world)]
        idx_all = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(est_all, est)
        dist.all_gather(idx_all, idx)
        if rank == 0:
            for e, j in zip(est_all, idx_all):
                collected[int(j)] = e.cpu().numpy()   # padded duplicates overwrite themselves
    net.train()
    if rank != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    jobs = []
    for j, est in sorted(collected.items()):
        name = test_set.names[j]
        sf.write(os.path.join(out_dir, name), est, SR)
        jobs.append((os.path.join(test_set.root, "clean", name), est))
    with Pool(16) as pool:
        scores = pool.map(score_one, jobs)
    return float(np.mean([s[0] for s in scores])), float(np.mean([s[1] for s in scores]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conf", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().conf))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))
    random.seed(cfg.get("seed", 0) + rank)

    train_set = OnlineMix(cfg["clean_list"], cfg["noise_list"], int(cfg["segment"] * SR),
                          (cfg["snr_min"], cfg["snr_max"]))
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg["batch_size"], sampler=train_sampler,
                              num_workers=cfg.get("workers", 8), pin_memory=True, drop_last=True)
    test_set = TestSet(cfg["test_dir"])
    test_loader = DataLoader(test_set, batch_size=1, sampler=DistributedSampler(test_set, shuffle=False),
                             num_workers=2)

    net = DPRNNTasNet(**cfg.get("model", {})).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=5)
    exp = cfg["exp_dir"]
    os.makedirs(exp, exist_ok=True)

    best = -1.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (noisy, clean) in enumerate(train_loader):
            noisy, clean = noisy.to(device, non_blocking=True), clean.to(device, non_blocking=True)
            loss = -si_snr(model(noisy), clean).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} si-snr {-loss.item():.2f} dB", flush=True)

        res = validate(net, test_set, test_loader, os.path.join(exp, "enhanced", f"ep{epoch:03d}"),
                       rank, world, device)
        score = torch.tensor([res[0] if rank == 0 else 0.0], device=device)
        dist.broadcast(score, src=0)
        sched.step(score.item())
        if rank == 0:
            print(f"epoch {epoch} PESQ {res[0]:.3f} STOI {res[1]:.4f}", flush=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(exp, "last.pt"))
            if res[0] > best:
                best = res[0]
                torch.save(net.state_dict(), os.path.join(exp, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
