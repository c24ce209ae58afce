"""Small Whisper-style encoder-decoder ASR trained from scratch on log-mel input.

Conv front-end (2x stride) -> Transformer encoder; Transformer decoder over a
SentencePiece vocabulary; label-smoothed CE; greedy decoding for dev WER.

    torchrun --nproc_per_node=8 13_tiny_seq2seq_asr_scratch.py --data_dir data/tedlium3
"""
import argparse
import math
import os
import random
import time

import jiwer
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

N_MELS, HOP = 80, 160


def sinusoid(length, dim):
    pos = torch.arange(length).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2) * (-math.log(10000.0) / dim))
    pe = torch.zeros(length, dim)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class Seq2SeqASR(nn.Module):
    def __init__(self, vocab, d=384, heads=6, enc_layers=8, dec_layers=4, max_frames=3000, max_tokens=256):
        super().__init__()
        self.conv1 = nn.Conv1d(N_MELS, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.register_buffer("enc_pos", sinusoid(max_frames // 2 + 1, d), persistent=False)
        enc = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc, enc_layers)
        self.tok_emb = nn.Embedding(vocab, d)
        self.dec_pos = nn.Parameter(torch.randn(max_tokens, d) * 0.01)
        dec = nn.TransformerDecoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(dec, dec_layers)
        self.ln = nn.LayerNorm(d)

    def encode(self, mel, mel_lens):
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        x = x + self.enc_pos[: x.size(1)]
        lens = (mel_lens + 1) // 2
        pad = torch.arange(x.size(1), device=x.device)[None] >= lens[:, None]
        return self.encoder(x, src_key_padding_mask=pad), pad

    def decode(self, tokens, memory, mem_pad):
        T = tokens.size(1)
        y = self.tok_emb(tokens) + self.dec_pos[:T]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=tokens.device), 1)
        y = self.decoder(y, memory, tgt_mask=causal, memory_key_padding_mask=mem_pad)
        return self.ln(y) @ self.tok_emb.weight.t()

    def forward(self, mel, mel_lens, tokens_in):
        memory, pad = self.encode(mel, mel_lens)
        return self.decode(tokens_in, memory, pad)


class UttDataset(Dataset):
    def __init__(self, list_path, sp, train):
        self.items = [l.rstrip("\n").split("\t") for l in open(list_path)]
        self.sp, self.train = sp, train
        self.mel = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=HOP, n_mels=N_MELS)
        self.fmask = torchaudio.transforms.FrequencyMasking(27)
        self.tmask = torchaudio.transforms.TimeMasking(70, p=0.2)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, text = self.items[i]
        wav, sr = torchaudio.load(path)
        if sr != 16000:
            wav = torchaudio.functional.resample(wav, sr, 16000)
        if self.train:
            wav = wav * random.uniform(0.5, 1.5)
        mel = torch.clamp(self.mel(wav[0]), min=1e-10).log10()
        mel = (torch.maximum(mel, mel.max() - 8.0) + 4.0) / 4.0
        if self.train:
            mel = self.tmask(self.fmask(self.fmask(mel)))
        ids = [self.sp.bos_id()] + self.sp.encode(text.lower())[:250] + [self.sp.eos_id()]
        return mel, torch.tensor(ids), text


def collate(batch):
    mels, ids, texts = zip(*batch)
    T = max(m.size(1) for m in mels)
    x = torch.zeros(len(mels), N_MELS, T)
    for i, m in enumerate(mels):
        x[i, :, : m.size(1)] = m
    lens = torch.tensor([m.size(1) for m in mels])
    y = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=-1)
    return x, lens, y, list(texts)


@torch.no_grad()
def greedy(model, mel, lens, bos, eos, max_len=200):
    memory, pad = model.encode(mel, lens)
    ys = torch.full((mel.size(0), 1), bos, dtype=torch.long, device=mel.device)
    done = torch.zeros(mel.size(0), dtype=torch.bool, device=mel.device)
    for _ in range(max_len):
        nxt = model.decode(ys, memory, pad)[:, -1].argmax(-1)
        nxt = nxt.masked_fill(done, eos)
        ys = torch.cat([ys, nxt[:, None]], 1)
        done |= nxt.eq(eos)
        if done.all():
            break
    return ys[:, 1:]


def dev_wer(model, loader, sp, device):
    model.eval()
    hyps, refs = [], []
    for mel, lens, _, texts in loader:
        out = greedy(model, mel.to(device), lens.to(device), sp.bos_id(), sp.eos_id())
        for seq in out.tolist():
            seq = seq[: seq.index(sp.eos_id())] if sp.eos_id() in seq else seq
            hyps.append(sp.decode(seq))
        refs += [t.lower() for t in texts]
    model.train()
    return jiwer.wer(refs, hyps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="data/tedlium3")
    ap.add_argument("--spm", default="data/tedlium3/spm_bpe2000.model")
    ap.add_argument("--exp", default="exp/seq2seq_small")
    ap.add_argument("--batch_size", type=int, default=48)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=8000)
    ap.add_argument("--smoothing", type=float, default=0.1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    train_ds = UttDataset(os.path.join(args.data_dir, "train.tsv"), sp, train=True)
    dev_ds = UttDataset(os.path.join(args.data_dir, "dev.tsv"), sp, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    dev_sampler = DistributedSampler(dev_ds, shuffle=False)
    train_dl = DataLoader(train_ds, args.batch_size, sampler=train_sampler, collate_fn=collate,
                          num_workers=8, pin_memory=True, persistent_workers=True)
    dev_dl = DataLoader(dev_ds, 32, sampler=dev_sampler, collate_fn=collate, num_workers=4)

    model = Seq2SeqASR(sp.get_piece_size()).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, (args.warmup / (s + 1)) ** 0.5))
    scaler = torch.cuda.amp.GradScaler()

    os.makedirs(args.exp, exist_ok=True)
    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, (mel, lens, ids, _) in enumerate(train_dl):
            mel, lens, ids = mel.to(device), lens.to(device), ids.to(device)
            tok_in = ids[:, :-1].clamp(min=0)
            tok_out = ids[:, 1:]
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(mel, lens, tok_in)
            loss = F.cross_entropy(logits.float().transpose(1, 2), tok_out, ignore_index=-1,
                                   label_smoothing=args.smoothing)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"ep {epoch} it {it} loss {loss.item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)

        if epoch % 2 == 1 or epoch == args.epochs - 1:
            wer = dev_wer(model.module, dev_dl, sp, device)
            if rank == 0:
                print(f"epoch {epoch} dev WER {100 * wer:.2f}", flush=True)
                if wer < best:
                    best = wer
                    torch.save({"model": model.module.state_dict(), "epoch": epoch, "wer": wer},
                               os.path.join(args.exp, "best.pt"))
            dist.barrier()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch},
                       os.path.join(args.exp, "last.pt"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
