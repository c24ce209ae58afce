#!/usr/bin/env python
# Forward reaction prediction (USPTO-MIT, separated reagents) with a Molecular
# Transformer style encoder-decoder. Data is the tokenized OpenNMT format:
#   src-{train,val}.txt : reactants.reagents, space separated tokens
#   tgt-{train,val}.txt : product, space separated tokens
#
#   torchrun --nproc_per_node=8 02_forward_mit_transformer.py --data data/USPTO_MIT_sep
import argparse
import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from rdkit import Chem, RDLogger
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

RDLogger.DisableLog("rdApp.*")
logger = logging.getLogger("fwd")


@dataclass
class Vocab:
    itos: list

    def __post_init__(self):
        self.stoi = {t: i for i, t in enumerate(self.itos)}
        self.pad, self.bos, self.eos, self.unk = (self.stoi[t] for t in ("<blank>", "<s>", "</s>", "<unk>"))

    @classmethod
    def from_file(cls, path):
        with open(path) as f:
            return cls([line.rstrip("\n").split("\t")[0] for line in f])

    def encode(self, tokens):
        return [self.bos] + [self.stoi.get(t, self.unk) for t in tokens] + [self.eos]

    def decode(self, ids):
        out = []
        for i in ids:
            if i == self.eos:
                break
            if i not in (self.bos, self.pad):
                out.append(self.itos[i])
        return "".join(out)


class ParallelText(Dataset):
    def __init__(self, src_path, tgt_path, vocab, max_len=250):
        with open(src_path) as fs, open(tgt_path) as ft:
            pairs = [(s.split(), t.split()) for s, t in zip(fs, ft)]
        self.examples = [(vocab.encode(s), vocab.encode(t)) for s, t in pairs if len(s) <= max_len]
        self.targets = ["".join(t) for s, t in pairs if len(s) <= max_len]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        s, t = self.examples[i]
        return torch.tensor(s), torch.tensor(t), i


def make_collate(pad):
    def collate(batch):
        src, tgt, idx = zip(*batch)
        return (nn.utils.rnn.pad_sequence(src, batch_first=True, padding_value=pad),
                nn.utils.rnn.pad_sequence(tgt, batch_first=True, padding_value=pad),
                torch.tensor(idx))
    return collate


class MolecularTransformer(nn.Module):
    def __init__(self, vocab, d_model=256, heads=8, layers=4, ff=2048, dropout=0.1, max_len=512):
        super().__init__()
        self.vocab = vocab
        self.d_model = d_model
        self.emb = nn.Embedding(len(vocab.itos), d_model, padding_idx=vocab.pad)
        pe = torch.zeros(max_len, d_model)
        pos = torch.arange(max_len).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)
        self.drop = nn.Dropout(dropout)
        self.core = nn.Transformer(d_model, heads, layers, layers, ff, dropout, batch_first=True, norm_first=True)
        self.proj = nn.Linear(d_model, len(vocab.itos))
        self.proj.weight = self.emb.weight

    def _embed(self, x):
        return self.drop(self.emb(x) * math.sqrt(self.d_model) + self.pe[: x.size(1)])

    def encode(self, src):
        return self.core.encoder(self._embed(src), src_key_padding_mask=src.eq(self.vocab.pad))

    def decode(self, tgt, memory, mem_pad):
        mask = self.core.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        h = self.core.decoder(self._embed(tgt), memory, tgt_mask=mask,
                              tgt_key_padding_mask=tgt.eq(self.vocab.pad), memory_key_padding_mask=mem_pad)
        return self.proj(h)

    def forward(self, src, tgt_in):
        return self.decode(tgt_in, self.encode(src), src.eq(self.vocab.pad))

    @torch.no_grad()
    def generate(self, src, beam_size=5, max_len=150):
        B, dev = src.size(0), src.device
        mem = self.encode(src).repeat_interleave(beam_size, 0)
        mem_pad = src.eq(self.vocab.pad).repeat_interleave(beam_size, 0)
        seqs = torch.full((B * beam_size, 1), self.vocab.bos, device=dev, dtype=torch.long)
        score = torch.full((B, beam_size), float("-inf"), device=dev)
        score[:, 0] = 0.0
        finished = torch.zeros(B * beam_size, dtype=torch.bool, device=dev)
        offset = (torch.arange(B, device=dev) * beam_size).unsqueeze(1)
        for _ in range(max_len):
            lp = F.log_softmax(self.decode(seqs, mem, mem_pad)[:, -1].float(), dim=-1)
            lp[finished] = float("-inf")
            lp[finished, self.vocab.pad] = 0.0
            V = lp.size(-1)
            score, flat = (score.reshape(-1, 1) + lp).reshape(B, -1).topk(beam_size, dim=-1)
            prev = (torch.div(flat, V, rounding_mode="floor") + offset).reshape(-1)
            nxt = (flat % V).reshape(-1, 1)
            seqs = torch.cat([seqs[prev], nxt], dim=1)
            finished = finished[prev] | nxt.squeeze(1).eq(self.vocab.eos)
            if bool(finished.all()):
                break
        return seqs.reshape(B, beam_size, -1)


