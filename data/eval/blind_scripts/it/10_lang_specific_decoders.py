"""Shared encoder / language-specific decoders for English -> {Hindi, Bengali, Tamil, Telugu, Marathi}.

One step = one target language for all ranks (sampled with temperature), so the batch for
each rank has a single decoder. Data: Samanantar-style `train.en-xx.{en,xx}` files.

torchrun --nproc_per_node=8 10_lang_specific_decoders.py --cfg cfg/indic_o2m.json
"""
import argparse
import json
import math
import os
import random

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

DEFAULTS = {
    "data_dir": "data/samanantar",
    "spm": "data/samanantar/spm_indic_64k.model",
    "langs": ["hi", "bn", "ta", "te", "mr"],
    "temperature": 3.0,
    "batch_size": 64,
    "updates": 200000,
    "eval_every": 5000,
    "lr": 5e-4,
    "warmup": 4000,
    "d_model": 512,
    "enc_layers": 6,
    "dec_layers": 3,
    "max_len": 200,
    "out": "exp/indic_o2m_decoders",
    "seed": 3,
}
PAD, BOS, EOS = 0, 1, 2


class Bitext(Dataset):
    def __init__(self, prefix, tgt_lang, sp, max_len):
        with open(prefix + ".en", encoding="utf-8") as f:
            self.src = [sp.encode(l.strip())[: max_len - 1] + [EOS] for l in f]
        with open(prefix + "." + tgt_lang, encoding="utf-8") as f:
            self.tgt = [[BOS] + sp.encode(l.strip())[: max_len - 2] + [EOS] for l in f]
        assert len(self.src) == len(self.tgt), prefix

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return self.src[i], self.tgt[i]


def pad_batch(batch):
    def pad(seqs):
        t = torch.full((len(seqs), max(map(len, seqs))), PAD, dtype=torch.long)
        for i, s in enumerate(seqs):
            t[i, : len(s)] = torch.as_tensor(s)
        return t
    return pad([b[0] for b in batch]), pad([b[1] for b in batch])


class MultiDecoderNMT(nn.Module):
    def __init__(self, vocab, langs, d=512, enc_layers=6, dec_layers=3, heads=8, ff=2048, drop=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Embedding(512, d)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d, heads, ff, drop, batch_first=True, norm_first=True),
            enc_layers, norm=nn.LayerNorm(d))
        self.decoders = nn.ModuleDict({
            lang: nn.TransformerDecoder(
                nn.TransformerDecoderLayer(d, heads, ff, drop, batch_first=True, norm_first=True),
                dec_layers, norm=nn.LayerNorm(d))
            for lang in langs})
        self.scale = math.sqrt(d)

    def _emb(self, x):
        return self.embed(x) * self.scale + self.pos(torch.arange(x.size(1), device=x.device))

    def encode(self, src):
        return self.encoder(self._emb(src), src_key_padding_mask=src.eq(PAD))

    def decode(self, lang, tgt_in, memory, src):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=tgt_in.device)
        h = self.decoders[lang](self._emb(tgt_in), memory, tgt_mask=causal,
                                tgt_key_padding_mask=tgt_in.eq(PAD),
                                memory_key_padding_mask=src.eq(PAD))
        return F.linear(h, self.embed.weight)

    def forward(self, src, tgt_in, lang):
        return self.decode(lang, tgt_in, self.encode(src), src)


@torch.no_grad()
def greedy(model, src, lang, max_len):
    mem = model.encode(src)
    ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
    done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        nxt = model.decode(lang, ys, mem, src)[:, -1].argmax(-1).masked_fill(done, PAD)
        ys = torch.cat([ys, nxt[:, None]], 1)
        done |= nxt.eq(EOS)
        if done.all():
            break
    return ys[:, 1:].tolist()


def lang_probs(sizes, T):
    total = sum(sizes.values())
    w = {l: (n / total) ** (1.0 / T) for l, n in sizes.items()}
    z = sum(w.values())
    return {l: v / z for l, v in w.items()}


