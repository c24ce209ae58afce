"""im2markup-style model (CNN + row BiLSTM encoder, attention LSTM decoder), multi-GPU
with torch.multiprocessing.spawn.

    python 02_mathocr_lstm_attention_spawn.py --data data/im2latex --gpus 4
"""
import argparse
import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

PAD_ID, SOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/im2latex")
    ap.add_argument("--vocab", default="data/im2latex/vocab.json")
    ap.add_argument("--save", default="ckpt/im2markup")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--port", default="29533")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--bs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--hid", type=int, default=256)
    ap.add_argument("--emb", type=int, default=80)
    ap.add_argument("--max_len", type=int, default=150)
    ap.add_argument("--resume", default="")
    return ap.parse_args()


class FormulaImages(Dataset):
    """Rows of <split>.jsonl: {"image": "123abc.png", "tokens": ["\\frac", "{", ...]}"""

    def __init__(self, root, split, stoi, max_len):
        with open(os.path.join(root, f"{split}.jsonl")) as f:
            self.rows = [json.loads(l) for l in f]
        self.root, self.stoi, self.max_len = root, stoi, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        im = Image.open(os.path.join(self.root, "images", r["image"])).convert("L")
        x = torch.from_numpy(np.asarray(im, dtype=np.float32) / 255.0).unsqueeze(0)
        ids = [SOS_ID] + [self.stoi.get(t, UNK_ID) for t in r["tokens"][: self.max_len - 2]] + [EOS_ID]
        return x, torch.tensor(ids, dtype=torch.long)


def pad_collate(batch):
    xs, ys = zip(*batch)
    H = max(x.shape[1] for x in xs)
    W = max(x.shape[2] for x in xs)
    imgs = torch.ones(len(xs), 1, H, W)
    for i, x in enumerate(xs):
        imgs[i, :, : x.shape[1], : x.shape[2]] = x
    ys = nn.utils.rnn.pad_sequence(ys, batch_first=True, padding_value=PAD_ID)
    return imgs, ys


