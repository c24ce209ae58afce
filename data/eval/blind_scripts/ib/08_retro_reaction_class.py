"""Retrosynthesis with optional reaction-class token, top-k exact-match evaluation.

torchrun --nproc_per_node=4 08_retro_reaction_class.py --data data/uspto50k_tok --with_class
"""
import argparse
import json
import math
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
TOPK = (1, 3, 5, 10)


def canonical(smi):
    mol = Chem.MolFromSmiles(smi)
    return None if mol is None else Chem.MolToSmiles(mol, isomericSmiles=True)


class TokenizedRetro(Dataset):
    """Pre-tokenized jsonl: {"src": [...tokens], "tgt": [...tokens], "class": int}."""

    def __init__(self, path, stoi, with_class):
        self.items = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                src = ([f"<RX_{ex['class']}>"] if with_class else []) + ex["src"]
                self.items.append(([stoi.get(t, stoi["<unk>"]) for t in src],
                                   [stoi.get(t, stoi["<unk>"]) for t in ex["tgt"]],
                                   "".join(ex["tgt"])))
        self.bos, self.eos = stoi["<s>"], stoi["</s>"]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        s, t, _ = self.items[i]
        return torch.tensor(s + [self.eos]), torch.tensor([self.bos] + t + [self.eos]), i


def pad_collate(batch):
    s, t, i = zip(*batch)
    return nn.utils.rnn.pad_sequence(s, True), nn.utils.rnn.pad_sequence(t, True), torch.tensor(i)


class RetroNet(nn.Module):
    def __init__(self, V, d=512, heads=8, enc_layers=6, dec_layers=6, dropout=0.3):
        super().__init__()
        self.d = d
        self.src_emb = nn.Embedding(V, d, padding_idx=0)
        self.tgt_emb = nn.Embedding(V, d, padding_idx=0)
        self.pos = nn.Embedding(512, d)
        self.seq2seq = nn.Transformer(d, heads, enc_layers, dec_layers, 4 * d, dropout, batch_first=True)
        self.proj = nn.Linear(d, V)

    def _add_pos(self, x):
        return x + self.pos(torch.arange(x.size(1), device=x.device))

    def encode(self, src):
        return self.seq2seq.encoder(self._add_pos(self.src_emb(src) * math.sqrt(self.d)), src_key_padding_mask=src.eq(0))

    def decode(self, tgt, mem, src_pad):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.seq2seq.decoder(self._add_pos(self.tgt_emb(tgt) * math.sqrt(self.d)), mem, tgt_mask=mask,
                                 tgt_key_padding_mask=tgt.eq(0), memory_key_padding_mask=src_pad)
        return self.proj(h)

    def forward(self, src, tgt):
        return self.decode(tgt, self.encode(src), src.eq(0))


@torch.no_grad()
def beam_search(net, src, bos, eos, k, max_len):
    B, dev = src.size(0), src.device
    mem = net.encode(src).repeat_interleave(k, 0)
    spad = src.eq(0).repeat_interleave(k, 0)
    hyp = torch.full((B * k, 1), bos, dtype=torch.long, device=dev)
    cum = torch.zeros(B, k, device=dev)
    cum[:, 1:] = float("-inf")
    ended = torch.zeros(B * k, dtype=torch.bool, device=dev)
    for _ in range(max_len):
        lp = F.log_softmax(net.decode(hyp, mem, spad)[:, -1], dim=-1)
        lp.masked_fill_(ended[:, None], float("-inf"))
        lp[:, 0] = torch.where(ended, torch.zeros_like(lp[:, 0]), lp[:, 0])
        V = lp.size(-1)
        cum, flat = (cum.reshape(-1, 1) + lp).reshape(B, -1).topk(k, dim=-1)
        parent = (torch.div(flat, V, rounding_mode="floor") + torch.arange(B, device=dev)[:, None] * k).reshape(-1)
        hyp = torch.cat([hyp[parent], (flat % V).reshape(-1, 1)], 1)
        ended = ended[parent] | hyp[:, -1].eq(eos)
        if ended.all():
            break
    return hyp.reshape(B, k, -1)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)

        with open(os.path.join(args.data, "vocab.json")) as f:
            self.itos = json.load(f)
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.train_ds = TokenizedRetro(os.path.join(args.data, "train.jsonl"), self.stoi, args.with_class)
        self.val_ds = TokenizedRetro(os.path.join(args.data, "val.jsonl"), self.stoi, args.with_class)
        self.sampler = DistributedSampler(self.train_ds, shuffle=True)
        self.train_dl = DataLoader(self.train_ds, args.batch_size, sampler=self.sampler, collate_fn=pad_collate,
                                   num_workers=4, pin_memory=True, drop_last=True)
        self.val_dl = DataLoader(self.val_ds, args.eval_batch_size, collate_fn=pad_collate, num_workers=2,
                                 sampler=DistributedSampler(self.val_ds, shuffle=False))

        self.model = DDP(RetroNet(len(self.itos)).to(self.device), device_ids=[self.local_rank])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr, betas=(0.9, 0.998))
        self.crit = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
        self.step = 0

    def detok(self, ids):
        toks = []
        for t in ids[1:]:
            if t == self.stoi["</s>"]:
                break
            if t:
                toks.append(self.itos[t])
        return "".join(toks)

    def train_epoch(self, epoch):
        self.model.train()
        self.sampler.set_epoch(epoch)
        for src, tgt, _ in self.train_dl:
            src, tgt = src.to(self.device, non_blocking=True), tgt.to(self.device, non_blocking=True)
            out = self.model(src, tgt[:, :-1])
            loss = self.crit(out.reshape(-1, out.size(-1)), tgt[:, 1:].reshape(-1))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.step += 1
            if self.rank == 0 and self.step % 200 == 0:
                print(f"step {self.step} loss {loss.item():.4f}", flush=True)

    def evaluate(self):
        net = self.model.module
        net.eval()
        hits, n = Counter(), 0
        for src, _, idx in self.val_dl:
            beams = beam_search(net, src.to(self.device), self.stoi["<s>"], self.stoi["</s>"],
                                self.args.beam, self.args.max_len)
            for b, i in enumerate(idx.tolist()):
                gold = canonical(self.val_ds.items[i][2])
                preds = [canonical(self.detok(s)) for s in beams[b].tolist()]
                for k in TOPK:
                    hits[k] += int(gold is not None and gold in preds[:k])
                n += 1
        stats = torch.tensor([hits[k] for k in TOPK] + [n], dtype=torch.float64)
        dist.all_reduce(stats)
        return {f"top{k}": (stats[j] / stats[-1]).item() for j, k in enumerate(TOPK)}

    def save(self, epoch, metrics):
        if self.rank != 0:
            return
        os.makedirs(self.args.out, exist_ok=True)
        torch.save({"epoch": epoch, "step": self.step, "model": self.model.module.state_dict(),
                    "optimizer": self.opt.state_dict(), "metrics": metrics, "itos": self.itos},
                   os.path.join(self.args.out, f"ckpt_{epoch:04d}.pt"))

    def fit(self):
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            metrics = {}
            if (epoch + 1) % self.args.eval_every == 0:
                metrics = self.evaluate()
                if self.rank == 0:
                    print(f"epoch {epoch} " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()), flush=True)
            self.save(epoch, metrics)
        dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="ckpt/retro_class")
    ap.add_argument("--with_class", action="store_true")
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--eval_batch_size", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beam", type=int, default=10)
    ap.add_argument("--max_len", type=int, default=200)
    ap.add_argument("--eval_every", type=int, default=20)
    Trainer(ap.parse_args()).fit()