def batch_stream(ds, cfg, rank, world):
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(ds, batch_size=cfg["batch_size"], sampler=sampler, collate_fn=pad_batch,
                        num_workers=1, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def evaluate(model, dev, refs, sp, cfg, rank, world, device):
    model.eval()
    mine = {}
    for lang, ds in dev.items():
        out = []
        idx = list(range(rank, len(ds), world))
        for b in range(0, len(idx), 100):
            ids = idx[b : b + 100]
            src, _ = pad_batch([ds[i] for i in ids])
            for i, h in zip(ids, greedy(model, src.to(device), lang, cfg["max_len"])):
                out.append((i, sp.decode([t for t in (h[: h.index(EOS)] if EOS in h else h) if t != PAD])))
        mine[lang] = out
    allp = [None] * world
    dist.all_gather_object(allp, mine)
    model.train()
    res = {}
    for lang in dev:
        d = dict(x for p in allp for x in p[lang])
        hyps = [d[i] for i in range(len(dev[lang]))]
        res[lang] = (sacrebleu.corpus_bleu(hyps, [refs[lang]], tokenize="flores200").score,
                     sacrebleu.corpus_chrf(hyps, [refs[lang]], word_order=2).score)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.cfg:
        with open(a.cfg) as f:
            cfg.update(json.load(f))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    sp = spm.SentencePieceProcessor(model_file=cfg["spm"])
    langs = cfg["langs"]
    train = {l: Bitext(os.path.join(cfg["data_dir"], f"train.en-{l}"), l, sp, cfg["max_len"]) for l in langs}
    dev = {l: Bitext(os.path.join(cfg["data_dir"], f"dev.en-{l}"), l, sp, cfg["max_len"]) for l in langs}
    refs = {}
    for l in langs:
        with open(os.path.join(cfg["data_dir"], f"dev.en-{l}.{l}"), encoding="utf-8") as f:
            refs[l] = [x.strip() for x in f]
    streams = {l: batch_stream(train[l], cfg, rank, world) for l in langs}
    probs = lang_probs({l: len(train[l]) for l in langs}, cfg["temperature"])
    lang_rng = random.Random(cfg["seed"])  # same sequence on every rank

    model = MultiDecoderNMT(sp.get_piece_size(), langs, d=cfg["d_model"],
                            enc_layers=cfg["enc_layers"], dec_layers=cfg["dec_layers"]).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / cfg["warmup"], math.sqrt(cfg["warmup"] / (s + 1))))

    tb = SummaryWriter(os.path.join(cfg["out"], "tb")) if rank == 0 else None
    if rank == 0:
        print("language sampling:", {l: round(p, 3) for l, p in probs.items()}, flush=True)
    best = -1.0
    acc = torch.zeros(2, device=device)
    for update in range(1, cfg["updates"] + 1):
        lang = lang_rng.choices(langs, weights=[probs[l] for l in langs])[0]
        src, tgt = next(streams[lang])
        src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(src, tgt[:, :-1], lang)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD,
                               label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        acc += torch.stack([loss.detach(), torch.ones((), device=device)])

        if update % 200 == 0:
            dist.all_reduce(acc)
            if rank == 0:
                tb.add_scalar("train/loss", (acc[0] / acc[1]).item(), update)
                tb.add_scalar("train/lr", sched.get_last_lr()[0], update)
            acc.zero_()

        if update % cfg["eval_every"] == 0:
            res = evaluate(model.module, dev, refs, sp, cfg, rank, world, device)
            avg_chrf = sum(c for _, c in res.values()) / len(res)
            if rank == 0:
                for l, (b, c) in res.items():
                    tb.add_scalar(f"dev/bleu_{l}", b, update)
                    tb.add_scalar(f"dev/chrf_{l}", c, update)
                print(f"update {update}: " + ", ".join(f"{l} {b:.1f}/{c:.1f}" for l, (b, c) in res.items()),
                      flush=True)
                state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "update": update,
                         "cfg": cfg}
                os.makedirs(cfg["out"], exist_ok=True)
                torch.save(state, os.path.join(cfg["out"], "last.pt"))
                if avg_chrf > best:
                    best = avg_chrf
                    torch.save(state, os.path.join(cfg["out"], "best.pt"))
            dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
