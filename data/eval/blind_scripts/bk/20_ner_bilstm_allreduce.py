"""
BiLSTM-CNN tagger for CoNLL-2003 NER, trained data-parallel with
torch.distributed (no DDP): rank 0's initial weights are broadcast,
gradients are averaged in one coalesced all_reduce per step.

    torchrun --nproc_per_node=4 20_ner_bilstm_allreduce.py --data conll2003/ --glove glove.6B.100d.txt
"""
import argparse
import os
import time
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

PAD, UNK = "<pad>", "<unk>"


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--glove", default=None)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--char-dim", type=int, default=30)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.015)
    p.add_argument("--save", default="models/ner_bilstm.pt")
    return p.parse_args()


def read_conll(path):
    sents, words, tags = [], [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("-DOCSTART-"):
                if words:
                    sents.append((words, tags))
                    words, tags = [], []
                continue
            cols = line.split()
            words.append(cols[0])
            tags.append(cols[-1])
    if words:
        sents.append((words, tags))
    return sents


def build_vocab(sents, min_count=1):
    # sorted so that every rank builds identical ids from the same file
    c = Counter(w.lower() for ws, _ in sents for w in ws)
    words = [PAD, UNK] + sorted(w for w, n in c.items() if n >= min_count)
    chars = [PAD, UNK] + sorted({ch for ws, _ in sents for w in ws for ch in w})
    tags = sorted({t for _, ts in sents for t in ts})
    return {w: i for i, w in enumerate(words)}, {ch: i for i, ch in enumerate(chars)}, {t: i for i, t in enumerate(tags)}


class Tagger(nn.Module):
    def __init__(self, n_words, n_chars, n_tags, char_dim, hidden, emb=None):
        super().__init__()
        self.wemb = nn.Embedding(n_words, 100, padding_idx=0)
        if emb is not None:
            self.wemb.weight.data.copy_(emb)
        self.cemb = nn.Embedding(n_chars, char_dim, padding_idx=0)
        self.cconv = nn.Conv1d(char_dim, 30, 3, padding=1)
        self.lstm = nn.LSTM(130, hidden, batch_first=True, bidirectional=True)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(2 * hidden, n_tags)

    def forward(self, w, c, lengths):
        B, T, L = c.shape
        ch = self.cemb(c.view(B * T, L)).transpose(1, 2)
        ch = self.cconv(ch).amax(dim=2).view(B, T, -1)
        x = self.drop(torch.cat([self.wemb(w), ch], dim=-1))
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=T)
        return self.out(self.drop(h))


def make_collate(wv, cv, tv):
    def collate(batch):
        ws = [torch.tensor([wv.get(w.lower(), 1) for w in s]) for s, _ in batch]
        ts = [torch.tensor([tv[t] for t in tags]) for _, tags in batch]
        T = max(len(s) for s, _ in batch)
        L = max(len(w) for s, _ in batch for w in s)
        cs = torch.zeros(len(batch), T, L, dtype=torch.long)
        for i, (s, _) in enumerate(batch):
            for j, w in enumerate(s):
                cs[i, j, :len(w)] = torch.tensor([cv.get(ch, 1) for ch in w])
        lengths = torch.tensor([len(s) for s, _ in batch])
        return pad_sequence(ws, batch_first=True), cs, pad_sequence(ts, batch_first=True, padding_value=-100), lengths
    return collate


def load_glove(path, wv):
    emb = torch.randn(len(wv), 100) * 0.1
    emb[0] = 0
    with open(path, encoding="utf8") as f:
        for line in f:
            parts = line.rstrip().split(" ")
            if parts[0] in wv:
                emb[wv[parts[0]]] = torch.tensor(np.asarray(parts[1:], dtype=np.float32))
    return emb


def allreduce_grads(model, world):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


@torch.no_grad()
def token_f1(model, loader, device, o_id):
    model.eval()
    tp = fp = fn = 0
    for w, c, t, lengths in loader:
        w, c, t = w.to(device), c.to(device), t.to(device)
        pred = model(w, c, lengths).argmax(-1)
        mask = t != -100
        p_ent = (pred != o_id) & mask
        g_ent = (t != o_id) & mask
        tp += ((pred == t) & p_ent & g_ent).sum().item()
        fp += (p_ent & ~((pred == t) & g_ent)).sum().item()
        fn += (g_ent & ~((pred == t) & p_ent)).sum().item()
    prec = tp / max(tp + fp, 1)
    rec = tp / max(tp + fn, 1)
    return 2 * prec * rec / max(prec + rec, 1e-9)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    train = read_conll(os.path.join(args.data, "train.txt"))
    dev = read_conll(os.path.join(args.data, "valid.txt"))
    wv, cv, tv = build_vocab(train)
    collate = make_collate(wv, cv, tv)
    sampler = DistributedSampler(train, shuffle=True, seed=5)
    train_dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=2, drop_last=True)
    dev_dl = DataLoader(dev, batch_size=64, collate_fn=collate,
                        sampler=DistributedSampler(dev, shuffle=False), num_workers=2)

    emb = load_glove(args.glove, wv) if args.glove else None
    model = Tagger(len(wv), len(cv), len(tv), args.char_dim, args.hidden, emb).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.05 * e))

    best_f1 = -1.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, total = time.time(), 0.0
        for w, c, t, lengths in train_dl:
            w, c, t = w.to(device), c.to(device), t.to(device)
            logits = model(w, c, lengths)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_grads(model, world)
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            total += loss.item()
        decay.step()

        f1 = token_f1(model, dev_dl, device, tv["O"])
        if rank == 0:
            print(f"epoch {epoch} loss {total / len(train_dl):.4f} dev F1 {f1:.4f} ({time.time() - t0:.0f}s)",
                  flush=True)
            if f1 > best_f1:
                best_f1 = f1
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save({"model": model.state_dict(), "words": wv, "chars": cv, "tags": tv,
                            "epoch": epoch, "dev_f1": f1}, args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
