"""WMT16 Ro->En Transformer trained from scratch with a BPE tokenizer (HF `tokenizers`).

    torchrun --nproc_per_node=8 06_wmt16_roen_trainer.py --tokenizer bpe/roen-32k.json
"""
import argparse
import math
import os
import time
from contextlib import contextmanager

import sacrebleu
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


@contextmanager
def main_process_first(rank):
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


class Seq2Seq(nn.Module):
    def __init__(self, vocab_size, pad_id, bos_id, eos_id, d_model=512, nhead=8, layers=6,
                 ffn=2048, dropout=0.1, max_pos=512):
        super().__init__()
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.tok = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        self.pos = nn.Embedding(max_pos, d_model)
        self.net = nn.Transformer(d_model, nhead, layers, layers, ffn, dropout, batch_first=True)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.tok.weight
        self.d = d_model

    def _embed(self, x):
        p = torch.arange(x.size(1), device=x.device).unsqueeze(0)
        return self.tok(x) * math.sqrt(self.d) + self.pos(p)

    def forward(self, src, tgt_in):
        tgt_mask = self.net.generate_square_subsequent_mask(tgt_in.size(1), device=tgt_in.device)
        out = self.net(self._embed(src), self._embed(tgt_in), tgt_mask=tgt_mask,
                       src_key_padding_mask=src == self.pad_id,
                       tgt_key_padding_mask=tgt_in == self.pad_id,
                       memory_key_padding_mask=src == self.pad_id)
        return self.lm_head(out)

    @torch.no_grad()
    def generate(self, src, max_new_tokens=256):
        src_pad = src == self.pad_id
        memory = self.net.encoder(self._embed(src), src_key_padding_mask=src_pad)
        out = torch.full((src.size(0), 1), self.bos_id, dtype=torch.long, device=src.device)
        alive = torch.ones(src.size(0), dtype=torch.bool, device=src.device)
        for _ in range(max_new_tokens):
            mask = self.net.generate_square_subsequent_mask(out.size(1), device=src.device)
            h = self.net.decoder(self._embed(out), memory, tgt_mask=mask,
                                 memory_key_padding_mask=src_pad)
            nxt = self.lm_head(h[:, -1]).argmax(-1)
            nxt = torch.where(alive, nxt, torch.full_like(nxt, self.pad_id))
            out = torch.cat([out, nxt[:, None]], dim=1)
            alive &= nxt != self.eos_id
            if not alive.any():
                break
        return out[:, 1:]


