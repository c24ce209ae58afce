"""One-to-many multilingual NMT (en -> xx) with language-specific decoder adapters.

Language pairs are sampled with temperature T (p_l ~ n_l^(1/T)); every step on every
rank is a single-language batch, so only that language's adapters are used in it.

torchrun --nproc_per_node=8 04_multilingual_adapters_temp.py \
    --data data/opus100 --langs de,fr,ro,tr,gu,kk --spm data/opus100/spm64k.model
"""
import argparse
import math
import os
import random

import numpy as np
import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP

PAD, BOS, EOS = 0, 1, 2


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--langs", required=True)
    ap.add_argument("--spm", required=True)
    ap.add_argument("--out", default="exp/o2m_adapters")
    ap.add_argument("--temperature", type=float, default=5.0)
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--steps-per-epoch", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=8000)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--adapter-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


def load_pair(path_prefix, lang, sp, max_len):
    with open(f"{path_prefix}.en", encoding="utf-8") as f_src, open(f"{path_prefix}.{lang}", encoding="utf-8") as f_tgt:
        tag = sp.piece_to_id(f"<2{lang}>")
        data = []
        for s, t in zip(f_src, f_tgt):
            src = [tag] + sp.encode(s.strip())[: max_len - 2] + [EOS]
            tgt = [BOS] + sp.encode(t.strip())[: max_len - 2] + [EOS]
            data.append((src, tgt))
    return data


def pad(seqs):
    out = torch.full((len(seqs), max(len(s) for s in seqs)), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out


def temperature_probs(sizes, T):
    p = np.array(sizes, dtype=np.float64)
    p = (p / p.sum()) ** (1.0 / T)
    return p / p.sum()


class LangShardIterator:
    """Endless batches from one language pair, restricted to this rank's shard."""

    def __init__(self, data, batch_size, rank, world, seed):
        order = list(range(len(data)))
        random.Random(seed).shuffle(order)
        self.data = data
        self.ids = order[rank::world]
        self.bsz = batch_size
        self.rng = random.Random(seed + 1000 * rank)
        self.pos = len(self.ids)

    def next(self):
        if self.pos + self.bsz > len(self.ids):
            self.rng.shuffle(self.ids)
            self.pos = 0
        chunk = [self.data[i] for i in self.ids[self.pos : self.pos + self.bsz]]
        self.pos += self.bsz
        return pad([s for s, _ in chunk]), pad([t for _, t in chunk])


class Adapter(nn.Module):
    def __init__(self, d, r):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.down = nn.Linear(d, r)
        self.up = nn.Linear(r, d)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x):
        return x + self.up(F.relu(self.down(self.norm(x))))


