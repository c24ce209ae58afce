"""Listen, Attend and Spell (character level) on WSJ si284, DDP with torchrun.

torchrun --standalone --nproc_per_node=4 09_las_char_wsj.py --train-csv data/train_si284.csv \
    --dev-csv data/test_dev93.csv --save-dir exp/las_char
"""
import argparse
import csv
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
import editdistance

PAD, SOS, EOS = "<pad>", "<sos>", "<eos>"


def read_csv(path):
    with open(path) as f:
        return [row for row in csv.DictReader(f)]


def build_vocab(rows):
    chars = set()
    for r in rows:
        chars.update(r["transcript"].upper())
    itos = [PAD, SOS, EOS] + list(chars)
    return {c: i for i, c in enumerate(itos)}, itos


class WsjDataset(Dataset):
    def __init__(self, rows, stoi):
        self.rows = rows
        self.stoi = stoi
        self.fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=40)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        wav, _ = torchaudio.load(r["wav"])
        x = (self.fbank(wav[0]) + 1e-6).log().T
        x = (x - x.mean(0)) / (x.std(0) + 1e-5)
        y = [self.stoi[SOS]] + [self.stoi[c] for c in r["transcript"].upper() if c in self.stoi] + [self.stoi[EOS]]
        return x, torch.tensor(y)


def collate(batch):
    batch.sort(key=lambda b: b[0].size(0), reverse=True)
    xs, ys = zip(*batch)
    return (pad_sequence(xs, batch_first=True), torch.tensor([x.size(0) for x in xs]),
            pad_sequence(ys, batch_first=True, padding_value=0), torch.tensor([y.size(0) for y in ys]))


class Listener(nn.Module):
    """Pyramidal BLSTM, time resolution reduced by 8."""

    def __init__(self, idim, hidden=256, layers=3):
        super().__init__()
        self.first = nn.LSTM(idim, hidden, batch_first=True, bidirectional=True)
        self.pyramid = nn.ModuleList(
            [nn.LSTM(hidden * 4, hidden, batch_first=True, bidirectional=True) for _ in range(layers)])

    def forward(self, x, lens):
        out, _ = self.first(pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=True))
        x, lens = pad_packed_sequence(out, batch_first=True)
        for lstm in self.pyramid:
            t = x.size(1) // 2 * 2
            x = x[:, :t].reshape(x.size(0), t // 2, x.size(2) * 2)
            lens = (lens // 2).clamp(min=1)
            out, _ = lstm(pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=True))
            x, lens = pad_packed_sequence(out, batch_first=True)
        return x, lens.to(x.device)


class Speller(nn.Module):
    def __init__(self, vocab, enc_dim=512, hidden=512, emb=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTMCell(emb + enc_dim, hidden)
        self.query = nn.Linear(hidden, enc_dim)
        self.out = nn.Sequential(nn.Linear(hidden + enc_dim, hidden), nn.Tanh(), nn.Linear(hidden, vocab))
        self.hidden = hidden

    def forward(self, enc, enc_lens, ys_in, tf_ratio=0.9):
        b, T, _ = enc.shape
        mask = torch.arange(T, device=enc.device)[None] >= enc_lens[:, None]
        h = enc.new_zeros(b, self.hidden)
        c = enc.new_zeros(b, self.hidden)
        ctx = enc.new_zeros(b, enc.size(2))
        logits = []
        tok = ys_in[:, 0]
        for t in range(ys_in.size(1)):
            h, c = self.rnn(torch.cat([self.embed(tok), ctx], -1), (h, c))
            score = torch.bmm(enc, self.query(h).unsqueeze(2)).squeeze(2).masked_fill(mask, -1e4)
            ctx = torch.bmm(score.softmax(-1).unsqueeze(1), enc).squeeze(1)
            step_logits = self.out(torch.cat([h, ctx], -1))
            logits.append(step_logits)
            if t + 1 < ys_in.size(1):
                use_tf = torch.rand(b, device=enc.device) < tf_ratio
                tok = torch.where(use_tf, ys_in[:, t + 1], step_logits.argmax(-1))
        return torch.stack(logits, 1)


class LAS(nn.Module):
    def __init__(self, idim, vocab):
        super().__init__()
        self.listener = Listener(idim)
        self.speller = Speller(vocab)

    def forward(self, x, lens, ys_in, tf_ratio=0.9):
        enc, enc_lens = self.listener(x, lens)
        return self.speller(enc, enc_lens, ys_in, tf_ratio)


@torch.no_grad()
def greedy_cer(model, loader, itos, device, max_len=250):
    model.eval()
    errs = torch.zeros(2, device=device, dtype=torch.long)
    for x, xl, y, yl in loader:
        x, xl = x.to(device), xl.to(device)
        enc, enc_lens = model.listener(x, xl)
        ys = torch.full((x.size(0), max_len), 1, device=device, dtype=torch.long)
        logits = model.speller(enc, enc_lens, ys, tf_ratio=0.0)
        pred = logits.argmax(-1).cpu()
        for p, ref, n in zip(pred, y, yl):
            hyp = []
            for t in p.tolist():
                if t == 2:
                    break
                hyp.append(itos[t])
            r = [itos[t] for t in ref[1:n - 1].tolist()]
            errs[0] += editdistance.eval(hyp, r)
            errs[1] += len(r)
    dist.all_reduce(errs)
    model.train()
    return errs[0].item() / max(errs[1].item(), 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--dev-csv", required=True)
    ap.add_argument("--save-dir", default="exp/las_char")
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    train_rows, dev_rows = read_csv(args.train_csv), read_csv(args.dev_csv)
    stoi, itos = build_vocab(train_rows)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        with open(os.path.join(args.save_dir, "vocab.json"), "w") as f:
            json.dump(itos, f, ensure_ascii=False)

    train_ds, dev_ds = WsjDataset(train_rows, stoi), WsjDataset(dev_rows, stoi)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          collate_fn=collate, num_workers=4, pin_memory=True)
    dev_dl = DataLoader(torch.utils.data.Subset(dev_ds, range(rank, len(dev_ds), world)),
                        batch_size=32, collate_fn=collate, num_workers=2)

    model = LAS(40, len(itos)).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)

    best = float("inf")
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tf_ratio = max(0.7, 1.0 - 0.01 * epoch)
        for step, (x, xl, y, yl) in enumerate(train_dl):
            x, xl, y = x.to(device), xl.to(device), y.to(device)
            logits = ddp(x, xl, y[:, :-1], tf_ratio)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y[:, 1:].reshape(-1),
                                   ignore_index=0, label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} tf {tf_ratio:.2f}", flush=True)

        cer = greedy_cer(model, dev_dl, itos, device)
        plateau.step(cer)
        if rank == 0:
            print(f"epoch {epoch} dev93 CER {cer * 100:.2f}%", flush=True)
            torch.save({"model": model.state_dict(), "epoch": epoch, "cer": cer},
                       os.path.join(args.save_dir, "last.pt"))
            if cer < best:
                best = cer
                torch.save({"model": model.state_dict(), "epoch": epoch, "cer": cer},
                           os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