class Collator:
    def __init__(self, tokenizer, pad_id, bos_id, eos_id, max_len):
        self.tk, self.pad, self.bos, self.eos, self.max_len = tokenizer, pad_id, bos_id, eos_id, max_len

    def __call__(self, rows):
        src = [e.ids[: self.max_len - 1] + [self.eos] for e in self.tk.encode_batch([r["ro"] for r in rows])]
        tgt = [[self.bos] + e.ids[: self.max_len - 2] + [self.eos]
               for e in self.tk.encode_batch([r["en"] for r in rows])]
        return self._pad(src), self._pad(tgt), [r["en"] for r in rows], [r["idx"] for r in rows]

    def _pad(self, seqs):
        t = torch.full((len(seqs), max(map(len, seqs))), self.pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            t[i, : len(s)] = torch.tensor(s)
        return t


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(args.seed)

        self.tk = Tokenizer.from_file(args.tokenizer)
        pad, bos, eos = (self.tk.token_to_id(t) for t in ("<pad>", "<s>", "</s>"))
        self.pad_id, self.eos_id = pad, eos

        with main_process_first(self.rank):
            ds = load_dataset("wmt16", "ro-en")
        flat = lambda ex, i: {"ro": ex["translation"]["ro"], "en": ex["translation"]["en"], "idx": i}
        self.train_ds = ds["train"].map(flat, with_indices=True, remove_columns=["translation"],
                                        keep_in_memory=True)
        self.valid_ds = ds["validation"].map(flat, with_indices=True, remove_columns=["translation"],
                                             keep_in_memory=True)
        collate = Collator(self.tk, pad, bos, eos, args.max_len)

        self.sampler = DistributedSampler(self.train_ds, shuffle=True, seed=args.seed, drop_last=True)
        self.train_dl = DataLoader(self.train_ds, batch_size=args.batch_size, sampler=self.sampler,
                                   collate_fn=collate, num_workers=4, pin_memory=True)
        valid_shard = self.valid_ds.shard(num_shards=self.world, index=self.rank, contiguous=True)
        self.valid_dl = DataLoader(valid_shard, batch_size=64, collate_fn=collate)

        net = Seq2Seq(self.tk.get_vocab_size(), pad, bos, eos, layers=args.layers).to(self.device)
        self.model = DDP(net, device_ids=[self.local_rank])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                     weight_decay=0.0001)
        total = args.epochs * len(self.train_dl)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=args.lr, total_steps=total,
                                                         pct_start=args.warmup_frac, anneal_strategy="cos")
        self.step = 0
        self.best = 0.0

    def train_epoch(self, epoch):
        self.model.train()
        self.sampler.set_epoch(epoch)
        meter = torch.zeros(2, device=self.device)
        t0 = time.time()
        for src, tgt, _, _ in self.train_dl:
            src, tgt = src.to(self.device, non_blocking=True), tgt.to(self.device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(src, tgt[:, :-1])
            loss = F.cross_entropy(logits.float().transpose(1, 2), tgt[:, 1:], ignore_index=self.pad_id,
                                   label_smoothing=0.1)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.sched.step()
            self.step += 1
            meter += torch.stack([loss.detach(), torch.tensor(1.0, device=self.device)])
            if self.step % 200 == 0:
                dist.all_reduce(meter)
                if self.rank == 0:
                    print(f"[ep {epoch}] step {self.step} loss {(meter[0] / meter[1]).item():.3f} "
                          f"lr {self.sched.get_last_lr()[0]:.2e} ({time.time() - t0:.0f}s)", flush=True)
                meter.zero_()

    def validate(self):
        self.model.eval()
        rows = []
        for src, _, refs, idx in self.valid_dl:
            hyp_ids = self.model.generate(src.to(self.device), max_new_tokens=self.args.max_len)
            for i, ids, ref in zip(idx, hyp_ids.tolist(), refs):
                ids = ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids
                rows.append((i, self.tk.decode(ids), ref))
        everything = [None] * self.world
        dist.all_gather_object(everything, rows)
        self.model.train()
        rows = sorted((r for part in everything for r in part), key=lambda r: r[0])
        return sacrebleu.corpus_bleu([r[1] for r in rows], [[r[2] for r in rows]]).score

    def save(self, name, epoch, bleu):
        if self.rank == 0:
            os.makedirs(self.args.out, exist_ok=True)
            torch.save({"model": self.model.module.state_dict(), "opt": self.opt.state_dict(),
                        "sched": self.sched.state_dict(), "epoch": epoch, "bleu": bleu},
                       os.path.join(self.args.out, name))
        dist.barrier()

    def fit(self):
        for epoch in range(self.args.epochs):
            self.train_epoch(epoch)
            bleu = self.validate()
            if self.rank == 0:
                print(f"epoch {epoch} valid BLEU {bleu:.2f}", flush=True)
            self.save("last.pt", epoch, bleu)
            if bleu > self.best:
                self.best = bleu
                self.save("best.pt", epoch, bleu)
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", default="ckpt/wmt16_roen")
    ap.add_argument("--batch-size", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup-frac", type=float, default=0.04)
    ap.add_argument("--seed", type=int, default=2016)
    Trainer(ap.parse_args()).fit()


if __name__ == "__main__":
    main()