def canon(smi):
    m = Chem.MolFromSmiles(smi)
    return Chem.MolToSmiles(m) if m is not None else None


@torch.no_grad()
def validate(model, loader, dataset, vocab, device, beam_size, topk=(1, 2, 3, 5)):
    model.eval()
    crit = nn.CrossEntropyLoss(ignore_index=vocab.pad, reduction="sum")
    stats = torch.zeros(3 + len(topk), device=device)  # loss, tokens, n, hits@k...
    for src, tgt, idx in loader:
        src, tgt = src.to(device), tgt.to(device)
        logits = model(src, tgt[:, :-1])
        stats[0] += crit(logits.reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1))
        stats[1] += tgt[:, 1:].ne(vocab.pad).sum()
        beams = model.generate(src, beam_size=beam_size)
        for b, i in enumerate(idx.tolist()):
            gold = canon(dataset.targets[i])
            preds = [canon(vocab.decode(seq)) for seq in beams[b].tolist()]
            for j, k in enumerate(topk):
                stats[3 + j] += float(gold is not None and gold in preds[:k])
            stats[2] += 1
    dist.all_reduce(stats)
    out = {"val_ppl": math.exp(stats[0].item() / stats[1].item())}
    for j, k in enumerate(topk):
        out[f"top{k}"] = stats[3 + j].item() / stats[2].item()
    return out


def noam(step, d_model, warmup):
    step = max(step, 1)
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/fwd_mit")
    ap.add_argument("--batch_size", type=int, default=96)
    ap.add_argument("--train_steps", type=int, default=500000)
    ap.add_argument("--valid_steps", type=int, default=10000)
    ap.add_argument("--save_steps", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=8000)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--beam_size", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    vocab = Vocab.from_file(os.path.join(args.data, "vocab.txt"))
    train_ds = ParallelText(os.path.join(args.data, "src-train.txt"), os.path.join(args.data, "tgt-train.txt"), vocab)
    val_ds = ParallelText(os.path.join(args.data, "src-val.txt"), os.path.join(args.data, "tgt-val.txt"), vocab)
    collate = make_collate(vocab.pad)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, persistent_workers=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=2)

    model = DDP(MolecularTransformer(vocab).to(device), device_ids=[local_rank])
    optim = torch.optim.Adam(model.parameters(), lr=args.factor, betas=(0.9, 0.998), eps=1e-9)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: noam(s, 256, args.warmup))
    crit = nn.CrossEntropyLoss(ignore_index=vocab.pad, label_smoothing=0.0)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        logger.info("train %d val %d vocab %d world %d", len(train_ds), len(val_ds), len(vocab.itos), world)

    step, epoch = 0, 0
    while step < args.train_steps:
        train_sampler.set_epoch(epoch)
        model.train()
        for src, tgt, _ in train_loader:
            src, tgt = src.to(device, non_blocking=True), tgt.to(device, non_blocking=True)
            logits = model(src, tgt[:, :-1])
            loss = crit(logits.reshape(-1, logits.size(-1)), tgt[:, 1:].reshape(-1))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            step += 1
            if step % 100 == 0 and rank == 0:
                logger.info("step %d epoch %d loss %.4f lr %.3e", step, epoch, loss.item(), sched.get_last_lr()[0])
            if step % args.valid_steps == 0:
                metrics = validate(model, val_loader, val_ds, vocab, device, args.beam_size)
                logger.info("step %d %s", step, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
                model.train()
            if step % args.save_steps == 0 and rank == 0:
                torch.save({"step": step, "model": model.module.state_dict(), "optim": optim.state_dict(),
                            "vocab": vocab.itos}, os.path.join(args.out, f"model_step_{step}.pt"))
            if step >= args.train_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
