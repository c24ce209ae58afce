"""KFTT Ja->En transformer with beam-search validation every N updates.

    torchrun --standalone --nproc_per_node=4 08_kftt_jaen_beam.py --data data/kftt --out exp/kftt_base
"""
import argparse
import json
import math
import os
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="base", choices=["small", "base"])
    p.add_argument("--batch-size", type=int, default=80)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup", type=int, default=4000)
    p.add_argument("--max-updates", type=int, default=60000)
    p.add_argument("--valid-every", type=int, default=3000)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--len-penalty", type=float, default=0.6)
    p.add_argument("--smoothing", type=float, default=0.1)
    return p


ARCHS = {
    "small": dict(d=256, heads=4, ffn=1024, layers=3, dropout=0.3),
    "base": dict(d=512, heads=8, ffn=2048, layers=6, dropout=0.2),
}


class Corpus(Dataset):
    def __init__(self, root, split, sp_ja, sp_en):
        with open(f"{root}/kyoto-{split}.ja") as f:
            ja = [l.strip() for l in f]
        with open(f"{root}/kyoto-{split}.en") as f:
            en = [l.strip() for l in f]
        self.rows = [(sp_ja.encode(a)[:200], sp_en.encode(b)[:200], b) for a, b in zip(ja, en) if a and b]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(rows, pad=0, bos=1, eos=2):
    def pad_to(seqs):
        t = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            t[i, : len(s)] = torch.tensor(s)
        return t
    src = pad_to([r[0] + [eos] for r in rows])
    dec_in = pad_to([[bos] + r[1] for r in rows])
    dec_out = pad_to([r[1] + [eos] for r in rows])
    return src, dec_in, dec_out, [r[2] for r in rows]


