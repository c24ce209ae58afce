"""Deep (24+24 layer) transformer for En->De trained with FSDP, fairseq-style token batches.

    torchrun --nproc_per_node=8 14_fsdp_deep_nmt.py --data data/wmt19_ende_bin --save-dir ckpt/deep24
"""
import argparse
import functools
import logging
import math
import os
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

logger = logging.getLogger("deep_nmt")
PAD, EOS = 1, 2


def options():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--embed-dim", type=int, default=1024)
    p.add_argument("--ffn-dim", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-updates", type=int, default=8000)
    p.add_argument("--max-update", type=int, default=200000)
    p.add_argument("--save-interval-updates", type=int, default=4000)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class EncLayer(nn.Module):
    def __init__(self, d, h, f, p):
        super().__init__()
        self.sa = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, f), nn.ReLU(), nn.Dropout(p), nn.Linear(f, d))
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, x, kpm):
        h = self.n1(x)
        x = x + self.drop(self.sa(h, h, h, key_padding_mask=kpm, need_weights=False)[0])
        return x + self.drop(self.ff(self.n2(x)))


class DecLayer(nn.Module):
    def __init__(self, d, h, f, p):
        super().__init__()
        self.sa = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.ca = nn.MultiheadAttention(d, h, dropout=p, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, f), nn.ReLU(), nn.Dropout(p), nn.Linear(f, d))
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, y, mem, causal, kpm, mkpm):
        h = self.n1(y)
        y = y + self.drop(self.sa(h, h, h, attn_mask=causal, key_padding_mask=kpm, need_weights=False)[0])
        h = self.n2(y)
        y = y + self.drop(self.ca(h, mem, mem, key_padding_mask=mkpm, need_weights=False)[0])
        return y + self.drop(self.ff(self.n3(y)))


class DeepTransformer(nn.Module):
    def __init__(self, vocab, a):
        super().__init__()
        d = a.embed_dim
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, 0, d ** -0.5)
        self.pos = nn.Embedding(1024, d)
        self.enc = nn.ModuleList(EncLayer(d, a.heads, a.ffn_dim, a.dropout) for _ in range(a.layers))
        self.dec = nn.ModuleList(DecLayer(d, a.heads, a.ffn_dim, a.dropout) for _ in range(a.layers))
        self.enc_norm, self.dec_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(a.dropout)
        self.scale = math.sqrt(d)

    def forward(self, src, prev):
        kpm = src.eq(PAD)
        x = self.drop(self.embed(src) * self.scale + self.pos(torch.arange(src.size(1), device=src.device)))
        for l in self.enc:
            x = l(x, kpm)
        mem = self.enc_norm(x)
        T = prev.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=src.device), 1)
        y = self.drop(self.embed(prev) * self.scale + self.pos(torch.arange(T, device=src.device)))
        for l in self.dec:
            y = l(y, mem, causal, prev.eq(PAD), kpm)
        return F.linear(self.dec_norm(y), self.embed.weight)


def load_split(data, split):
    with open(os.path.join(data, f"{split}.pkl"), "rb") as f:
        return pickle.load(f)  # {"src": [[ids]], "tgt": [[ids]], "vocab_size": int}


def batches_for_epoch(d, max_tokens, epoch, seed, rank, world):
    sizes = np.array([max(len(s), len(t)) + 1 for s, t in zip(d["src"], d["tgt"])])
    order = np.argsort(sizes, kind="stable")
    out, cur, m = [], [], 0
    for i in order:
        if cur and max(m, sizes[i]) * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, m = [], 0
        cur.append(i)
        m = max(m, sizes[i])
    if cur:
        out.append(cur)
    rng = np.random.RandomState(seed + epoch)
    out = [out[j] for j in rng.permutation(len(out))]
    out = out[: len(out) // world * world]
    return out[rank::world]


def tensorize(d, idx, dev):
    B = len(idx)
    S = max(len(d["src"][i]) for i in idx) + 1
    T = max(len(d["tgt"][i]) for i in idx) + 1
    src = torch.full((B, S), PAD, dtype=torch.long)
    prev = torch.full((B, T), PAD, dtype=torch.long)
    tgt = torch.full((B, T), PAD, dtype=torch.long)
    for k, i in enumerate(idx):
        s, t = d["src"][i], d["tgt"][i]
        src[k, : len(s) + 1] = torch.tensor(s + [EOS])
        tgt[k, : len(t) + 1] = torch.tensor(t + [EOS])
        prev[k, : len(t) + 1] = torch.tensor([EOS] + t)
    return src.to(dev), prev.to(dev), tgt.to(dev)


def criterion(logits, tgt, eps):
    lp = F.log_softmax(logits.float(), -1)
    keep = tgt.ne(PAD)
    nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)[keep].sum()
    smooth = -lp.sum(-1)[keep].sum()
    eps_i = eps / (lp.size(-1) - 1)
    return (1 - eps - eps_i) * nll + eps_i * smooth, nll, keep.sum()


def save_checkpoint(model, optimizer, num_updates, save_dir):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        model_state = model.state_dict()
    path = os.path.join(save_dir, f"checkpoint_{num_updates}.pt")
    torch.save({"model": model_state, "num_updates": num_updates}, path)
    logger.info("saved %s", path)


def main():
    a = options()
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(a.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(name)s | %(message)s")

    train, valid = load_split(a.data, "train"), load_split(a.data, "valid")
    model = DeepTransformer(train["vocab_size"], a)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={EncLayer, DecLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=dev, use_orig_params=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                buffer_dtype=torch.bfloat16))
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, betas=(0.9, 0.98), eps=1e-8)
    W = a.warmup_updates
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min((u + 1) / W, math.sqrt(W / (u + 1))))
    if rank == 0:
        os.makedirs(a.save_dir, exist_ok=True)

    num_updates, epoch = 0, 0
    t0 = time.time()
    while num_updates < a.max_update:
        epoch += 1
        model.train()
        for idx in batches_for_epoch(train, a.max_tokens, epoch, a.seed, rank, world):
            src, prev, tgt = tensorize(train, idx, dev)
            loss, nll, ntok = criterion(model(src, prev), tgt, a.label_smoothing)
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            num_updates += 1
            if num_updates % 100 == 0:
                logger.info("epoch %d | upd %d | nll %.3f | lr %.2e | %.0fs", epoch, num_updates,
                            (nll / ntok).item() / math.log(2), sched.get_last_lr()[0], time.time() - t0)

            if num_updates % a.save_interval_updates == 0:
                model.eval()
                acc = torch.zeros(2, device=dev)
                with torch.no_grad():
                    for vidx in batches_for_epoch(valid, a.max_tokens, 0, a.seed, rank, world):
                        vs, vp, vt = tensorize(valid, vidx, dev)
                        _, vnll, vtok = criterion(model(vs, vp), vt, 0.0)
                        acc += torch.stack([vnll, vtok.float()])
                dist.all_reduce(acc)
                model.train()
                logger.info("valid | upd %d | nll %.3f | ppl %.2f", num_updates,
                            (acc[0] / acc[1]).item() / math.log(2), 2 ** ((acc[0] / acc[1]).item() / math.log(2)))
                if rank == 0:
                    save_checkpoint(model, opt, num_updates, a.save_dir)
                dist.barrier()
            if num_updates >= a.max_update:
                break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
