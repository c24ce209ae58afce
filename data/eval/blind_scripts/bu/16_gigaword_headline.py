"""Gigaword headline generation, transformer-base, token batches, checkpoint averaging.

The update size is fixed in tokens (--tokens-per-update), independent of the
number of GPUs, so lr / warmup carry over between 1, 4 or 8 GPU runs.

    torchrun --nproc_per_node=4 16_gigaword_headline.py --data data/gigaword --spm data/gigaword/spm.model
"""
import argparse
import collections
import contextlib
import datetime
import math
import os
import time

import numpy as np
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rouge_score import rouge_scorer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

PAD, BOS, EOS = 0, 1, 2


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--spm", required=True)
    p.add_argument("--save-dir", default="checkpoints/gigaword")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--tokens-per-update", type=int, default=65536)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max-update", type=int, default=60000)
    p.add_argument("--save-interval-updates", type=int, default=2000)
    p.add_argument("--average-last", type=int, default=5)
    p.add_argument("--checkpoint-activations", action="store_true")
    return p.parse_args()


def build_cache(data_dir, sp, cache):
    out = {}
    for split in ("train", "valid"):
        with open(os.path.join(data_dir, f"{split}.src")) as fs, open(os.path.join(data_dir, f"{split}.tgt")) as ft:
            src, tgt, raw = [], [], []
            for a, b in zip(fs, ft):
                src.append(np.asarray(sp.encode(a.strip())[:126], dtype=np.int32))
                tgt.append(np.asarray(sp.encode(b.strip())[:62], dtype=np.int32))
                raw.append(b.strip())
        out[split] = {"src": src, "tgt": tgt, "raw": raw}
    tmp = cache + f".tmp{os.getpid()}"
    torch.save(out, tmp)
    os.replace(tmp, cache)


def token_batches(lens, max_tokens):
    order = np.argsort(lens, kind="stable")
    res, cur, longest = [], [], 0
    for i in order:
        if cur and max(longest, lens[i]) * (len(cur) + 1) > max_tokens:
            res.append(cur)
            cur, longest = [], 0
        cur.append(int(i))
        longest = max(longest, int(lens[i]))
    if cur:
        res.append(cur)
    return res


def tensors(split, idx, dev):
    S = max(len(split["src"][i]) for i in idx) + 1
    T = max(len(split["tgt"][i]) for i in idx) + 1
    src = torch.full((len(idx), S), PAD, dtype=torch.long)
    prev = torch.full((len(idx), T), PAD, dtype=torch.long)
    gold = torch.full((len(idx), T), PAD, dtype=torch.long)
    for k, i in enumerate(idx):
        a, b = split["src"][i].tolist(), split["tgt"][i].tolist()
        src[k, : len(a) + 1] = torch.tensor(a + [EOS])
        prev[k, : len(b) + 1] = torch.tensor([BOS] + b)
        gold[k, : len(b) + 1] = torch.tensor(b + [EOS])
    return src.to(dev, non_blocking=True), prev.to(dev, non_blocking=True), gold.to(dev, non_blocking=True)


