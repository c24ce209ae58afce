"""AVSR on LRS3 + VoxCeleb2-en (Whisper pseudo-labels) with a deep encoder:
LayerDrop and activation checkpointing keep 24 layers trainable on 80 GB cards.

The utterance index (paths, frame counts, tokenised transcripts) is built once
from the raw manifests and cached as JSON next to them.

    torchrun --nnodes=1 --nproc_per_node=8 19_avsr_vox2_layerdrop_ckpt.py \
        --manifests /data/avsr/lrs3_train.tsv /data/avsr/vox2_en_pl.tsv --valid /data/avsr/lrs3_valid.tsv
"""
import argparse
import json
import math
import os
import random
import time

import editdistance
import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--manifests", nargs="+", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--spm", default="/data/avsr/spm1000.model")
    p.add_argument("--out", default="exp/avsr_l24")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--layerdrop", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=20000)
    p.add_argument("--max-steps", type=int, default=300000)
    p.add_argument("--max-frames", type=int, default=500)
    p.add_argument("--wandb-project", default="avsr")
    return p.parse_args()


def build_index(manifest, sp, max_frames):
    rows = []
    with open(manifest) as f:
        for line in f:
            vid, wav, n, text = line.rstrip("\n").split("\t")
            if int(n) <= max_frames and text.strip():
                rows.append({"video": vid, "audio": wav, "n": int(n), "tokens": sp.encode(text.lower())})
    return rows


def cached_index(manifest, sp, max_frames, rank):
    cache = manifest + f".idx{max_frames}.json"
    if rank == 0 and not os.path.exists(cache):
        rows = build_index(manifest, sp, max_frames)
        with open(cache + ".tmp", "w") as f:
            json.dump(rows, f)
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    with open(cache) as f:
        return json.load(f)


class AVUtts(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        v = torch.from_numpy(np.load(r["video"])).float().div(255.0).sub(0.421).div(0.165)
        a, _ = torchaudio.load(r["audio"])
        a = a[0, : 640 * v.size(0)]
        a = F.pad(a, (0, 640 * v.size(0) - a.numel()))
        return v, (a - a.mean()) / (a.std() + 1e-5), torch.tensor(r["tokens"]) + 1


def collate(b):
    v, a, y = zip(*b)
    return (pad_sequence(v, True), pad_sequence(a, True), torch.tensor([x.size(0) for x in v]),
            torch.cat(y), torch.tensor([x.numel() for x in y]))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.conv = nn.Conv1d(d, d, 15, padding=7, groups=d)
        self.ln3 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * d, d))

    def forward(self, x, pad):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0]
        h = self.ln2(x).masked_fill(pad.unsqueeze(-1), 0.0)
        x = x + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return x + self.ff(self.ln3(x))


class DeepAVSR(nn.Module):
    def __init__(self, vocab, layers, layerdrop, d=512, heads=8):
        super().__init__()
        self.vocab = vocab
        self.video = nn.Sequential(
            nn.Conv3d(1, 32, (5, 7, 7), (1, 2, 2), (2, 3, 3)), nn.GroupNorm(8, 32), nn.GELU(),
            nn.Conv3d(32, 64, (3, 3, 3), (1, 2, 2), (1, 1, 1)), nn.GroupNorm(8, 64), nn.GELU(),
            nn.Conv3d(64, 128, (3, 3, 3), (1, 2, 2), (1, 1, 1)), nn.GroupNorm(8, 128), nn.GELU(),
            nn.AdaptiveAvgPool3d((None, 1, 1)))
        self.v_proj = nn.Linear(128, d)
        self.audio = nn.Conv1d(1, d, 640, stride=640)
        self.a_norm = nn.LayerNorm(d)
        self.fuse = nn.Linear(2 * d, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.layerdrop = layerdrop
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, v, a, lens):
        t = v.size(1)
        hv = self.v_proj(self.video(v.unsqueeze(1)).flatten(2).transpose(1, 2))
        ha = self.a_norm(self.audio(a.unsqueeze(1)).transpose(1, 2))[:, :t]
        x = self.fuse(torch.cat([hv, ha], -1))
        pad = torch.arange(t, device=v.device)[None] >= lens[:, None]
        for blk in self.blocks:
            if self.training and random.random() < self.layerdrop:
                continue
            if self.training:
                x = checkpoint(blk, x, pad, use_reentrant=False)
            else:
                x = blk(x, pad)
        return self.head(self.ln(x)).log_softmax(-1)


@torch.no_grad()
def valid_wer(net, loader, sp, device):
    net.eval()
    e = n = 0
    for v, a, lens, y, ylens in loader:
        pred = net(v.to(device), a.to(device), lens.to(device)).argmax(-1).cpu()
        refs = torch.split(y, ylens.tolist())
        for i in range(pred.size(0)):
            hyp = [t - 1 for t in torch.unique_consecutive(pred[i, : lens[i]]).tolist() if t > 0]
            ref = sp.decode((refs[i] - 1).tolist()).split()
            e += editdistance.eval(sp.decode(hyp).split(), ref)
            n += len(ref)
    net.train()
    return e / max(n, 1)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)  # layerdrop pattern may differ per rank
    torch.manual_seed(1000)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    rows = []
    for m in args.manifests:
        rows += cached_index(m, sp, args.max_frames, rank)
    valid_rows = cached_index(args.valid, sp, 10 ** 6, rank)
    train_set, valid_set = AVUtts(rows), AVUtts(valid_rows)
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True, seed=1000)
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, num_workers=8, collate_fn=collate,
                        pin_memory=True, drop_last=True, persistent_workers=True)
    valid_loader = DataLoader(valid_set, 8, num_workers=4, collate_fn=collate)

    net = DeepAVSR(sp.get_piece_size() + 1, args.layers, args.layerdrop).to(device)
    # layers skipped by LayerDrop get no gradient in that step
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.max_steps))))

    ckpt_path = os.path.join(args.out, "last.pt")
    step, epoch, best = 0, 0, float("inf")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step, epoch, best = ck["step"], ck["epoch"], ck["best"]

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project=args.wandb_project, name=os.path.basename(args.out), config=vars(args), resume="allow")

    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for v, a, lens, y, ylens in loader:
            v, a, lens = v.to(device, non_blocking=True), a.to(device, non_blocking=True), lens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp = model(v, a, lens)
            loss = F.ctc_loss(logp.float().transpose(0, 1), y.to(device), lens, ylens.to(device), zero_infinity=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = nn.utils.clip_grad_norm_(model.parameters(), 2.0)
            opt.step()
            sched.step()
            step += 1
            if rank == 0 and step % 100 == 0:
                wandb.log({"loss": loss.item(), "grad_norm": gn.item(), "lr": sched.get_last_lr()[0],
                           "sec_per_step": (time.time() - t0) / 100}, step=step)
                t0 = time.time()
            if step % 5000 == 0 or step == args.max_steps:
                if rank == 0:
                    wer = valid_wer(net, valid_loader, sp, device)
                    best = min(best, wer)
                    wandb.log({"valid/wer": wer}, step=step)
                    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                "step": step, "epoch": epoch, "best": best}, ckpt_path)
                    if wer == best:
                        torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
