"""QuartzNet 5x5 (char CTC) on LibriSpeech train-clean-100, NeMo-style manifests, plain DDP.

torchrun --nproc_per_node=4 19_quartznet5x5_ls100.py --train_manifest manifests/train_clean_100.json \
    --val_manifest manifests/dev_clean.json --save_dir exp/qn5x5
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import jiwer

LABELS = [" ", "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o", "p", "q", "r",
          "s", "t", "u", "v", "w", "x", "y", "z", "'"]
BLANK = len(LABELS)


class NemoManifest(Dataset):
    def __init__(self, path, max_duration=16.7, min_duration=0.1):
        self.samples = []
        with open(path) as f:
            for line in f:
                s = json.loads(line)
                if min_duration <= s["duration"] <= max_duration:
                    self.samples.append(s)
        self.lab2id = {c: i for i, c in enumerate(LABELS)}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        s = self.samples[i]
        wav, _ = torchaudio.load(s["audio_filepath"])
        tgt = [self.lab2id[c] for c in s["text"].lower() if c in self.lab2id]
        return wav[0], torch.tensor(tgt, dtype=torch.long)


def collate(batch):
    wavs, tgts = zip(*batch)
    return (nn.utils.rnn.pad_sequence(wavs, batch_first=True), torch.tensor([w.numel() for w in wavs]),
            nn.utils.rnn.pad_sequence(tgts, batch_first=True), torch.tensor([t.numel() for t in tgts]))


class Preprocessor(nn.Module):
    """log-mel + per-feature normalization + SpecAugment, done on GPU inside the model."""

    def __init__(self, n_mels=64):
        super().__init__()
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=512, win_length=320, hop_length=160,
                                                        n_mels=n_mels)
        self.specaug = nn.Sequential(torchaudio.transforms.FrequencyMasking(15),
                                     torchaudio.transforms.FrequencyMasking(15),
                                     torchaudio.transforms.TimeMasking(25), torchaudio.transforms.TimeMasking(25))

    def forward(self, wav, wav_len):
        with torch.no_grad():
            x = torch.log(self.mel(wav) + 2 ** -24)
            lens = wav_len // 160 + 1
            mask = torch.arange(x.size(-1), device=x.device)[None] < lens[:, None]
            m = (x * mask[:, None]).sum(-1) / lens[:, None]
            v = ((x - m[..., None]) ** 2 * mask[:, None]).sum(-1) / (lens[:, None] - 1).clamp(min=1)
            x = (x - m[..., None]) / (v.sqrt()[..., None] + 1e-5)
            x = x.masked_fill(~mask[:, None], 0.0)
            if self.training:
                x = self.specaug(x)
        return x, lens


class SepConvBlock(nn.Module):
    def __init__(self, cin, cout, k, repeat, dropout=0.0, dilation=1, stride=1, residual=True):
        super().__init__()
        layers = []
        for r in range(repeat):
            c_in = cin if r == 0 else cout
            layers += [nn.Conv1d(c_in, c_in, k, stride=stride if r == 0 else 1, dilation=dilation,
                                 padding=dilation * (k // 2), groups=c_in, bias=False),
                       nn.Conv1d(c_in, cout, 1, bias=False), nn.BatchNorm1d(cout)]
            if r < repeat - 1:
                layers += [nn.ReLU(), nn.Dropout(dropout)]
        self.body = nn.Sequential(*layers)
        self.res = nn.Sequential(nn.Conv1d(cin, cout, 1, bias=False), nn.BatchNorm1d(cout)) if residual else None
        self.out = nn.Sequential(nn.ReLU(), nn.Dropout(dropout))

    def forward(self, x):
        y = self.body(x)
        if self.res is not None:
            y = y + self.res(x)
        return self.out(y)


class QuartzNet(nn.Module):
    def __init__(self, n_mels=64, n_class=BLANK + 1):
        super().__init__()
        self.pre = Preprocessor(n_mels)
        self.encoder = nn.Sequential(
            SepConvBlock(n_mels, 256, 33, 1, stride=2, residual=False),
            SepConvBlock(256, 256, 33, 5), SepConvBlock(256, 256, 39, 5),
            SepConvBlock(256, 512, 51, 5), SepConvBlock(512, 512, 63, 5), SepConvBlock(512, 512, 75, 5),
            SepConvBlock(512, 512, 87, 1, dilation=2, residual=False),
            SepConvBlock(512, 1024, 1, 1, residual=False),
        )
        self.decoder = nn.Conv1d(1024, n_class, 1)

    def forward(self, wav, wav_len):
        x, lens = self.pre(wav, wav_len)
        x = self.encoder(x)
        return self.decoder(x).transpose(1, 2).log_softmax(-1), (lens + 1) // 2


def ctc_greedy(log_probs, lens):
    out = []
    for seq, n in zip(log_probs.argmax(-1).cpu(), lens.cpu()):
        seq = torch.unique_consecutive(seq[:n])
        out.append("".join(LABELS[t] for t in seq.tolist() if t != BLANK).strip())
    return out


def poly_lr(step, total, peak, warmup, min_lr=1e-5, power=2.0):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return max(min_lr, peak * (1 - frac) ** power)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_manifest", required=True)
    ap.add_argument("--val_manifest", required=True)
    ap.add_argument("--save_dir", default="exp/qn5x5")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--warmup_steps", type=int, default=1000)
    ap.add_argument("--weight_decay", type=float, default=1e-3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    train_ds = NemoManifest(args.train_manifest)
    val_ds = NemoManifest(args.val_manifest, max_duration=1e9)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, drop_last=True)
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world)),
                        batch_size=args.batch_size, collate_fn=collate, num_workers=4)

    model = QuartzNet()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    total_steps = args.epochs * len(train_dl)
    ctc = nn.CTCLoss(blank=BLANK, zero_infinity=True)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best_wer, step = 1.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for wav, wav_len, tgt, tgt_len in train_dl:
            lr = poly_lr(step, total_steps, args.lr, args.warmup_steps)
            for g in opt.param_groups:
                g["lr"] = lr
            wav, wav_len = wav.to(device, non_blocking=True), wav_len.to(device)
            lp, lens = model(wav, wav_len)
            loss = ctc(lp.float().transpose(0, 1), tgt.to(device), lens, tgt_len.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.3f} lr {lr:.2e}", flush=True)

        model.eval()
        errs = torch.zeros(2, device=device, dtype=torch.float64)
        with torch.no_grad():
            for wav, wav_len, tgt, tgt_len in val_dl:
                lp, lens = model.module(wav.to(device), wav_len.to(device))
                for hyp, t, n in zip(ctc_greedy(lp, lens), tgt, tgt_len):
                    ref = "".join(LABELS[i] for i in t[:n].tolist()).strip()
                    m = jiwer.process_words(ref, hyp)
                    errs[0] += m.substitutions + m.deletions + m.insertions
                    errs[1] += len(ref.split())
        dist.all_reduce(errs)
        wer = (errs[0] / errs[1]).item()
        if rank == 0:
            print(f"epoch {epoch} dev-clean WER {wer * 100:.2f}% ({time.time() - t0:.0f}s)", flush=True)
            ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "step": step}
            torch.save(ckpt, os.path.join(args.save_dir, "last.pt"))
            if wer < best_wer:
                best_wer = wer
                torch.save(ckpt, os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
