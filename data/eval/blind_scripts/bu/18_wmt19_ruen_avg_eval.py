"""WMT19 Ru->En transformer-base: train, average last N checkpoints, score newstest2019.

    torchrun --nproc_per_node=8 18_wmt19_ruen_avg_eval.py --data data/wmt19_ruen --max-update 100000
"""
import argparse
import glob
import logging
import math
import os
import re
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("ruen")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", default="checkpoints/ruen_base")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=7e-4)
    p.add_argument("--warmup-updates", type=int, default=4000)
    p.add_argument("--max-update", type=int, default=100000)
    p.add_argument("--save-interval-updates", type=int, default=2500)
    p.add_argument("--keep-interval-updates", type=int, default=10)
    p.add_argument("--num-average", type=int, default=5)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args()


class Bitext(Dataset):
    def __init__(self, path_src, path_tgt, sp, max_len=256):
        with open(path_src) as a, open(path_tgt) as b:
            self.rows = [(sp.encode(x.strip())[:max_len], sp.encode(y.strip())[:max_len], y.strip())
                         for x, y in zip(a, b)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(rows, pad=0, bos=1, eos=2):
    n = len(rows)
    S = max(len(r[0]) for r in rows) + 1
    T = max(len(r[1]) for r in rows) + 1
    x = torch.full((n, S), pad, dtype=torch.long)
    y_in = torch.full((n, T), pad, dtype=torch.long)
    y_out = torch.full((n, T), pad, dtype=torch.long)
    for i, (s, t, _) in enumerate(rows):
        x[i, : len(s) + 1] = torch.tensor(s + [eos])
        y_in[i, : len(t) + 1] = torch.tensor([bos] + t)
        y_out[i, : len(t) + 1] = torch.tensor(t + [eos])
    return x, y_in, y_out, [r[2] for r in rows]


class TransformerBase(nn.Module):
    def __init__(self, vocab, d=512, heads=8, ffn=2048, layers=6, dropout=0.1, pad=0):
        super().__init__()
        self.pad = pad
        self.embed_tokens = nn.Embedding(vocab, d, padding_idx=pad)
        nn.init.normal_(self.embed_tokens.weight, 0, d ** -0.5)
        self.embed_positions = nn.Embedding(512, d)
        self.transformer = nn.Transformer(d, heads, layers, layers, ffn, dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.embed_scale = math.sqrt(d)

    def embed(self, x):
        pos = torch.arange(x.size(1), device=x.device)
        return self.dropout(self.embed_tokens(x) * self.embed_scale + self.embed_positions(pos))

    def encode(self, x):
        return self.transformer.encoder(self.embed(x), src_key_padding_mask=x.eq(self.pad))

    def decode(self, y, mem, x):
        T = y.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=y.device), 1)
        h = self.transformer.decoder(self.embed(y), mem, tgt_mask=causal, tgt_key_padding_mask=y.eq(self.pad),
                                     memory_key_padding_mask=x.eq(self.pad))
        return F.linear(h, self.embed_tokens.weight)

    def forward(self, x, y):
        return self.decode(y, self.encode(x), x)


def label_smoothed_nll_loss(logits, target, eps, pad=0):
    lprobs = F.log_softmax(logits, dim=-1, dtype=torch.float32)
    nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(-1)
    mask = target.ne(pad)
    eps_i = eps / (lprobs.size(-1) - 1)
    loss = ((1.0 - eps - eps_i) * nll + eps_i * smooth)[mask].sum()
    return loss, nll[mask].sum(), mask.sum()


