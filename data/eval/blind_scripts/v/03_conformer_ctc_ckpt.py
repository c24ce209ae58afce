"""Conformer-CTC (L, ~120M) acoustic model for the en-US voice-search ASR stack.

Launch (PyTorchJob `asr-conformer-ctc`, 2 pods x 8 A100, elasticPolicy min=max=2):

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:$MASTER_PORT --max_restarts=3 \
        train_conformer_ctc.py --train-manifest /data/asr/train_v5.jsonl \
        --dev-manifest /data/asr/dev_clean.jsonl --vocab /data/asr/spm_1024.model \
        --exp-dir /mnt/exp/conformer_ctc_l --layerdrop 0.1 --grad-ckpt

Manifests: one JSON per line {"audio": path, "duration": sec, "text": str}.
"""
import argparse
import json
import math
import os
import random

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from torchaudio.models.conformer import ConformerLayer


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--train-manifest", required=True)
    p.add_argument("--dev-manifest", required=True)
    p.add_argument("--vocab", required=True)
    p.add_argument("--exp-dir", required=True)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=17)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layerdrop", type=float, default=0.0)
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-duration", type=float, default=20.0)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--peak-lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=10000)
    p.add_argument("--accum", type=int, default=2)
    return p


class ManifestDataset(Dataset):
    def __init__(self, path, sp, max_duration):
        with open(path) as f:
            rows = [json.loads(l) for l in f]
        self.rows = [r for r in rows if r["duration"] <= max_duration]
        self.sp = sp
        self.fbank = torchaudio.transforms.MelSpectrogram(
            sample_rate=16000, n_fft=400, hop_length=160, n_mels=80)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = torchaudio.load(r["audio"])
        if sr != 16000:
            wav = torchaudio.functional.resample(wav, sr, 16000)
        feats = (self.fbank(wav[0]) + 1e-6).log().transpose(0, 1)  # T, 80
        feats = (feats - feats.mean(0)) / (feats.std(0) + 1e-5)
        ids = torch.tensor(self.sp.encode(r["text"].lower()), dtype=torch.long)
        return feats, ids


def collate(batch):
    feats, ids = zip(*batch)
    flen = torch.tensor([f.size(0) for f in feats])
    tlen = torch.tensor([t.size(0) for t in ids])
    x = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    y = nn.utils.rnn.pad_sequence(ids, batch_first=True)
    return x, flen, y, tlen


class ConvSubsample(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, d, 3, 2), nn.SiLU(), nn.Conv2d(d, d, 3, 2), nn.SiLU())
        self.proj = nn.Linear(d * (((80 - 1) // 2 - 1) // 2), d)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))            # B, d, T', F'
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        return x, lens


class ConformerCTC(nn.Module):
    def __init__(self, vocab, d=512, layers=17, heads=8, layerdrop=0.0, grad_ckpt=False):
        super().__init__()
        self.sub = ConvSubsample(d)
        self.layers = nn.ModuleList([
            ConformerLayer(d, 4 * d, heads, depthwise_conv_kernel_size=31, dropout=0.1)
            for _ in range(layers)])
        self.layerdrop = layerdrop
        self.grad_ckpt = grad_ckpt
        self.head = nn.Linear(d, vocab + 1)  # blank = vocab

    def forward(self, x, lens):
        x, lens = self.sub(x, lens)
        pad_mask = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        x = x.transpose(0, 1)  # T, B, d (torchaudio layout)
        for layer in self.layers:
            if self.training and self.layerdrop > 0 and random.random() < self.layerdrop:
                continue
            if self.grad_ckpt and self.training:
                x = checkpoint(layer, x, pad_mask, use_reentrant=True)
            else:
                x = layer(x, pad_mask)
        return self.head(x.transpose(0, 1)).log_softmax(-1), lens


def noam(step, d, warmup, peak):
    step = max(step, 1)
    return peak * min(step / warmup, math.sqrt(warmup / step))


@torch.no_grad()
def greedy_wer(model, loader, sp, blank, device):
    import jiwer
    model.eval()
    hyps, refs = [], []
    for x, flen, y, tlen in loader:
        logp, olen = model(x.to(device), flen.to(device))
        best = logp.argmax(-1).cpu()
        for b in range(best.size(0)):
            seq = torch.unique_consecutive(best[b, : olen[b]]).tolist()
            hyps.append(sp.decode([t for t in seq if t != blank]))
            refs.append(sp.decode(y[b, : tlen[b]].tolist()))
    model.train()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (hyps, refs))
    all_h = [h for g in gathered for h in g[0]]
    all_r = [r for g in gathered for r in g[1]]
    return jiwer.wer(all_r, all_h)


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(1000 + rank)

    sp = spm.SentencePieceProcessor(model_file=args.vocab)
    vocab = sp.get_piece_size()
    train_ds = ManifestDataset(args.train_manifest, sp, args.max_duration)
    dev_ds = ManifestDataset(args.dev_manifest, sp, 35.0)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                          collate_fn=collate, pin_memory=True, persistent_workers=True)
    dev_dl = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), dist.get_world_size())), batch_size=16,
                        num_workers=4, collate_fn=collate)

    torch.manual_seed(0)
    model = ConformerCTC(vocab, args.d_model, args.layers, args.heads, args.layerdrop, args.grad_ckpt).to(device)
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=args.layerdrop > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    ctc = nn.CTCLoss(blank=vocab, reduction="sum", zero_infinity=True)

    os.makedirs(args.exp_dir, exist_ok=True)
    ckpt_file = os.path.join(args.exp_dir, "last.pt")
    step, start_epoch = 0, 0
    if os.path.isfile(ckpt_file):
        sd = torch.load(ckpt_file, map_location="cpu")
        model.module.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        step, start_epoch = sd["step"], sd["epoch"] + 1

    tb = SummaryWriter(os.path.join(args.exp_dir, "tb")) if rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (x, flen, y, tlen) in enumerate(train_dl):
            x, flen, y, tlen = x.to(device), flen.to(device), y.to(device), tlen.to(device)
            sync = (i + 1) % args.accum == 0
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logp, olen = model(x, flen)
            loss = ctc(logp.float().transpose(0, 1), y, olen, tlen) / x.size(0)
            if sync:
                (loss / args.accum).backward()
                for g in opt.param_groups:
                    g["lr"] = noam(step, args.d_model, args.warmup, args.peak_lr)
                gn = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                if tb is not None and step % 50 == 0:
                    tb.add_scalar("train/ctc_loss", loss.item(), step)
                    tb.add_scalar("train/grad_norm", gn.item(), step)
                    tb.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
            else:
                with model.no_sync():
                    (loss / args.accum).backward()

        wer = greedy_wer(model.module, dev_dl, sp, vocab, device)
        if rank == 0:
            tb.add_scalar("dev/wer", wer, step)
            print(f"epoch {epoch} step {step} dev WER {wer:.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "step": step, "epoch": epoch}, ckpt_file + ".tmp")
            os.replace(ckpt_file + ".tmp", ckpt_file)
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
