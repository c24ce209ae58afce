"""
SASRec on the Steam dataset (Kang & McAuley 2018 protocol):
leave-one-out per user, 100 randomly sampled negatives for HR@10 / NDCG@10.

    torchrun --nproc_per_node=8 03_sasrec_steam.py --config configs/sasrec_steam.yaml
"""
import argparse
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

log = logging.getLogger(__name__)


@dataclass
class Config:
    interactions: str = "data/steam/steam_interactions.csv"
    save_dir: str = "checkpoints/sasrec_steam"
    maxlen: int = 50
    hidden_units: int = 50
    num_blocks: int = 2
    num_heads: int = 1
    dropout_rate: float = 0.5
    batch_size: int = 128          # per GPU
    lr: float = 0.001
    lr_sqrt_scaling: bool = True   # Adam: scale lr by sqrt(world size)
    num_epochs: int = 200
    eval_interval: int = 10
    num_eval_neg: int = 100
    seed: int = 2023
    workers: int = 6
    extra: dict = field(default_factory=dict)


def load_config():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=None)
    parser.add_argument("--save_dir", default=None)
    ns = parser.parse_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    if ns.save_dir:
        cfg.save_dir = ns.save_dir
    return cfg


def build_sequences(path):
    df = pd.read_csv(path, usecols=["user_id", "item_id", "timestamp"])
    df = df.sort_values(["user_id", "timestamp"], kind="mergesort")
    # dense ids; 0 is reserved for padding
    df["item"] = pd.factorize(df["item_id"], sort=True)[0] + 1
    num_items = int(df["item"].max())
    seqs = df.groupby("user_id", sort=True)["item"].apply(list).tolist()
    seqs = [s for s in seqs if len(s) >= 3]
    return seqs, num_items


class SeqTrainSet(Dataset):
    def __init__(self, seqs, num_items, maxlen):
        self.seqs = [s[:-2] for s in seqs]
        self.num_items = num_items
        self.maxlen = maxlen

    def __len__(self):
        return len(self.seqs)

    def _neg(self, seen):
        t = np.random.randint(1, self.num_items + 1)
        while t in seen:
            t = np.random.randint(1, self.num_items + 1)
        return t

    def __getitem__(self, i):
        s = self.seqs[i]
        seen = set(s)
        seq = np.zeros(self.maxlen, dtype=np.int64)
        pos = np.zeros(self.maxlen, dtype=np.int64)
        neg = np.zeros(self.maxlen, dtype=np.int64)
        nxt = s[-1]
        idx = self.maxlen - 1
        for it in reversed(s[:-1]):
            seq[idx], pos[idx] = it, nxt
            neg[idx] = self._neg(seen)
            nxt = it
            idx -= 1
            if idx == -1:
                break
        return seq, pos, neg


class PointWiseFeedForward(nn.Module):
    def __init__(self, hidden, dropout):
        super().__init__()
        self.conv1 = nn.Conv1d(hidden, hidden, kernel_size=1)
        self.conv2 = nn.Conv1d(hidden, hidden, kernel_size=1)
        self.drop1 = nn.Dropout(dropout)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x):
        y = self.drop2(self.conv2(torch.relu(self.drop1(self.conv1(x.transpose(-1, -2))))))
        return y.transpose(-1, -2) + x


