"""Conformer-CTC (character units) trained from scratch on log-mel features.

    torchrun --nproc_per_node=8 03_conformer_ctc_char.py --config conf/conformer_m_char.yaml

The config yaml holds data paths, model size and optimisation settings (see DEFAULTS).
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

DEFAULTS = dict(
    train_manifest="data/train.jsonl",
    dev_manifest="data/dev.jsonl",
    exp_dir="exp/conformer_m_char",
    n_mels=80,
    d_model=256,
    n_heads=4,
    ffn_dim=1024,
    n_layers=16,
    conv_kernel=31,
    dropout=0.1,
    batch_size=24,
    peak_lr=2e-3,
    warmup_steps=10000,
    epochs=60,
    max_duration=20.0,
    num_workers=6,
    seed=7,
)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    with open(a.config) as f:
        cfg.update(yaml.safe_load(f) or {})
    cfg["resume"] = a.resume
    return argparse.Namespace(**cfg)


def read_jsonl(path, max_duration=None):
    with open(path) as f:
        rows = [json.loads(l) for l in f]
    if max_duration:
        rows = [r for r in rows if r["duration"] <= max_duration]
    return rows


class CharVocab:
    def __init__(self, symbols):
        self.itos = symbols
        self.stoi = {s: i for i, s in enumerate(symbols)}
        self.unk = self.stoi["<unk>"]

    @classmethod
    def build(cls, texts):
        chars = set()
        for t in texts:
            chars.update(t.lower())
        return cls(["<blank>", "<unk>"] + list(chars))

    def encode(self, text):
        return [self.stoi.get(c, self.unk) for c in text.lower()]

    def decode(self, ids):
        return "".join(self.itos[i] for i in ids)

    def __len__(self):
        return len(self.itos)


class FbankDataset(Dataset):
    def __init__(self, rows, vocab, n_mels, train):
        self.rows = rows
        self.vocab = vocab
        self.train = train
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=n_mels)
        self.specaug = nn.Sequential(
            torchaudio.transforms.FrequencyMasking(27),
            torchaudio.transforms.FrequencyMasking(27),
            torchaudio.transforms.TimeMasking(40, p=0.05),
            torchaudio.transforms.TimeMasking(40, p=0.05),
        )

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, sr = torchaudio.load(r["audio_filepath"])
        feats = (self.mel(wav[0]) + 1e-6).log()  # (n_mels, T)
        feats = (feats - feats.mean(dim=1, keepdim=True)) / (feats.std(dim=1, keepdim=True) + 1e-5)
        if self.train:
            feats = self.specaug(feats)
        return feats.t(), torch.tensor(self.vocab.encode(r["text"]), dtype=torch.long), r["text"]


def collate(batch):
    feats = [b[0] for b in batch]
    targets = [b[1] for b in batch]
    feat_lens = torch.tensor([f.size(0) for f in feats])
    tgt_lens = torch.tensor([t.size(0) for t in targets])
    feats = nn.utils.rnn.pad_sequence(feats, batch_first=True)
    targets = nn.utils.rnn.pad_sequence(targets, batch_first=True)
    return feats, feat_lens, targets, tgt_lens, [b[2] for b in batch]


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim, odim):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, odim, 3, 2), nn.ReLU(), nn.Conv2d(odim, odim, 3, 2), nn.ReLU())
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x, lens):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        lens = ((lens - 1) // 2 - 1) // 2
        return x, lens


class ConformerCTC(nn.Module):
    def __init__(self, cfg, vocab_size):
        super().__init__()
        self.subsample = Conv2dSubsampling(cfg.n_mels, cfg.d_model)
        self.encoder = torchaudio.models.Conformer(
            input_dim=cfg.d_model, num_heads=cfg.n_heads, ffn_dim=cfg.ffn_dim, num_layers=cfg.n_layers,
            depthwise_conv_kernel_size=cfg.conv_kernel, dropout=cfg.dropout,
        )
        self.head = nn.Linear(cfg.d_model, vocab_size)

    def forward(self, feats, lens):
        x, lens = self.subsample(feats, lens)
        x, lens = self.encoder(x, lens)
        return self.head(x).log_softmax(-1), lens


def greedy_decode(log_probs, lens, vocab):
    out = []
    for lp, n in zip(log_probs.argmax(-1), lens):
        ids = torch.unique_consecutive(lp[:n]).tolist()
        out.append(vocab.decode([i for i in ids if i != 0]))
    return out


def edit_distance(a, b):
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            cur = d[j]
            d[j] = min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev = cur
    return d[len(b)]


def noam(step, d_model, warmup, peak):
    step = max(step, 1)
    return peak * min(step / warmup, math.sqrt(warmup / step))


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)

    train_rows = read_jsonl(cfg.train_manifest, cfg.max_duration)
    dev_rows = read_jsonl(cfg.dev_manifest)
    vocab = CharVocab.build(r["text"] for r in train_rows)
    if rank == 0:
        os.makedirs(cfg.exp_dir, exist_ok=True)
        with open(os.path.join(cfg.exp_dir, "units.txt"), "w") as f:
            f.write("\n".join(vocab.itos))
        print(f"vocab size {len(vocab)}, train {len(train_rows)} utts, world {world}", flush=True)

    train_ds = FbankDataset(train_rows, vocab, cfg.n_mels, train=True)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=cfg.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=cfg.num_workers, pin_memory=True, drop_last=True)
    dev_rows = sorted(dev_rows, key=lambda r: r["duration"])[rank::world]
    dev_dl = DataLoader(FbankDataset(dev_rows, vocab, cfg.n_mels, train=False), batch_size=32,
                        collate_fn=collate, num_workers=2)

    model = ConformerCTC(cfg, len(vocab))
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.peak_lr, betas=(0.9, 0.98), weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: noam(s, cfg.d_model, cfg.warmup_steps, 1.0))
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    start_epoch = 0
    if cfg.resume:
        ck = torch.load(cfg.resume, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1

    for epoch in range(start_epoch, cfg.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, tot, cnt = time.time(), 0.0, 0
        for it, (x, xl, y, yl, _) in enumerate(train_dl):
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lp, ol = model(x, xl)
            loss = ctc(lp.float().transpose(0, 1), y, ol, yl)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            tot += loss.item()
            cnt += 1
            if rank == 0 and it % 200 == 0:
                print(f"[ep {epoch} it {it}] loss {tot / cnt:.3f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)

        model.eval()
        stats = torch.zeros(2, device=device)
        with torch.no_grad():
            for x, xl, _, _, refs in dev_dl:
                lp, ol = model.module(x.to(device), xl.to(device))
                for ref, hyp in zip(refs, greedy_decode(lp, ol, vocab)):
                    stats[0] += edit_distance(ref.lower().split(), hyp.split())
                    stats[1] += len(ref.split())
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch} dev WER {100 * stats[0].item() / stats[1].item():.2f}", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "epoch": epoch},
                       os.path.join(cfg.exp_dir, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
