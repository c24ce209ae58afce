"""HuBERT iteration 1 with targets computed on the fly: MFCC (+delta, +delta-delta)
features are extracted on the GPU and assigned to the nearest of the K centroids
learned offline (learn_kmeans.py on a 10% subset), so no label files are needed.

    torchrun --nproc_per_node 8 19_hubert_it1_mfcc_online.py --data /data/ls960 \
        --centroids /data/ls960/mfcc_km100/centroids.npy --out /exp/hubert_it1_online
"""
import argparse
import logging
import os
import random
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

logger = logging.getLogger("hubert_it1")
CNN = [(512, 10, 5)] + [(512, 3, 2)] * 4 + [(512, 2, 2)] * 2


def cnn_frames(n):
    for _, k, s in CNN:
        n = (n - k) // s + 1
    return n


class MfccKmeansLabeler:
    """Frame labels at 50 Hz from MFCC features and fixed k-means centroids."""

    def __init__(self, centroids_path, device="cuda:0", sample_rate=16000):
        self.device = torch.device(device)
        C = torch.from_numpy(np.load(centroids_path)).float()
        self.C = C.to(self.device)
        self.C_sq = (self.C ** 2).sum(1)
        self.mfcc = torchaudio.transforms.MFCC(
            sample_rate=sample_rate, n_mfcc=13,
            melkwargs={"n_fft": 400, "win_length": 400, "hop_length": 160, "n_mels": 23, "center": False},
        ).to(self.device)

    @torch.no_grad()
    def __call__(self, wav):
        x = wav.to(self.device)
        m = self.mfcc(x)                                   # B x 13 x T (100 Hz)
        d1 = torchaudio.functional.compute_deltas(m)
        d2 = torchaudio.functional.compute_deltas(d1)
        f = torch.cat([m, d1, d2], 1).transpose(1, 2)[:, ::2]  # B x T/2 x 39 (50 Hz)
        f = (f - f.mean(1, keepdim=True)) / (f.std(1, keepdim=True) + 1e-5)
        dist2 = (f ** 2).sum(-1, keepdim=True) - 2 * f @ self.C.T + self.C_sq
        return dist2.argmin(-1).to(wav.device)


class HuBERT(nn.Module):
    def __init__(self, k, d=768, depth=12, heads=12, ffn=3072, proj_dim=256):
        super().__init__()
        convs, c_in = [], 1
        for i, (c, kk, s) in enumerate(CNN):
            convs.append(nn.Conv1d(c_in, c, kk, s, bias=False))
            if i == 0:
                convs.append(nn.GroupNorm(c, c))
            convs.append(nn.GELU())
            c_in = c
        self.feature_extractor = nn.Sequential(*convs)
        self.layer_norm = nn.LayerNorm(512)
        self.post_extract_proj = nn.Linear(512, d)
        self.mask_emb = nn.Parameter(torch.empty(d).uniform_())
        self.pos_conv = nn.Conv1d(d, d, 128, padding=64, groups=16)
        self.enc_norm = nn.LayerNorm(d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ffn, 0.1, "gelu", batch_first=True),
                                             depth, enable_nested_tensor=False)
        self.final_proj = nn.Linear(d, proj_dim)
        self.label_embs = nn.Parameter(torch.empty(k, proj_dim).uniform_())

    def forward(self, wav, mask):
        f = self.layer_norm(self.feature_extractor(wav.unsqueeze(1)).transpose(1, 2))
        x = torch.where(mask.unsqueeze(-1), self.mask_emb.to(f.dtype), self.post_extract_proj(f))
        x = self.enc_norm(x + F.gelu(self.pos_conv(x.transpose(1, 2))[..., :-1]).transpose(1, 2))
        y = self.final_proj(self.encoder(x)).float()
        logits = F.cosine_similarity(y.unsqueeze(2), self.label_embs.float()[None, None], dim=-1) / 0.1
        return logits, f.float().pow(2).mean()


class Wavs(Dataset):
    def __init__(self, tsv, crop):
        with open(tsv) as f:
            root = f.readline().strip()
            self.files = [os.path.join(root, l.split("\t")[0]) for l in f.read().splitlines()]
        self.crop = crop

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        w, _ = sf.read(self.files[i], dtype="float32")
        if len(w) > self.crop:
            s = random.randint(0, (len(w) - self.crop) // 320) * 320
            w = w[s:s + self.crop]
        return torch.from_numpy(w)


def collate(ws):
    n = min(len(w) for w in ws)
    return torch.stack([w[:n] for w in ws])


def make_mask(B, T, p=0.8, span=10):
    m = torch.zeros(B, T, dtype=torch.bool)
    k = int(p * T / span + random.random())
    for b in range(B):
        for s in random.sample(range(T - span), k):
            m[b, s:s + span] = True
    return m


def step_outputs(model, labeler, wav, dev):
    targets = labeler(wav)
    mask = make_mask(wav.size(0), cnn_frames(wav.size(1))).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, pen = model(wav, mask)
    T = min(logits.size(1), targets.size(1))
    m = mask[:, :T]
    return logits[:, :T][m], targets[:, :T][m], pen


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--centroids", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--crop", type=int, default=250000)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=32000)
    ap.add_argument("--max-update", type=int, default=250000)
    ap.add_argument("--log-interval", type=int, default=200)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")

    labeler = MfccKmeansLabeler(args.centroids)
    k = labeler.C.size(0)
    train = Wavs(os.path.join(args.data, "train.tsv"), args.crop)
    valid = Wavs(os.path.join(args.data, "valid.tsv"), args.crop)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    loader = DataLoader(train, args.batch_size, sampler=sampler, collate_fn=collate, num_workers=8,
                        pin_memory=True, drop_last=True)
    vloader = DataLoader(torch.utils.data.Subset(valid, range(rank, len(valid), world)), args.batch_size,
                         collate_fn=collate, num_workers=2)

    model = DDP(HuBERT(k).to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / args.warmup if s < args.warmup else max(0.0, (args.max_update - s) / (args.max_update - args.warmup)))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, epoch = 0, 0
    while step < args.max_update:
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav in loader:
            wav = wav.to(dev, non_blocking=True)
            logits, tgt, pen = step_outputs(model, labeler, wav, dev)
            loss = F.cross_entropy(logits, tgt) + 10 * pen
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1
            if step % args.log_interval == 0:
                s = torch.stack([loss.detach().float(), (logits.argmax(-1) == tgt).float().mean()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                logger.info("step %d loss %.4f acc_m %.4f lr %.2e %.2fs/it", step, s[0], s[1],
                            sched.get_last_lr()[0], (time.time() - t0) / args.log_interval)
                t0 = time.time()
            if step >= args.max_update:
                break
        epoch += 1

        model.eval()
        acc = torch.zeros(2, device=dev)
        with torch.no_grad():
            for wav in vloader:
                logits, tgt, _ = step_outputs(model.module, labeler, wav.to(dev), dev)
                acc += torch.stack([(logits.argmax(-1) == tgt).sum().float(), torch.tensor(float(tgt.numel()), device=dev)])
        dist.all_reduce(acc)
        logger.info("epoch %d valid acc_m %.4f", epoch, (acc[0] / acc[1]).item())
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step, "epoch": epoch,
                        "num_classes": k}, os.path.join(args.out, "checkpoint_last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
