"""Transformer-big En->Fr with per-epoch checkpoints and checkpoint averaging at the end.

After training, rank 0 averages the last N epoch checkpoints (as in Vaswani et al. 2017)
and decodes newstest2014 with the averaged weights.

    torchrun --nnodes=1 --nproc_per_node=8 20_transformer_ckpt_average.py --data data/wmt14_en_fr
"""
import argparse
import collections
import glob
import math
import os
import re

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

PAD, BOS, EOS = 0, 1, 2


def options():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--src", default="en")
    ap.add_argument("--tgt", default="fr")
    ap.add_argument("--save-dir", default="checkpoints/wmt14_enfr_big")
    ap.add_argument("--bsz", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--avg-last", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=250)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


class TokenizedPairs(Dataset):
    def __init__(self, src_path, tgt_path, sp, max_len):
        with open(src_path, encoding="utf-8") as f:
            self.src = [sp.encode(x.strip())[: max_len - 1] + [EOS] for x in f]
        with open(tgt_path, encoding="utf-8") as f:
            self.tgt = [[BOS] + sp.encode(x.strip())[: max_len - 2] + [EOS] for x in f]

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return self.src[i], self.tgt[i]


def pad_to(seqs):
    out = torch.full((len(seqs), max(len(s) for s in seqs)), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s)
    return out


def collate(batch):
    return pad_to([b[0] for b in batch]), pad_to([b[1] for b in batch])


class TransformerNMT(nn.Module):
    def __init__(self, vocab, d=1024, heads=16, layers=6, ff=4096, dropout=0.3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        pe = torch.zeros(1024, d)
        pos = torch.arange(1024).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)
        self.drop = nn.Dropout(dropout)
        self.model = nn.Transformer(d, heads, layers, layers, ff, dropout, batch_first=True)
        self.d = d

    def _in(self, x):
        return self.drop(self.embed(x) * math.sqrt(self.d) + self.pe[: x.size(1)])

    def forward(self, src, tgt_in):
        mask = self.model.generate_square_subsequent_mask(tgt_in.size(1), device=src.device)
        h = self.model(self._in(src), self._in(tgt_in), tgt_mask=mask, src_key_padding_mask=src.eq(PAD),
                       tgt_key_padding_mask=tgt_in.eq(PAD), memory_key_padding_mask=src.eq(PAD))
        return F.linear(h, self.embed.weight)

    @torch.no_grad()
    def greedy(self, src, max_len):
        mem = self.model.encoder(self._in(src), src_key_padding_mask=src.eq(PAD))
        ys = torch.full((src.size(0), 1), BOS, dtype=torch.long, device=src.device)
        done = torch.zeros(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            mask = self.model.generate_square_subsequent_mask(ys.size(1), device=src.device)
            h = self.model.decoder(self._in(ys), mem, tgt_mask=mask, memory_key_padding_mask=src.eq(PAD))
            nxt = F.linear(h[:, -1], self.embed.weight).argmax(-1).masked_fill(done, PAD)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt.eq(EOS)
            if done.all():
                break
        return ys[:, 1:].tolist()


def average_checkpoints(paths):
    avg = collections.OrderedDict()
    for p in paths:
        state = torch.load(p, map_location="cpu")["model"]
        for k, v in state.items():
            avg[k] = avg.get(k, 0) + v.float() / len(paths)
    return avg


def decode(model, ds, sp, device, max_len, bsz=100):
    hyps = []
    for b in range(0, len(ds), bsz):
        src = pad_to([ds.src[i] for i in range(b, min(b + bsz, len(ds)))]).to(device)
        for h in model.greedy(src, max_len):
            h = h[: h.index(EOS)] if EOS in h else h
            hyps.append(sp.decode([t for t in h if t != PAD]))
    return hyps


def main():
    args = options()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1)

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "spm.model"))
    d = args.data
    train = TokenizedPairs(f"{d}/train.{args.src}", f"{d}/train.{args.tgt}", sp, args.max_len)
    valid = TokenizedPairs(f"{d}/valid.{args.src}", f"{d}/valid.{args.tgt}", sp, args.max_len)
    sampler = DistributedSampler(train, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(train, batch_size=args.bsz, sampler=sampler, collate_fn=collate, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = DDP(TransformerNMT(sp.get_piece_size()).to(device), device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / args.warmup,
                                                                 math.sqrt(args.warmup / (s + 1))))
    start = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        start = ckpt["epoch"] + 1
    os.makedirs(args.save_dir, exist_ok=True)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        run = torch.zeros(2, device=device)
        for i, (src, tgt) in enumerate(loader):
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(src, tgt[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(),
                                   ignore_index=PAD, label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            run += torch.stack([loss.detach(), torch.ones((), device=device)])
            if (i + 1) % 500 == 0:
                dist.all_reduce(run)
                if rank == 0:
                    print(f"epoch {epoch} iter {i + 1}/{len(loader)} loss {(run[0] / run[1]).item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)
                run.zero_()

        # validation loss on each rank's slice, summed over ranks
        model.eval()
        vl = torch.zeros(2, device=device)
        with torch.no_grad():
            for b in range(rank * 200, len(valid), world * 200):
                src, tgt = collate([valid[j] for j in range(b, min(b + 200, len(valid)))])
                src, tgt = src.to(device), tgt.to(device)
                logits = model.module(src, tgt[:, :-1])
                vl[0] += F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten(),
                                         ignore_index=PAD, reduction="sum")
                vl[1] += tgt[:, 1:].ne(PAD).sum()
        dist.all_reduce(vl)
        if rank == 0:
            print(f"epoch {epoch} valid nll/tok {(vl[0] / vl[1]).item():.4f}", flush=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch}, os.path.join(args.save_dir, f"checkpoint{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()

    if rank == 0:
        ckpts = sorted(glob.glob(os.path.join(args.save_dir, "checkpoint*.pt")),
                       key=lambda p: int(re.search(r"checkpoint(\d+)\.pt", p).group(1)))
        last = ckpts[-args.avg_last :]
        print("averaging", [os.path.basename(p) for p in last], flush=True)
        averaged = average_checkpoints(last)
        torch.save({"model": averaged}, os.path.join(args.save_dir, "averaged.pt"))

        test_model = TransformerNMT(sp.get_piece_size()).to(device)
        test_model.load_state_dict(averaged)
        test_model.eval()
        test = TokenizedPairs(f"{d}/test.{args.src}", f"{d}/test.{args.tgt}", sp, args.max_len)
        with open(f"{d}/test.{args.tgt}", encoding="utf-8") as f:
            refs = [x.strip() for x in f]
        hyps = decode(test_model, test, sp, device, args.max_len)
        print(f"newstest2014 BLEU (avg of {len(last)}): {sacrebleu.corpus_bleu(hyps, [refs]).score:.2f}")


if __name__ == "__main__":
    main()