@torch.no_grad()
def beam_generate(net, x, beam=5, max_len_b=20, bos=1, eos=2):
    B = x.size(0)
    mem = net.encode(x).repeat_interleave(beam, 0)
    xb = x.repeat_interleave(beam, 0)
    ys = torch.full((B * beam, 1), bos, dtype=torch.long, device=x.device)
    scores = torch.zeros(B, beam, device=x.device)
    scores[:, 1:] = -1e9
    fin = torch.zeros(B * beam, dtype=torch.bool, device=x.device)
    for _ in range(x.size(1) + max_len_b):
        lp = F.log_softmax(net.decode(ys, mem, xb)[:, -1], -1, dtype=torch.float32)
        lp[fin] = -1e9
        lp[fin, eos] = 0
        V = lp.size(-1)
        scores, flat = (scores.view(-1, 1) + lp).view(B, -1).topk(beam, -1)
        prev_beam = (flat // V + beam * torch.arange(B, device=x.device).unsqueeze(1)).view(-1)
        ys = torch.cat([ys[prev_beam], (flat % V).view(-1, 1)], 1)
        fin = fin[prev_beam] | ys[:, -1].eq(eos)
        if fin.all():
            break
    lengths = (ys[:, 1:].ne(eos).sum(1) + 1).float().view(B, beam)
    best = (scores / lengths).argmax(-1)
    return ys.view(B, beam, -1)[torch.arange(B), best, 1:].tolist()


def checkpoint_paths(save_dir):
    paths = glob.glob(os.path.join(save_dir, "checkpoint_*.pt"))
    return sorted(paths, key=lambda p: int(re.search(r"checkpoint_(\d+)\.pt", p).group(1)))


def average_checkpoints(paths):
    params, n = None, len(paths)
    for p in paths:
        state = torch.load(p, map_location="cpu")["model"]
        if params is None:
            params = {k: v.clone().double() for k, v in state.items()}
        else:
            for k, v in state.items():
                params[k] += v.double()
    return {k: (v / n).float() for k, v in params.items()}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s | %(levelname)s | %(message)s")

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "spm_joint32k.model"))
    train = Bitext(os.path.join(args.data, "train.ru"), os.path.join(args.data, "train.en"), sp)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, collate_fn=collate,
                        num_workers=6, pin_memory=True, persistent_workers=True)

    model = DDP(TransformerBase(sp.get_piece_size()).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    W = args.warmup_updates
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: min((u + 1) / W, math.sqrt(W / (u + 1))))
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    updates, epoch, t0 = 0, 0, time.time()
    while updates < args.max_update:
        sampler.set_epoch(epoch)
        for x, y_in, y_out, _ in loader:
            x, y_in, y_out = x.to(device, non_blocking=True), y_in.to(device, non_blocking=True), y_out.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x, y_in)
            loss, nll, ntok = label_smoothed_nll_loss(logits, y_out, 0.1)
            opt.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            updates += 1
            if updates % 100 == 0:
                log.info("epoch %d | upd %d | loss %.3f | nll %.3f | lr %.2e | %.0fs", epoch, updates,
                         (loss / ntok).item(), (nll / ntok).item(), sched.get_last_lr()[0], time.time() - t0)
            if updates % args.save_interval_updates == 0:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "lr_scheduler": sched.state_dict(), "updates": updates},
                               os.path.join(args.save_dir, f"checkpoint_{updates}.pt"))
                    for old in checkpoint_paths(args.save_dir)[: -args.keep_interval_updates]:
                        os.remove(old)
                dist.barrier()
            if updates >= args.max_update:
                break
        epoch += 1

    if rank == 0:
        last = checkpoint_paths(args.save_dir)[-args.num_average:]
        log.info("averaging %s", [os.path.basename(p) for p in last])
        averaged = average_checkpoints(last)
        torch.save({"model": averaged}, os.path.join(args.save_dir, "averaged.pt"))

        net = TransformerBase(sp.get_piece_size()).to(device)
        net.load_state_dict(averaged)
        net.eval()
        test = Bitext(os.path.join(args.data, "newstest2019.ru"), os.path.join(args.data, "newstest2019.en"), sp)
        hyps, refs = [], []
        for start in range(0, len(test), 64):
            x, _, _, ref = collate([test[i] for i in range(start, min(start + 64, len(test)))])
            for row in beam_generate(net, x.to(device), beam=args.beam):
                hyps.append(sp.decode(row[: row.index(2)] if 2 in row else row))
            refs += ref
        bleu = sacrebleu.corpus_bleu(hyps, [refs])
        log.info("newstest2019 (avg last %d): %s", len(last), bleu)
        with open(os.path.join(args.save_dir, "newstest2019.hyp"), "w") as f:
            f.write("\n".join(hyps) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
