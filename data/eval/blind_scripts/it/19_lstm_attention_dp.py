"""BiLSTM encoder / LSTM decoder with Luong attention (input feeding) for low-resource MT.

Uses nn.DataParallel on one node; the loss is computed inside forward() so only per-GPU
loss sums are gathered, not the (batch x len x vocab) logits.

    CUDA_VISIBLE_DEVICES=0,1,2,3 python 19_lstm_attention_dp.py --data data/ne-en --src ne --tgt en
"""
import argparse
import os
import random
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from torch.utils.data import DataLoader, Dataset

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--src", default="ne")
    p.add_argument("--tgt", default="en")
    p.add_argument("--spm", default=None, help="defaults to <data>/spm.model")
    p.add_argument("--emb", type=int, default=512)
    p.add_argument("--hid", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--bsz", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--max-len", type=int, default=100)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--out", default="exp/lstm_ne_en")
    return p.parse_args()


class Parallel(Dataset):
    def __init__(self, prefix, src, tgt, sp, max_len):
        with open(f"{prefix}.{src}", encoding="utf-8") as f:
            self.s = [sp.encode(l.strip())[:max_len] + [EOS] for l in f]
        with open(f"{prefix}.{tgt}", encoding="utf-8") as f:
            self.t = [[BOS] + sp.encode(l.strip())[:max_len] + [EOS] for l in f]

    def __len__(self):
        return len(self.s)

    def __getitem__(self, i):
        return self.s[i], self.t[i]


def collate(batch):
    src_lens = torch.tensor([len(s) for s, _ in batch])
    src = torch.full((len(batch), int(src_lens.max())), PAD, dtype=torch.long)
    tgt = torch.full((len(batch), max(len(t) for _, t in batch)), PAD, dtype=torch.long)
    for i, (s, t) in enumerate(batch):
        src[i, : len(s)] = torch.tensor(s)
        tgt[i, : len(t)] = torch.tensor(t)
    return src, src_lens, tgt


class Encoder(nn.Module):
    def __init__(self, vocab, emb, hid, layers, dropout):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb, padding_idx=PAD)
        self.rnn = nn.LSTM(emb, hid // 2, layers, batch_first=True, bidirectional=True,
                           dropout=dropout if layers > 1 else 0.0)
        self.drop = nn.Dropout(dropout)

    def forward(self, src, src_lens):
        self.rnn.flatten_parameters()
        x = self.drop(self.embed(src))
        packed = pack_padded_sequence(x, src_lens.cpu(), batch_first=True, enforce_sorted=False)
        out, (h, c) = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        # merge directions: (layers*2, B, H/2) -> (layers, B, H)
        h = torch.cat([h[0::2], h[1::2]], dim=-1)
        c = torch.cat([c[0::2], c[1::2]], dim=-1)
        return out, (h, c)


class AttnDecoder(nn.Module):
    def __init__(self, vocab, emb, hid, layers, dropout):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb, padding_idx=PAD)
        self.cells = nn.ModuleList(nn.LSTMCell((emb + hid) if i == 0 else hid, hid) for i in range(layers))
        self.attn_in = nn.Linear(hid, hid, bias=False)
        self.attn_out = nn.Linear(2 * hid, hid, bias=False)
        self.proj = nn.Linear(hid, vocab)
        self.drop = nn.Dropout(dropout)

    def step(self, y, state, feed, enc_out, src_mask):
        h, c = state
        inp = torch.cat([self.drop(self.embed(y)), feed], -1)
        new_h, new_c = [], []
        for i, cell in enumerate(self.cells):
            hi, ci = cell(inp, (h[i], c[i]))
            inp = self.drop(hi)
            new_h.append(hi)
            new_c.append(ci)
        q = self.attn_in(new_h[-1]).unsqueeze(1)                       # B,1,H
        scores = torch.bmm(q, enc_out.transpose(1, 2)).squeeze(1)       # B,L
        scores = scores.masked_fill(~src_mask, float("-inf"))
        ctx = torch.bmm(scores.softmax(-1).unsqueeze(1), enc_out).squeeze(1)
        feed = torch.tanh(self.attn_out(torch.cat([ctx, new_h[-1]], -1)))
        return self.proj(self.drop(feed)), (torch.stack(new_h), torch.stack(new_c)), feed