class NMTModel(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, d, heads, ffn, layers, dropout, pad=0, bos=1, eos=2):
        super().__init__()
        self.pad, self.bos, self.eos = pad, bos, eos
        self.src_tok = nn.Embedding(src_vocab, d, padding_idx=pad)
        self.tgt_tok = nn.Embedding(tgt_vocab, d, padding_idx=pad)
        self.pos = nn.Embedding(512, d)
        self.tf = nn.Transformer(d, heads, layers, layers, ffn, dropout, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.d = d

    def _emb(self, tok, x):
        return self.drop(tok(x) * math.sqrt(self.d) + self.pos(torch.arange(x.size(1), device=x.device)))

    def encode(self, src):
        m = src.eq(self.pad)
        return self.tf.encoder(self._emb(self.src_tok, src), src_key_padding_mask=m), m

    def decode(self, y, mem, m):
        T = y.size(1)
        causal = torch.triu(torch.ones(T, T, device=y.device, dtype=torch.bool), 1)
        h = self.tf.decoder(self._emb(self.tgt_tok, y), mem, tgt_mask=causal,
                            tgt_key_padding_mask=y.eq(self.pad), memory_key_padding_mask=m)
        return h @ self.tgt_tok.weight.t()

    def forward(self, src, dec_in):
        mem, m = self.encode(src)
        return self.decode(dec_in, mem, m)

    @torch.no_grad()
    def generate(self, src, beam=5, alpha=0.6, max_len_a=1.2, max_len_b=10):
        """Batched beam search with GNMT length penalty."""
        B = src.size(0)
        max_len = int(src.size(1) * max_len_a + max_len_b)
        mem, m = self.encode(src)
        mem, m = mem.repeat_interleave(beam, 0), m.repeat_interleave(beam, 0)
        ys = torch.full((B * beam, 1), self.bos, dtype=torch.long, device=src.device)
        score = torch.full((B, beam), float("-inf"), device=src.device)
        score[:, 0] = 0
        alive = torch.ones(B * beam, dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            lp = F.log_softmax(self.decode(ys, mem, m)[:, -1].float(), -1)
            V = lp.size(-1)
            # finished beams only extend with <pad> at no cost
            lp[~alive] = float("-inf")
            lp[~alive, self.pad] = 0
            total = (score.view(-1, 1) + lp).view(B, -1)
            score, flat = total.topk(beam, -1)
            origin = (flat // V + torch.arange(B, device=src.device).unsqueeze(1) * beam).view(-1)
            tok = (flat % V).view(-1, 1)
            ys = torch.cat([ys[origin], tok], 1)
            alive = alive[origin] & tok.squeeze(1).ne(self.eos) & tok.squeeze(1).ne(self.pad)
            if not alive.any():
                break
        length = ys[:, 1:].ne(self.pad).sum(1).float().view(B, beam)
        lp_norm = ((5 + length) / 6) ** alpha
        best = (score / lp_norm).argmax(-1)
        return ys.view(B, beam, -1)[torch.arange(B), best, 1:]


def smoothed_nll(logits, gold, eps, pad=0):
    lprobs = F.log_softmax(logits.float(), -1)
    nll = -lprobs.gather(-1, gold.unsqueeze(-1)).squeeze(-1)
    uni = -lprobs.sum(-1)
    keep = gold.ne(pad)
    eps_i = eps / (lprobs.size(-1) - 1)
    return ((1 - eps - eps_i) * nll + eps_i * uni)[keep].sum(), nll[keep].sum(), keep.sum()


def run_validation(model, loader, sp_en, args, device):
    model.eval()
    mine = []
    for src, _, _, refs in loader:
        out = model.generate(src.to(device), beam=args.beam, alpha=args.len_penalty)
        for row, ref in zip(out.tolist(), refs):
            row = [t for t in row if t not in (0, 1)]
            if 2 in row:
                row = row[: row.index(2)]
            mine.append((sp_en.decode(row), ref))
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    model.train()
    hyps = [h for p in parts for h, _ in p]
    refs = [r for p in parts for _, r in p]
    return sacrebleu.corpus_bleu(hyps, [refs]), len(hyps)


def main():
    args = get_parser().parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    sp_ja = spm.SentencePieceProcessor(model_file=f"{args.data}/spm_ja.model")
    sp_en = spm.SentencePieceProcessor(model_file=f"{args.data}/spm_en.model")
    train = Corpus(args.data, "train", sp_ja, sp_en)
    dev = Corpus(args.data, "dev", sp_ja, sp_en)
    sampler = DistributedSampler(train, shuffle=True, drop_last=True)
    train_dl = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    dev_dl = DataLoader(Subset(dev, list(range(rank, len(dev), world))), batch_size=50, collate_fn=collate)

    net = NMTModel(sp_ja.get_piece_size(), sp_en.get_piece_size(), **ARCHS[args.arch]).to(device)
    model = DDP(net, device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min((s + 1) * args.warmup ** -1.5, (s + 1) ** -0.5) * args.warmup ** 0.5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(f"{args.out}/config.json", "w") as f:
            json.dump(vars(args), f, indent=1)
    history = []
    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_updates:
        sampler.set_epoch(epoch)
        for src, dec_in, dec_out, _ in train_dl:
            src, dec_in, dec_out = src.to(device), dec_in.to(device), dec_out.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(src, dec_in)
            loss, nll, ntok = smoothed_nll(logits, dec_out, args.smoothing)
            optim.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            step += 1
            if step % 100 == 0 and rank == 0:
                print(f"[{time.time() - t0:7.0f}s] step {step} loss {(loss / ntok).item():.3f} "
                      f"ppl {math.exp((nll / ntok).item()):.2f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if step % args.valid_every == 0:
                bleu, n = run_validation(model, dev_dl, sp_en, args, device)
                if rank == 0:
                    print(f"step {step} | dev BLEU {bleu.score:.2f} ({n} sents) | {bleu}", flush=True)
                    history.append({"step": step, "bleu": bleu.score})
                    torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                                "sched": sched.state_dict(), "step": step},
                               f"{args.out}/checkpoint_{step}.pt")
                    with open(f"{args.out}/history.json", "w") as f:
                        json.dump(history, f)
                dist.barrier()
            if step >= args.max_updates:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
