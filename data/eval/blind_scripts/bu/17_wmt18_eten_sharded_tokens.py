"""WMT18 Et->En transformer-base with per-worker max-tokens batching.

Every worker takes a strided shard of the corpus and packs it into
length-bucketed batches of at most --max-tokens (padded) tokens.

    torchrun --nproc_per_node=4 17_wmt18_eten_sharded_tokens.py --data data/wmt18_eten --update-freq 4
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

PAD, BOS, EOS = 0, 1, 2


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save-dir", default="checkpoints/eten")
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--update-freq", type=int, default=1)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--max-epoch", type=int, default=50)
    ap.add_argument("--patience", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    return ap.parse_args()


def read_corpus(prefix, sp):
    with open(prefix + ".et", encoding="utf-8") as f:
        et = f.read().splitlines()
    with open(prefix + ".en", encoding="utf-8") as f:
        en = f.read().splitlines()
    pairs = []
    for a, b in zip(et, en):
        s, t = sp.encode(a)[:254], sp.encode(b)[:254]
        if s and t:
            pairs.append((s, t, b))
    return pairs


def bucket_batches(pairs, indices, max_tokens, rng):
    lens = np.array([max(len(pairs[i][0]), len(pairs[i][1])) + 1 for i in indices])
    order = [indices[j] for j in np.argsort(lens + rng.uniform(0, 1, size=len(lens)), kind="stable")]
    batches, cur, longest = [], [], 0
    for i in order:
        n = max(len(pairs[i][0]), len(pairs[i][1])) + 1
        if cur and max(longest, n) * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def make_tensors(pairs, idx, device):
    S = max(len(pairs[i][0]) for i in idx) + 1
    T = max(len(pairs[i][1]) for i in idx) + 1
    src = torch.full((len(idx), S), PAD, dtype=torch.long)
    prev = torch.full((len(idx), T), PAD, dtype=torch.long)
    gold = torch.full((len(idx), T), PAD, dtype=torch.long)
    for k, i in enumerate(idx):
        s, t, _ = pairs[i]
        src[k, : len(s) + 1] = torch.tensor(s + [EOS])
        prev[k, : len(t) + 1] = torch.tensor([BOS] + t)
        gold[k, : len(t) + 1] = torch.tensor(t + [EOS])
    return src.to(device), prev.to(device), gold.to(device)


class Transformer(nn.Module):
    def __init__(self, vocab, d=512, h=8, f=2048, n=6, p=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, 0.0, d ** -0.5)
        self.pos = nn.Embedding(256, d)
        self.tf = nn.Transformer(d, h, n, n, f, p, batch_first=True, norm_first=True)
        self.drop = nn.Dropout(p)
        self.scale = d ** 0.5

    def _x(self, t):
        return self.drop(self.embed(t) * self.scale + self.pos(torch.arange(t.size(1), device=t.device)))

    def encode(self, src):
        return self.tf.encoder(self._x(src), src_key_padding_mask=src.eq(PAD))

    def decode(self, prev, mem, src):
        mask = self.tf.generate_square_subsequent_mask(prev.size(1), device=prev.device)
        out = self.tf.decoder(self._x(prev), mem, tgt_mask=mask, tgt_key_padding_mask=prev.eq(PAD),
                              memory_key_padding_mask=src.eq(PAD))
        return F.linear(out, self.embed.weight)

    def forward(self, src, prev):
        return self.decode(prev, self.encode(src), src)


def ls_criterion(logits, gold, eps=0.1):
    lp = F.log_softmax(logits, -1, dtype=torch.float32)
    keep = gold.ne(PAD)
    nll = -lp.gather(-1, gold.unsqueeze(-1)).squeeze(-1)[keep].sum()
    smooth = -lp.sum(-1)[keep].sum()
    eps_i = eps / (lp.size(-1) - 1)
    return (1 - eps - eps_i) * nll + eps_i * smooth, nll, keep.sum()


@torch.no_grad()
def beam_search(net, src, k=4, max_len=200):
    B = src.size(0)
    mem = net.encode(src).repeat_interleave(k, 0)
    srck = src.repeat_interleave(k, 0)
    ys = torch.full((B * k, 1), BOS, dtype=torch.long, device=src.device)
    sc = torch.zeros(B, k, device=src.device)
    sc[:, 1:] = -1e9
    fin = torch.zeros(B * k, dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        lp = F.log_softmax(net.decode(ys, mem, srck)[:, -1], -1, dtype=torch.float32)
        lp[fin] = -1e9
        lp[fin, EOS] = 0
        V = lp.size(-1)
        sc, ix = (sc.reshape(-1, 1) + lp).view(B, -1).topk(k, -1)
        orig = (ix // V + k * torch.arange(B, device=src.device)[:, None]).view(-1)
        ys = torch.cat([ys[orig], (ix % V).view(-1, 1)], 1)
        fin = fin[orig] | ys[:, -1].eq(EOS)
        if fin.all():
            break
    L = (ys[:, 1:].ne(EOS).sum(1) + 1).float().view(B, k)
    return ys.view(B, k, -1)[torch.arange(B), (sc / L).argmax(1), 1:].tolist()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "sp.model"))
    train = read_corpus(os.path.join(args.data, "train"), sp)
    dev = read_corpus(os.path.join(args.data, "newsdev2018"), sp)
    my_indices = list(range(rank, len(train), world))

    net = Transformer(sp.get_piece_size()).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    W = args.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / W, (W / (s + 1)) ** 0.5))
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    best_bleu, bad_epochs, updates = -1.0, 0, 0
    for epoch in range(1, args.max_epoch + 1):
        rng = np.random.RandomState(args.seed * 1000 + epoch * 10 + rank)
        batches = bucket_batches(train, my_indices, args.max_tokens, rng)
        model.train()
        t0 = time.time()
        for i, idx in enumerate(batches):
            src, prev, gold = make_tensors(train, idx, device)
            sync = (i + 1) % args.update_freq == 0 or i + 1 == len(batches)
            with contextlib.nullcontext() if sync else model.no_sync():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(src, prev)
                loss, nll, ntok = ls_criterion(logits, gold)
                (loss / ntok / args.update_freq).backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            updates += 1
            if rank == 0 and updates % 100 == 0:
                print(f"| epoch {epoch:03d} | {i + 1}/{len(batches)} | upd {updates} | "
                      f"nll {(nll / ntok).item():.3f} | lr {sched.get_last_lr()[0]:.2e} | {time.time() - t0:.0f}s",
                      flush=True)

        # dev BLEU on rank 0, everyone gets the decision about early stopping
        stop = torch.zeros(1, device=device)
        if rank == 0:
            net.eval()
            hyps, refs = [], []
            for start in range(0, len(dev), 64):
                chunk = list(range(start, min(start + 64, len(dev))))
                src, _, _ = make_tensors(dev, chunk, device)
                for row in beam_search(net, src):
                    hyps.append(sp.decode(row[: row.index(EOS)] if EOS in row else row))
                refs += [dev[j][2] for j in chunk]
            net.train()
            bleu = sacrebleu.corpus_bleu(hyps, [refs]).score
            print(f"| epoch {epoch:03d} | newsdev2018 BLEU {bleu:.2f}", flush=True)
            state = {"model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch, "bleu": bleu}
            torch.save(state, os.path.join(args.save_dir, "checkpoint_last.pt"))
            if bleu > best_bleu:
                best_bleu, bad_epochs = bleu, 0
                torch.save(state, os.path.join(args.save_dir, "checkpoint_best.pt"))
            else:
                bad_epochs += 1
            stop[0] = float(bad_epochs >= args.patience)
        dist.broadcast(stop, src=0)
        if stop.item():
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