def conv_bn(cin, cout):
    return [nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class Im2Markup(nn.Module):
    def __init__(self, vocab_size, emb=80, hid=256):
        super().__init__()
        self.cnn = nn.Sequential(
            *conv_bn(1, 64), nn.MaxPool2d(2, 2),
            *conv_bn(64, 128), nn.MaxPool2d(2, 2),
            *conv_bn(128, 256), *conv_bn(256, 256), nn.MaxPool2d((2, 1), (2, 1)),
            *conv_bn(256, 512), nn.MaxPool2d((1, 2), (1, 2)),
            *conv_bn(512, 512),
        )
        self.row_rnn = nn.LSTM(512, hid, batch_first=True, bidirectional=True)
        self.embed = nn.Embedding(vocab_size, emb, padding_idx=PAD_ID)
        self.cell = nn.LSTMCell(emb + hid, hid)
        self.init_h = nn.Linear(2 * hid, hid)
        self.init_c = nn.Linear(2 * hid, hid)
        self.att_mem = nn.Linear(2 * hid, hid, bias=False)
        self.att_q = nn.Linear(hid, hid)
        self.att_v = nn.Linear(hid, 1, bias=False)
        self.ctx_out = nn.Linear(2 * hid + hid, hid)
        self.cls = nn.Linear(hid, vocab_size)
        self.hid = hid

    def encode(self, img):
        f = self.cnn(img)                          # B, C, H', W'
        B, C, H, W = f.shape
        rows = f.permute(0, 2, 3, 1).reshape(B * H, W, C)
        out, _ = self.row_rnn(rows)
        return out.reshape(B, H * W, -1)           # B, HW, 2*hid

    def init_state(self, mem):
        m = mem.mean(1)
        hid = torch.tanh(self.init_h(m))
        return (hid, torch.tanh(self.init_c(m))), torch.zeros_like(hid)

    def step(self, tok, state, o_prev, mem, mem_proj):
        h, c = self.cell(torch.cat([self.embed(tok), o_prev], -1), state)
        score = self.att_v(torch.tanh(mem_proj + self.att_q(h).unsqueeze(1))).squeeze(-1)
        ctx = (score.softmax(-1).unsqueeze(-1) * mem).sum(1)
        o = torch.tanh(self.ctx_out(torch.cat([h, ctx], -1)))
        return self.cls(o), (h, c), o

    def forward(self, img, tgt_in):
        mem = self.encode(img)
        mem_proj = self.att_mem(mem)
        state, o = self.init_state(mem)
        logits = []
        for t in range(tgt_in.shape[1]):
            lg, state, o = self.step(tgt_in[:, t], state, o, mem, mem_proj)
            logits.append(lg)
        return torch.stack(logits, 1)

    @torch.no_grad()
    def greedy(self, img, max_len):
        mem = self.encode(img)
        mem_proj = self.att_mem(mem)
        state, o = self.init_state(mem)
        tok = torch.full((img.shape[0],), SOS_ID, dtype=torch.long, device=img.device)
        out = []
        for _ in range(max_len):
            lg, state, o = self.step(tok, state, o, mem, mem_proj)
            tok = lg.argmax(-1)
            out.append(tok)
        return torch.stack(out, 1)


def strip(seq):
    seq = list(seq)
    return seq[: seq.index(EOS_ID)] if EOS_ID in seq else seq


def validate(model, loader, rank, max_len):
    net = model.module
    net.eval()
    stats = torch.zeros(3, device=rank)           # exact, tokens correct, tokens total
    for img, tgt in loader:
        img, tgt = img.to(rank), tgt.to(rank)
        pred = net.greedy(img, max_len)
        for p, t in zip(pred.tolist(), tgt[:, 1:].tolist()):
            p, t = strip(p), strip(t)
            stats[0] += float(p == t)
            stats[1] += sum(a == b for a, b in zip(p, t))
            stats[2] += len(t)
    n_local = torch.tensor([len(loader.dataset)], device=rank, dtype=torch.float)
    dist.all_reduce(stats)
    dist.all_reduce(n_local)
    net.train()
    return (stats[0] / n_local).item(), (stats[1] / stats[2]).item()


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    random.seed(0)
    torch.manual_seed(0)

    with open(args.vocab) as f:
        itos = json.load(f)
    stoi = {t: i for i, t in enumerate(itos)}
    train_set = FormulaImages(args.data, "train", stoi, args.max_len)
    val_full = FormulaImages(args.data, "val", stoi, args.max_len)
    # each rank validates a disjoint slice; no padding duplicates
    val_set = Subset(val_full, list(range(rank, len(val_full), world_size)))

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.bs, sampler=sampler, num_workers=6,
                              collate_fn=pad_collate, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.bs, shuffle=False, num_workers=2,
                            collate_fn=pad_collate)

    model = Im2Markup(len(itos), args.emb, args.hid)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(rank)
    model = DistributedDataParallel(model, device_ids=[rank], output_device=rank)
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(optim, mode="max", factor=0.5, patience=1)

    start_epoch, best_em = 0, 0.0
    if args.resume:
        ck = torch.load(args.resume, map_location=f"cuda:{rank}")
        model.module.load_state_dict(ck["model"])
        optim.load_state_dict(ck["optim"])
        start_epoch, best_em = ck["epoch"] + 1, ck["best_em"]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        tot, n = 0.0, 0
        for it, (img, tgt) in enumerate(train_loader):
            img, tgt = img.cuda(rank, non_blocking=True), tgt.cuda(rank, non_blocking=True)
            logits = model(img, tgt[:, :-1])
            loss = F.cross_entropy(logits.transpose(1, 2), tgt[:, 1:], ignore_index=PAD_ID)
            optim.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optim.step()
            tot += loss.item()
            n += 1
            if rank == 0 and it % 200 == 0:
                print(f"[{epoch}:{it}] loss={tot / n:.4f}", flush=True)

        em, tok_acc = validate(model, val_loader, rank, args.max_len)
        sched.step(em)
        if rank == 0:
            print(f"epoch {epoch}  exact-match {em:.4f}  token-acc {tok_acc:.4f}", flush=True)
            os.makedirs(args.save, exist_ok=True)
            state = {"model": model.module.state_dict(), "optim": optim.state_dict(), "epoch": epoch,
                     "best_em": max(best_em, em), "itos": itos}
            torch.save(state, os.path.join(args.save, "latest.pt"))
            if em > best_em:
                torch.save(state, os.path.join(args.save, "best.pt"))
        best_em = max(best_em, em)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