class HeadlineModel(nn.Module):
    def __init__(self, vocab, d=512, h=8, ffn=2048, n=6, p=0.1, ckpt_act=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Embedding(256, d)
        self.enc = nn.ModuleList(nn.TransformerEncoderLayer(d, h, ffn, p, batch_first=True, norm_first=True)
                                 for _ in range(n))
        self.dec = nn.ModuleList(nn.TransformerDecoderLayer(d, h, ffn, p, batch_first=True, norm_first=True)
                                 for _ in range(n))
        self.ln_e, self.ln_d = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop, self.scale, self.ckpt_act = nn.Dropout(p), math.sqrt(d), ckpt_act

    def _run(self, layer, *xs, **kw):
        if self.ckpt_act and self.training:
            return checkpoint(layer, *xs, use_reentrant=False, **kw)
        return layer(*xs, **kw)

    def _in(self, x):
        return self.drop(self.emb(x) * self.scale + self.pos(torch.arange(x.size(1), device=x.device)))

    def encode(self, src):
        m = src.eq(PAD)
        x = self._in(src)
        for layer in self.enc:
            x = self._run(layer, x, src_key_padding_mask=m)
        return self.ln_e(x), m

    def decode(self, prev, mem, m):
        T = prev.size(1)
        causal = torch.triu(torch.full((T, T), float("-inf"), device=prev.device), 1)
        y = self._in(prev)
        for layer in self.dec:
            y = self._run(layer, y, mem, tgt_mask=causal, tgt_key_padding_mask=prev.eq(PAD),
                          memory_key_padding_mask=m)
        return F.linear(self.ln_d(y), self.emb.weight)

    def forward(self, src, prev):
        return self.decode(prev, *self.encode(src))


def loss_fn(logits, gold, eps=0.1):
    lp = F.log_softmax(logits.float(), -1)
    keep = gold.ne(PAD)
    nll = -lp.gather(-1, gold.unsqueeze(-1)).squeeze(-1)[keep]
    eps_i = eps / (lp.size(-1) - 1)
    return ((1 - eps - eps_i) * nll - eps_i * lp.sum(-1)[keep]).sum(), nll.sum(), keep.sum()


@torch.no_grad()
def greedy(net, src, max_len=40):
    mem, m = net.encode(src)
    ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
    for _ in range(max_len):
        ys = torch.cat([ys, net.decode(ys, mem, m)[:, -1].argmax(-1, keepdim=True)], 1)
        if ys.eq(EOS).any(1).all():
            break
    return [r[: r.index(EOS)] if EOS in r else r for r in ys[:, 1:].tolist()]


def strip_module(sd):
    return collections.OrderedDict((k[len("module."):] if k.startswith("module.") else k, v) for k, v in sd.items())


def main():
    args = get_args()
    # rank 0 may spend a while binarizing on the first run; the others wait at the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(5)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    cache = os.path.join(args.data, "binarized.pt")
    if rank == 0 and not os.path.exists(cache):
        build_cache(args.data, sp, cache)
    dist.barrier()
    data = torch.load(cache, weights_only=False)
    train, valid = data["train"], data["valid"]

    lens = np.array([max(len(s), len(t)) + 1 for s, t in zip(train["src"], train["tgt"])])
    batches = token_batches(lens, args.max_tokens)
    update_freq = max(1, args.tokens_per_update // (args.max_tokens * world))

    model = DDP(HeadlineModel(sp.get_piece_size(), ckpt_act=args.checkpoint_activations).to(dev),
                device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    W = args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / W, math.sqrt(W / (s + 1))))
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"{len(batches)} batches | update_freq {update_freq} | world {world}", flush=True)

    updates, epoch, saved = 0, 0, []
    while updates < args.max_update:
        epoch += 1
        perm = np.random.RandomState(epoch).permutation(len(batches))
        n = len(perm) // (world * update_freq) * (world * update_freq)
        mine = [batches[j] for j in perm[:n][rank::world]]
        model.train()
        t0 = time.time()
        for i, idx in enumerate(mine):
            src, prev, gold = tensors(train, idx, dev)
            last = (i + 1) % update_freq == 0
            with contextlib.nullcontext() if last else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(src, prev)
                loss, nll, ntok = loss_fn(logits, gold)
                (loss / ntok / update_freq).backward()
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            updates += 1
            if rank == 0 and updates % 100 == 0:
                print(f"ep {epoch} upd {updates} nll {(nll / ntok).item():.3f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{time.time() - t0:.0f}s", flush=True)

            if updates % args.save_interval_updates == 0:
                net = model.module
                net.eval()
                sums = torch.zeros(4, device=dev)
                for k in range(rank * 100, min(len(valid["src"]), 4000), world * 100):
                    idx = list(range(k, min(k + 100, len(valid["src"]))))
                    src_v, _, _ = tensors(valid, idx, dev)
                    for ids, j in zip(greedy(net, src_v), idx):
                        sc = scorer.score(valid["raw"][j], sp.decode(ids))
                        sums += torch.tensor([sc["rouge1"].fmeasure, sc["rouge2"].fmeasure,
                                              sc["rougeL"].fmeasure, 1.0], device=dev)
                dist.all_reduce(sums)
                net.train()
                if rank == 0:
                    r = (100 * sums[:3] / sums[3]).tolist()
                    print(f"| valid upd {updates} | R1 {r[0]:.2f} R2 {r[1]:.2f} RL {r[2]:.2f} | n={int(sums[3])}",
                          flush=True)
                    path = os.path.join(args.save_dir, f"checkpoint_{updates}.pt")
                    torch.save({"model": model.state_dict(), "updates": updates}, path)
                    saved.append(path)
                dist.barrier()
            if updates >= args.max_update:
                break

    if rank == 0:
        last_paths = saved[-args.average_last:]
        avg = None
        for p in last_paths:
            sd = strip_module(torch.load(p, map_location="cpu")["model"])
            if avg is None:
                avg = {k: v.double() for k, v in sd.items()}
            else:
                for k in avg:
                    avg[k] += sd[k].double()
        avg = {k: (v / len(last_paths)).float() for k, v in avg.items()}
        HeadlineModel(sp.get_piece_size()).load_state_dict(avg)  # sanity check: keys match the bare model
        torch.save({"model": avg, "averaged": last_paths}, os.path.join(args.save_dir, "checkpoint_avg.pt"))
        print(f"averaged {len(last_paths)} checkpoints", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