class AdapterTransformer(nn.Module):
    def __init__(self, vocab, langs, d=512, layers=6, heads=8, ff=2048, r=128, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Embedding(1024, d)
        enc_layer = nn.TransformerEncoderLayer(d, heads, ff, dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(enc_layer, layers, norm=nn.LayerNorm(d))
        self.dec_layers = nn.ModuleList(
            nn.TransformerDecoderLayer(d, heads, ff, dropout, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.adapters = nn.ModuleDict({l: nn.ModuleList(Adapter(d, r) for _ in range(layers)) for l in langs})
        self.dec_norm = nn.LayerNorm(d)
        self.scale = math.sqrt(d)

    def emb(self, x):
        return self.embed(x) * self.scale + self.pos(torch.arange(x.size(1), device=x.device))

    def encode(self, src):
        mask = src.eq(PAD)
        return self.encoder(self.emb(src), src_key_padding_mask=mask), mask

    def decode(self, tgt_in, mem, mem_mask, lang):
        T = tgt_in.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=tgt_in.device), 1)
        h = self.emb(tgt_in)
        for layer, adapter in zip(self.dec_layers, self.adapters[lang]):
            h = layer(h, mem, tgt_mask=causal, memory_key_padding_mask=mem_mask)
            h = adapter(h)
        return F.linear(self.dec_norm(h), self.embed.weight)

    def forward(self, src, tgt_in, lang):
        mem, mask = self.encode(src)
        return self.decode(tgt_in, mem, mask, lang)


@torch.no_grad()
def greedy(model, src, lang, max_len):
    mem, mask = model.encode(src)
    ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
    fin = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        nxt = model.decode(ys, mem, mask, lang)[:, -1].argmax(-1).masked_fill(fin, PAD)
        ys = torch.cat([ys, nxt[:, None]], 1)
        fin |= nxt.eq(EOS)
        if fin.all():
            break
    return ys[:, 1:].tolist()


def evaluate(model, dev, dev_refs, sp, rank, world, device, max_len):
    model.eval()
    local = {}
    for lang, data in dev.items():
        mine = list(range(rank, len(data), world))
        out = []
        for b in range(0, len(mine), 64):
            idx = mine[b : b + 64]
            src = pad([data[i][0] for i in idx]).to(device)
            for i, h in zip(idx, greedy(model, src, lang, max_len)):
                h = h[: h.index(EOS)] if EOS in h else h
                out.append((i, sp.decode([t for t in h if t != PAD])))
        local[lang] = out
    parts = [None] * world
    dist.all_gather_object(parts, local)
    model.train()
    if rank != 0:
        return None
    scores = {}
    for lang in dev:
        hyp = dict(kv for p in parts for kv in p[lang])
        hyps = [hyp[i] for i in range(len(dev[lang]))]
        scores[f"bleu/en-{lang}"] = sacrebleu.corpus_bleu(hyps, [dev_refs[lang]]).score
        scores[f"chrf/en-{lang}"] = sacrebleu.corpus_chrf(hyps, [dev_refs[lang]]).score
    scores["bleu/avg"] = float(np.mean([scores[f"bleu/en-{l}"] for l in dev]))
    return scores


def main():
    args = parse()
    langs = args.langs.split(",")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=args.spm)
    train = {l: load_pair(os.path.join(args.data, f"train.en-{l}"), l, sp, args.max_len) for l in langs}
    dev = {l: load_pair(os.path.join(args.data, f"dev.en-{l}"), l, sp, args.max_len) for l in langs}
    dev_refs = {}
    for l in langs:
        with open(os.path.join(args.data, f"dev.en-{l}.{l}"), encoding="utf-8") as f:
            dev_refs[l] = [x.strip() for x in f]

    probs = temperature_probs([len(train[l]) for l in langs], args.temperature)
    iters = {l: LangShardIterator(train[l], args.batch_size, rank, world, args.seed) for l in langs}
    lang_rng = np.random.default_rng(args.seed + rank)

    model = AdapterTransformer(sp.get_piece_size(), langs, d=args.d_model, layers=args.layers,
                               r=args.adapter_dim)
    start_epoch = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        start_epoch = ckpt["epoch"] + 1
    model = DDP(model.to(device), device_ids=[local_rank], find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, math.sqrt(args.warmup / (s + 1))))
    if args.resume:
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="o2m-adapters", config=vars(args) | {"world_size": world},
                   name=os.path.basename(args.out))
        print("sampling probs:", dict(zip(langs, np.round(probs, 3))))

    best = -1.0
    for epoch in range(start_epoch, args.epochs):
        model.train()
        tot = torch.zeros(2, device=device)
        for step in range(args.steps_per_epoch):
            lang = langs[lang_rng.choice(len(langs), p=probs)]
            src, tgt = iters[lang].next()
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(src, tgt[:, :-1], lang)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(),
                                   ignore_index=PAD, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
            if (step + 1) % 500 == 0:
                dist.all_reduce(tot)
                if rank == 0:
                    wandb.log({"train/loss": (tot[0] / tot[1]).item(), "lr": sched.get_last_lr()[0]},
                              step=epoch * args.steps_per_epoch + step + 1)
                tot.zero_()

        scores = evaluate(model.module, dev, dev_refs, sp, rank, world, device, args.max_len)
        if rank == 0:
            wandb.log(scores, step=(epoch + 1) * args.steps_per_epoch)
            print(f"epoch {epoch}: " + " ".join(f"{k}={v:.2f}" for k, v in scores.items()), flush=True)
            ckpt = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "epoch": epoch}
            torch.save(ckpt, os.path.join(args.out, "last.pt"))
            if scores["bleu/avg"] > best:
                best = scores["bleu/avg"]
                torch.save(ckpt, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
