"""Single-node NMT trainer started with torch.multiprocessing.spawn (no torchrun on this cluster).

- rank 0 trains the SentencePiece model and binarizes the corpus; the others wait
- batches are bucketed by length over the *whole* corpus with a shared seed, and the
  list of batches is split across ranks, so every rank gets the same number of batches
- dev BLEU is computed from sacrebleu statistics summed over ranks

    python 18_spawn_spm_bucketed.py --data data/wmt17_zh_en --gpus 8
"""
import argparse
import math
import os
import random
from contextlib import nullcontext
from datetime import timedelta

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from sacrebleu.metrics import BLEU
from torch.nn.parallel import DistributedDataParallel as DDP

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)           # train.zh / train.en / dev.zh / dev.en
    ap.add_argument("--src", default="zh")
    ap.add_argument("--tgt", default="en")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-tokens", type=int, default=6000)
    ap.add_argument("--update-freq", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=25)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--out", default="exp/zh-en")
    ap.add_argument("--port", default="29533")
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def prepare_data(args):
    """Runs on rank 0 only: SentencePiece + binarized tensors, written atomically."""
    prefix = os.path.join(args.out, "spm")
    if not os.path.exists(prefix + ".model"):
        spm.SentencePieceTrainer.train(
            input=[os.path.join(args.data, f"train.{l}") for l in (args.src, args.tgt)],
            model_prefix=prefix, vocab_size=args.vocab, character_coverage=0.9995,
            pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, input_sentence_size=5_000_000,
            shuffle_input_sentence=True)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    for split in ("train", "dev"):
        path = os.path.join(args.out, f"{split}.bin.pt")
        if os.path.exists(path):
            continue
        data = {}
        for side, lang in (("src", args.src), ("tgt", args.tgt)):
            with open(os.path.join(args.data, f"{split}.{lang}"), encoding="utf-8") as f:
                data[side] = [torch.tensor(sp.encode(l.strip())[:254], dtype=torch.int32) for l in f]
        torch.save(data, path + ".tmp")
        os.replace(path + ".tmp", path)


def global_batches(src, tgt, max_tokens, seed):
    lengths = [max(len(s), len(t)) + 2 for s, t in zip(src, tgt)]
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches, cur, longest = [], [], 0
    for i in order:
        longest_new = max(longest, lengths[i])
        if cur and longest_new * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest_new = [], lengths[i]
        cur.append(i)
        longest = longest_new
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def to_tensors(ids, src, tgt, device):
    s = [torch.cat([src[i].long(), torch.tensor([EOS])]) for i in ids]
    t = [torch.cat([torch.tensor([BOS]), tgt[i].long(), torch.tensor([EOS])]) for i in ids]
    pad = lambda xs: nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=PAD).to(device, non_blocking=True)
    return pad(s), pad(t)


class NMT(nn.Module):
    def __init__(self, vocab, d=512, layers=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        self.pos = nn.Embedding(512, d)
        self.tf = nn.Transformer(d, 8, layers, layers, 2048, 0.1, batch_first=True, norm_first=True)
        self.d = d

    def e(self, x):
        return self.emb(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device))

    def forward(self, src, tgt_in):
        m = self.tf.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        h = self.tf(self.e(src), self.e(tgt_in), tgt_mask=m, src_key_padding_mask=src.eq(PAD),
                    tgt_key_padding_mask=tgt_in.eq(PAD), memory_key_padding_mask=src.eq(PAD))
        return F.linear(h, self.emb.weight)

    @torch.no_grad()
    def greedy(self, src, max_len=200):
        mem = self.tf.encoder(self.e(src), src_key_padding_mask=src.eq(PAD))
        ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            m = self.tf.generate_square_subsequent_mask(ys.size(1), device=src.device)
            h = self.tf.decoder(self.e(ys), mem, tgt_mask=m, memory_key_padding_mask=src.eq(PAD))
            nxt = F.linear(h[:, -1], self.emb.weight).argmax(-1).masked_fill(done, PAD)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt.eq(EOS)
            if done.all():
                break
        return ys[:, 1:].tolist()


def dev_bleu(model, dev, dev_refs, sp, rank, world, device):
    model.eval()
    mine = list(range(rank, len(dev["src"]), world))
    hyps, refs = [], []
    for b in range(0, len(mine), 64):
        ids = mine[b : b + 64]
        src, _ = to_tensors(ids, dev["src"], dev["tgt"], device)
        for i, h in zip(ids, model.greedy(src)):
            hyps.append(sp.decode([t for t in (h[: h.index(EOS)] if EOS in h else h) if t != PAD]))
            refs.append(dev_refs[i])
    model.train()
    st = sacrebleu.corpus_bleu(hyps, [refs])
    stats = torch.tensor(st.counts + st.totals + [st.sys_len, st.ref_len], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    s = [int(x) for x in stats.tolist()]
    return BLEU.compute_bleu(s[0:4], s[4:8], s[8], s[9], smooth_method="exp").score


def worker(rank, world_size, args):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timedelta(hours=2))
    device = torch.device("cuda", rank)
    torch.manual_seed(0)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        prepare_data(args)
    dist.barrier()
    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.out, "spm.model"))
    train = torch.load(os.path.join(args.out, "train.bin.pt"))
    dev = torch.load(os.path.join(args.out, "dev.bin.pt"))
    with open(os.path.join(args.data, f"dev.{args.tgt}"), encoding="utf-8") as f:
        dev_refs = [l.strip() for l in f]

    model = NMT(sp.get_piece_size()).to(device)
    start_epoch, step = 0, 0
    ckpt_path = os.path.join(args.out, "checkpoint_last.pt")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.load_state_dict(ckpt["model"])
        start_epoch, step = ckpt["epoch"] + 1, ckpt["step"]
    model = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    if args.resume and os.path.exists(ckpt_path):
        opt.load_state_dict(ckpt["opt"])

    best = -1.0
    for epoch in range(start_epoch, args.epochs):
        batches = global_batches(train["src"], train["tgt"], args.max_tokens, seed=1000 + epoch)
        usable = len(batches) - len(batches) % (world_size * args.update_freq)
        mine = batches[:usable][rank::world_size]
        tot = torch.zeros(2, device=device)
        for i, ids in enumerate(mine):
            src, tgt = to_tensors(ids, train["src"], train["tgt"], device)
            boundary = (i + 1) % args.update_freq == 0
            with (nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(src, tgt[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=PAD,
                                       label_smoothing=0.1, reduction="sum")
                ntok = tgt[:, 1:].ne(PAD).sum()
                (loss / ntok / args.update_freq).backward()
            tot += torch.stack([loss.detach(), ntok.float()])
            if boundary:
                step += 1
                for g in opt.param_groups:
                    g["lr"] = args.lr * min(step / args.warmup, math.sqrt(args.warmup / step))
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if step % 100 == 0:
                    dist.all_reduce(tot)
                    if rank == 0:
                        print(f"epoch {epoch} update {step} nll/tok {(tot[0] / tot[1]).item():.3f}", flush=True)
                    tot.zero_()

        bleu = dev_bleu(model.module, dev, dev_refs, sp, rank, world_size, device)
        if rank == 0:
            print(f"epoch {epoch} dev BLEU {bleu:.2f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step,
                     "bleu": bleu}
            torch.save(state, ckpt_path)
            if bleu > best:
                best = bleu
                torch.save(state, os.path.join(args.out, "checkpoint_best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