class SASRec(nn.Module):
    def __init__(self, num_items, cfg):
        super().__init__()
        h = cfg.hidden_units
        self.item_emb = nn.Embedding(num_items + 1, h, padding_idx=0)
        self.pos_emb = nn.Embedding(cfg.maxlen, h)
        self.emb_dropout = nn.Dropout(cfg.dropout_rate)
        self.attn_norms = nn.ModuleList([nn.LayerNorm(h, eps=1e-8) for _ in range(cfg.num_blocks)])
        self.attns = nn.ModuleList([nn.MultiheadAttention(h, cfg.num_heads, cfg.dropout_rate, batch_first=True)
                                    for _ in range(cfg.num_blocks)])
        self.ffn_norms = nn.ModuleList([nn.LayerNorm(h, eps=1e-8) for _ in range(cfg.num_blocks)])
        self.ffns = nn.ModuleList([PointWiseFeedForward(h, cfg.dropout_rate) for _ in range(cfg.num_blocks)])
        self.last_norm = nn.LayerNorm(h, eps=1e-8)

    def feats(self, seq):
        x = self.item_emb(seq) * self.item_emb.embedding_dim ** 0.5
        x = x + self.pos_emb(torch.arange(seq.size(1), device=seq.device))
        x = self.emb_dropout(x)
        keep = (seq != 0).unsqueeze(-1)
        x = x * keep
        L = seq.size(1)
        causal = ~torch.tril(torch.ones(L, L, dtype=torch.bool, device=seq.device))
        for norm, attn, fnorm, ffn in zip(self.attn_norms, self.attns, self.ffn_norms, self.ffns):
            q = norm(x)
            out, _ = attn(q, x, x, attn_mask=causal, need_weights=False)
            x = q + out
            x = ffn(fnorm(x)) * keep
        return self.last_norm(x)

    def forward(self, seq, pos, neg):
        f = self.feats(seq)
        return (f * self.item_emb(pos)).sum(-1), (f * self.item_emb(neg)).sum(-1)

    def predict(self, seq, candidates):
        f = self.feats(seq)[:, -1, :]
        return torch.bmm(self.item_emb(candidates), f.unsqueeze(-1)).squeeze(-1)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.ERROR,
                            format="%(asctime)s %(levelname)s %(message)s")

        np.random.seed(cfg.seed + self.rank)
        random.seed(cfg.seed + self.rank)
        torch.manual_seed(cfg.seed)

        self.seqs, self.num_items = build_sequences(cfg.interactions)
        log.info("%d users / %d items", len(self.seqs), self.num_items)
        self.train_set = SeqTrainSet(self.seqs, self.num_items, cfg.maxlen)
        self.sampler = DistributedSampler(self.train_set, shuffle=True, seed=cfg.seed)
        self.loader = DataLoader(self.train_set, batch_size=cfg.batch_size, sampler=self.sampler,
                                 num_workers=cfg.workers, pin_memory=True)

        net = SASRec(self.num_items, cfg).to(self.device)
        for name, p in net.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_normal_(p)
        self.net = net
        self.model = DistributedDataParallel(net, device_ids=[self.local_rank])
        lr = cfg.lr * (math.sqrt(self.world) if cfg.lr_sqrt_scaling else 1.0)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr, betas=(0.9, 0.98))
        self.crit = nn.BCEWithLogitsLoss()
        # disjoint eval shard per rank, sized by user count (no padding)
        self.eval_users = list(range(self.rank, len(self.seqs), self.world))

    def train_epoch(self, epoch):
        self.sampler.set_epoch(epoch)
        self.model.train()
        acc = torch.zeros(2, device=self.device)
        for seq, pos, neg in self.loader:
            seq, pos, neg = (t.to(self.device, non_blocking=True) for t in (seq, pos, neg))
            pl, nl = self.model(seq, pos, neg)
            m = pos != 0
            loss = self.crit(pl[m], torch.ones_like(pl[m])) + self.crit(nl[m], torch.zeros_like(nl[m]))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=self.device)])
        dist.all_reduce(acc)
        return (acc[0] / acc[1]).item()

    @torch.no_grad()
    def evaluate(self, split="valid"):
        self.net.eval()
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed)
        hr, ndcg, cnt = 0.0, 0.0, 0
        batch_seq, batch_cand = [], []

        def flush():
            nonlocal hr, ndcg
            seq_t = torch.as_tensor(np.stack(batch_seq), device=self.device)
            cand_t = torch.as_tensor(np.stack(batch_cand), device=self.device)
            logits = -self.net.predict(seq_t, cand_t)
            ranks = logits.argsort(dim=1).argsort(dim=1)[:, 0]
            hits = ranks < 10
            hr += hits.sum().item()
            ndcg += (1.0 / torch.log2(ranks[hits].float() + 2)).sum().item()
            batch_seq.clear()
            batch_cand.clear()

        for u in self.eval_users:
            s = self.seqs[u]
            hist, target = (s[:-2], s[-2]) if split == "valid" else (s[:-1], s[-1])
            seq = np.zeros(cfg.maxlen, dtype=np.int64)
            h = hist[-cfg.maxlen:]
            seq[cfg.maxlen - len(h):] = h
            seen = set(s)
            cands = [target]
            while len(cands) < cfg.num_eval_neg + 1:
                t = int(rng.integers(1, self.num_items + 1))
                if t not in seen:
                    cands.append(t)
            batch_seq.append(seq)
            batch_cand.append(np.array(cands, dtype=np.int64))
            cnt += 1
            if len(batch_seq) == 512:
                flush()
        if batch_seq:
            flush()

        stats = torch.tensor([hr, ndcg, float(cnt)], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        self.net.train()
        return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()

    def save(self, epoch, tag):
        if self.rank != 0:
            return
        os.makedirs(self.cfg.save_dir, exist_ok=True)
        torch.save({"epoch": epoch, "model": self.net.state_dict(), "optim": self.opt.state_dict()},
                   os.path.join(self.cfg.save_dir, f"{tag}.pth"))

    def fit(self):
        best = -1.0
        for epoch in range(1, self.cfg.num_epochs + 1):
            t0 = time.time()
            loss = self.train_epoch(epoch)
            log.info("epoch %3d  loss %.4f  %.1fs", epoch, loss, time.time() - t0)
            if epoch % self.cfg.eval_interval == 0:
                v_hr, v_ndcg = self.evaluate("valid")
                t_hr, t_ndcg = self.evaluate("test")
                log.info("epoch %3d  valid NDCG@10 %.4f HR@10 %.4f | test NDCG@10 %.4f HR@10 %.4f",
                         epoch, v_ndcg, v_hr, t_ndcg, t_hr)
                if v_ndcg > best:
                    best = v_ndcg
                    self.save(epoch, "best")
                self.save(epoch, "last")
                dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    Trainer(load_config()).fit()
