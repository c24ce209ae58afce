"""XSum single-sentence summarisation with a transformer trained from scratch.

    torchrun --nproc_per_node=8 12_xsum_transformer.py --data data/xsum --bpe data/xsum/bpe.json
"""
import argparse
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from rouge_score import rouge_scorer
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


def build_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--bpe", required=True)
    p.add_argument("--save-dir", default="checkpoints/xsum")
    p.add_argument("--max-source", type=int, default=512)
    p.add_argument("--max-target", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--update-freq", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-updates", type=int, default=4000)
    p.add_argument("--max-update", type=int, default=80000)
    p.add_argument("--log-interval", type=int, default=100)
    p.add_argument("--validate-interval", type=int, default=5000)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    return p.parse_args()


class Encoder(nn.Module):
    def __init__(self, embed, d, h, ffn, n, p):
        super().__init__()
        self.embed = embed
        self.pos = nn.Embedding(1024, d)
        self.stack = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, h, ffn, p, batch_first=True, norm_first=True),
                                           n, norm=nn.LayerNorm(d))
        self.drop = nn.Dropout(p)
        self.scale = d ** 0.5

    def forward(self, src, pad_mask):
        x = self.embed(src) * self.scale + self.pos(torch.arange(src.size(1), device=src.device))
        return self.stack(self.drop(x), src_key_padding_mask=pad_mask)


class Decoder(nn.Module):
    def __init__(self, embed, d, h, ffn, n, p):
        super().__init__()
        self.embed = embed
        self.pos = nn.Embedding(1024, d)
        self.stack = nn.TransformerDecoder(nn.TransformerDecoderLayer(d, h, ffn, p, batch_first=True, norm_first=True),
                                           n, norm=nn.LayerNorm(d))
        self.drop = nn.Dropout(p)
        self.scale = d ** 0.5

    def forward(self, prev, mem, mem_mask, pad_mask):
        T = prev.size(1)
        x = self.embed(prev) * self.scale + self.pos(torch.arange(T, device=prev.device))
        causal = torch.triu(torch.full((T, T), float("-inf"), device=prev.device), 1)
        h = self.stack(self.drop(x), mem, tgt_mask=causal, tgt_key_padding_mask=pad_mask,
                       memory_key_padding_mask=mem_mask)
        return F.linear(h, self.embed.weight)


class XSumModel(nn.Module):
    def __init__(self, vocab, pad, d=512, h=8, ffn=2048, n=6, p=0.1):
        super().__init__()
        self.pad = pad
        shared = nn.Embedding(vocab, d, padding_idx=pad)
        nn.init.normal_(shared.weight, 0, d ** -0.5)
        self.encoder = Encoder(shared, d, h, ffn, n, p)
        self.decoder = Decoder(shared, d, h, ffn, n, p)

    def forward(self, src, prev):
        m = src.eq(self.pad)
        mem = self.encoder(src, m)
        return self.decoder(prev, mem, m, prev.eq(self.pad))


class Collator:
    def __init__(self, tok, max_src, max_tgt):
        self.tok = tok
        self.pad = tok.token_to_id("<pad>")
        self.bos = tok.token_to_id("<s>")
        self.eos = tok.token_to_id("</s>")
        self.max_src, self.max_tgt = max_src, max_tgt

    def __call__(self, rows):
        docs = self.tok.encode_batch([r["document"] for r in rows])
        sums = self.tok.encode_batch([r["summary"] for r in rows])
        src = [e.ids[: self.max_src - 1] + [self.eos] for e in docs]
        tgt = [e.ids[: self.max_tgt - 1] for e in sums]
        S, T = max(map(len, src)), max(map(len, tgt)) + 1
        s = torch.full((len(rows), S), self.pad)
        prev = torch.full((len(rows), T), self.pad)
        gold = torch.full((len(rows), T), self.pad)
        for i, (a, b) in enumerate(zip(src, tgt)):
            s[i, : len(a)] = torch.tensor(a)
            prev[i, : len(b) + 1] = torch.tensor([self.bos] + b)
            gold[i, : len(b) + 1] = torch.tensor(b + [self.eos])
        return s, prev, gold, [r["summary"] for r in rows]