class Seq2Seq(nn.Module):
    def __init__(self, vocab, emb, hid, layers, dropout):
        super().__init__()
        self.encoder = Encoder(vocab, emb, hid, layers, dropout)
        self.decoder = AttnDecoder(vocab, emb, hid, layers, dropout)
        self.hid = hid

    def forward(self, src, src_lens, tgt):
        """Returns (summed token NLL, number of target tokens) for this chunk of the batch."""
        enc_out, state = self.encoder(src, src_lens)
        src_mask = src.ne(PAD)
        feed = enc_out.new_zeros(src.size(0), self.hid)
        logits = []
        for t in range(tgt.size(1) - 1):
            out, state, feed = self.decoder.step(tgt[:, t], state, feed, enc_out, src_mask)
            logits.append(out)
        logits = torch.stack(logits, 1)
        gold = tgt[:, 1:]
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), gold.reshape(-1),
                              ignore_index=PAD, reduction="sum", label_smoothing=0.1)
        return nll.unsqueeze(0), gold.ne(PAD).sum().unsqueeze(0)

    @torch.no_grad()
    def translate(self, src, src_lens, max_len=120):
        enc_out, state = self.encoder(src, src_lens)
        src_mask = src.ne(PAD)
        feed = enc_out.new_zeros(src.size(0), self.hid)
        y = torch.full((src.size(0),), BOS, dtype=torch.long, device=src.device)
        out, done = [], torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            logits, state, feed = self.decoder.step(y, state, feed, enc_out, src_mask)
            y = logits.argmax(-1).masked_fill(done, PAD)
            out.append(y)
            done |= y.eq(EOS)
            if done.all():
                break
        return torch.stack(out, 1).tolist()


def bleu_on_dev(model, loader, sp, refs):
    model.eval()
    hyps = []
    for src, lens, _ in loader:
        for h in model.translate(src.cuda(), lens):
            h = h[: h.index(EOS)] if EOS in h else h
            hyps.append(sp.decode([t for t in h if t != PAD]))
    model.train()
    return sacrebleu.corpus_bleu(hyps, [refs]).score


def main():
    args = get_args()
    random.seed(1)
    torch.manual_seed(1)
    sp = spm.SentencePieceProcessor(model_file=args.spm or os.path.join(args.data, "spm.model"))
    train = Parallel(os.path.join(args.data, "train"), args.src, args.tgt, sp, args.max_len)
    dev = Parallel(os.path.join(args.data, "dev"), args.src, args.tgt, sp, args.max_len)
    with open(os.path.join(args.data, f"dev.{args.tgt}"), encoding="utf-8") as f:
        dev_refs = [l.strip() for l in f]
    train_dl = DataLoader(train, batch_size=args.bsz, shuffle=True, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev, batch_size=128, shuffle=False, collate_fn=collate)

    net = Seq2Seq(sp.get_piece_size(), args.emb, args.hid, args.layers, args.dropout).cuda()
    n_gpu = torch.cuda.device_count()
    model = nn.DataParallel(net) if n_gpu > 1 else net
    print(f"{sum(p.numel() for p in net.parameters()) / 1e6:.1f}M params on {n_gpu} GPU(s)")
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=1)

    os.makedirs(args.out, exist_ok=True)
    best, bad_epochs = -1.0, 0
    for epoch in range(args.epochs):
        t0, tot_nll, tot_tok = time.time(), 0.0, 0
        for step, (src, lens, tgt) in enumerate(train_dl):
            src, tgt = src.cuda(non_blocking=True), tgt.cuda(non_blocking=True)
            nll, ntok = model(src, lens, tgt)
            nll, ntok = nll.sum(), ntok.sum()
            opt.zero_grad(set_to_none=True)
            (nll / ntok).backward()
            nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            opt.step()
            tot_nll += nll.item()
            tot_tok += ntok.item()
            if (step + 1) % 100 == 0:
                print(f"ep {epoch} step {step + 1}/{len(train_dl)} nll/tok {tot_nll / tot_tok:.3f} "
                      f"{time.time() - t0:.0f}s", flush=True)

        bleu = bleu_on_dev(net, dev_dl, sp, dev_refs)
        sched.step(bleu)
        print(f"epoch {epoch}: train nll/tok {tot_nll / tot_tok:.3f} dev BLEU {bleu:.2f} "
              f"lr {opt.param_groups[0]['lr']:.1e}", flush=True)
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                   os.path.join(args.out, "last.pt"))
        if bleu > best:
            best, bad_epochs = bleu, 0
            torch.save({"model": net.state_dict(), "epoch": epoch, "bleu": bleu},
                       os.path.join(args.out, "best.pt"))
        else:
            bad_epochs += 1
            if bad_epochs >= args.patience:
                print(f"early stop, best dev BLEU {best:.2f}")
                break


if __name__ == "__main__":
    main()