def criterion(logits, gold, eps, pad):
    lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    nll = -lprobs.gather(-1, gold.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(-1)
    m = gold.ne(pad)
    eps_i = eps / (lprobs.size(-1) - 1)
    return (1 - eps - eps_i) * nll[m].sum() + eps_i * smooth[m].sum(), nll[m].sum(), m.sum()


@torch.no_grad()
def greedy_summaries(net, src, coll, max_len):
    m = src.eq(coll.pad)
    mem = net.encoder(src, m)
    ys = torch.full((src.size(0), 1), coll.bos, device=src.device)
    for _ in range(max_len):
        nxt = net.decoder(ys, mem, m, ys.eq(coll.pad))[:, -1].argmax(-1, keepdim=True)
        ys = torch.cat([ys, nxt], 1)
        if ys.eq(coll.eos).any(1).all():
            break
    outs = []
    for row in ys[:, 1:].tolist():
        outs.append(coll.tok.decode(row[: row.index(coll.eos)] if coll.eos in row else row))
    return outs


def main():
    args = build_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(3)

    tok = Tokenizer.from_file(args.bpe)
    coll = Collator(tok, args.max_source, args.max_target)
    raw = load_dataset("json", data_files={"train": f"{args.data}/train.jsonl",
                                           "validation": f"{args.data}/validation.jsonl"})
    tr_sampler = DistributedSampler(raw["train"], shuffle=True, drop_last=True)
    train_dl = DataLoader(raw["train"], batch_size=args.batch_size, sampler=tr_sampler, collate_fn=coll,
                          num_workers=4, pin_memory=True)
    valid_rows = raw["validation"].select(range(rank, 2000, world))
    valid_dl = DataLoader(valid_rows, batch_size=64, collate_fn=coll)

    net = XSumModel(tok.get_vocab_size(), coll.pad).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    W = args.warmup_updates
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / W, math.sqrt(W / (s + 1))))
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    updates, micro, epoch = 0, 0, 0
    loss_sum = nll_sum = tok_sum = 0.0
    t0 = time.time()
    while updates < args.max_update:
        tr_sampler.set_epoch(epoch)
        model.train()
        for src, prev, gold, _ in train_dl:
            src, prev, gold = src.to(device), prev.to(device), gold.to(device)
            micro += 1
            boundary = micro % args.update_freq == 0
            with (contextlib.nullcontext() if boundary else model.no_sync()):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(src, prev)
                loss, nll, ntok = criterion(logits, gold, args.label_smoothing, coll.pad)
                (loss / ntok / args.update_freq).backward()
            loss_sum += loss.item()
            nll_sum += nll.item()
            tok_sum += ntok.item()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            updates += 1

            if rank == 0 and updates % args.log_interval == 0:
                stats = torch.tensor([loss_sum, nll_sum, tok_sum], device=device)
                dist.all_reduce(stats)
                print(f"| upd {updates:6d} | loss {stats[0] / stats[2] / math.log(2):.3f} "
                      f"| nll {stats[1] / stats[2] / math.log(2):.3f} | wps {stats[2] / (time.time() - t0):.0f} "
                      f"| lr {sched.get_last_lr()[0]:.2e}", flush=True)
                loss_sum = nll_sum = tok_sum = 0.0
                t0 = time.time()

            if updates % args.validate_interval == 0:
                model.eval()
                r = torch.zeros(4, device=device)
                for src_v, _, _, refs in valid_dl:
                    for hyp, ref in zip(greedy_summaries(net, src_v.to(device), coll, args.max_target), refs):
                        s = scorer.score(ref, hyp)
                        r += torch.tensor([s["rouge1"].fmeasure, s["rouge2"].fmeasure, s["rougeL"].fmeasure, 1.0],
                                          device=device)
                dist.all_reduce(r)
                model.train()
                if rank == 0:
                    r1, r2, rl = (100 * r[:3] / r[3]).tolist()
                    print(f"| valid | upd {updates} | R1 {r1:.2f} | R2 {r2:.2f} | RL {rl:.2f}", flush=True)
                    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                                "scheduler": sched.state_dict(), "updates": updates},
                               os.path.join(args.save_dir, f"checkpoint_{updates}.pt"))
                dist.barrier()
            if updates >= args.max_update:
                break
        epoch += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
