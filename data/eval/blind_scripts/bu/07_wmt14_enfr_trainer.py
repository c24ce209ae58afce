"""WMT14 En-Fr, transformer (big) with a small Trainer class.

    srun-free launch on two 8-GPU nodes with a shared /checkpoint filesystem:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node01:29400 \
        07_wmt14_enfr_trainer.py --data /datasets/wmt14_enfr --save-dir /checkpoint/enfr_big
"""
import argparse
import logging
import math
import os
import shutil
import time

import sacrebleu
import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


class TSVPairs(Dataset):
    def __init__(self, path, sp, max_len):
        self.examples = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                en, fr = line.rstrip("\n").split("\t")
                self.examples.append((sp.encode(en)[:max_len], sp.encode(fr)[:max_len], fr))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def pad_batch(seqs, pad, prefix=None, suffix=None):
    seqs = [([prefix] if prefix is not None else []) + s + ([suffix] if suffix is not None else []) for s in seqs]
    out = torch.full((len(seqs), max(map(len, seqs))), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out


class Collate:
    def __init__(self, sp):
        self.pad, self.bos, self.eos = sp.pad_id(), sp.bos_id(), sp.eos_id()

    def __call__(self, batch):
        src = pad_batch([b[0] for b in batch], self.pad, suffix=self.eos)
        prev = pad_batch([b[1] for b in batch], self.pad, prefix=self.bos)
        tgt = pad_batch([b[1] for b in batch], self.pad, suffix=self.eos)
        return {"src": src, "prev": prev, "tgt": tgt, "ref": [b[2] for b in batch]}


class TransformerModel(nn.Module):
    def __init__(self, vocab, pad, d=1024, heads=16, ffn=4096, layers=6, dropout=0.1):
        super().__init__()
        self.pad = pad
        self.emb = nn.Embedding(vocab, d, padding_idx=pad)
        self.pos = nn.Embedding(1024, d)
        self.net = nn.Transformer(d, heads, layers, layers, ffn, dropout, batch_first=True, norm_first=True)
        self.scale = d ** 0.5
        self.dropout = nn.Dropout(dropout)

    def _in(self, x):
        return self.dropout(self.emb(x) * self.scale + self.pos.weight[: x.size(1)])

    def encode(self, src):
        mask = src.eq(self.pad)
        return self.net.encoder(self._in(src), src_key_padding_mask=mask), mask

    def decode(self, prev, memory, mem_mask):
        causal = self.net.generate_square_subsequent_mask(prev.size(1), device=prev.device)
        out = self.net.decoder(self._in(prev), memory, tgt_mask=causal,
                               tgt_key_padding_mask=prev.eq(self.pad), memory_key_padding_mask=mem_mask)
        return F.linear(out, self.emb.weight)

    def forward(self, src, prev):
        return self.decode(prev, *self.encode(src))


class Trainer:
    def __init__(self, args, model, train_loader, valid_loader, sp, device):
        self.args, self.sp, self.device = args, sp, device
        self.rank = dist.get_rank()
        self.model = DistributedDataParallel(model, device_ids=[device.index])
        self.train_loader, self.valid_loader = train_loader, valid_loader
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
        self.num_updates = 0
        self.best_bleu = None
        self.scaler = torch.cuda.amp.GradScaler()

    def lr_at(self, step):
        w = self.args.warmup
        return self.args.lr * min(step / w, math.sqrt(w / max(step, 1)))

    def criterion(self, logits, tgt):
        eps, pad = self.args.label_smoothing, self.sp.pad_id()
        lp = F.log_softmax(logits.float(), dim=-1)
        nll = -lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        smooth = -lp.sum(-1)
        m = tgt.ne(pad)
        eps_i = eps / (lp.size(-1) - 1)
        loss = (1 - eps - eps_i) * nll[m].sum() + eps_i * smooth[m].sum()
        return loss, nll[m].sum(), m.sum()

    def train_epoch(self, epoch):
        self.model.train()
        self.train_loader.sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in self.train_loader:
            self.num_updates += 1
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(self.num_updates)
            src, prev, tgt = (batch[k].to(self.device, non_blocking=True) for k in ("src", "prev", "tgt"))
            with torch.autocast("cuda", dtype=torch.float16):
                logits = self.model(src, prev)
            loss, nll, ntok = self.criterion(logits, tgt)
            self.opt.zero_grad(set_to_none=True)
            self.scaler.scale(loss / ntok).backward()
            self.scaler.unscale_(self.opt)
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_norm)
            self.scaler.step(self.opt)
            self.scaler.update()
            if self.num_updates % self.args.log_interval == 0:
                log.info("epoch %d | upd %d | loss %.3f | nll %.3f | gnorm %.2f | lr %.2e | %.1fs",
                         epoch, self.num_updates, (loss / ntok).item(), (nll / ntok).item(),
                         gnorm.item(), self.opt.param_groups[0]["lr"], time.time() - t0)

    @torch.no_grad()
    def greedy(self, src, max_extra=50):
        net = self.model.module
        memory, mask = net.encode(src)
        ys = torch.full((src.size(0), 1), self.sp.bos_id(), dtype=torch.long, device=src.device)
        for _ in range(src.size(1) + max_extra):
            nxt = net.decode(ys, memory, mask)[:, -1].argmax(-1, keepdim=True)
            ys = torch.cat([ys, nxt], dim=1)
            if ys.eq(self.sp.eos_id()).any(1).all():
                break
        return ys[:, 1:].tolist()

    @torch.no_grad()
    def validate(self):
        self.model.eval()
        stats = torch.zeros(2, device=self.device)
        pairs = []
        for batch in self.valid_loader:
            src, prev, tgt = (batch[k].to(self.device) for k in ("src", "prev", "tgt"))
            _, nll, ntok = self.criterion(self.model.module(src, prev), tgt)
            stats += torch.stack([nll, ntok.float()])
            for ids, ref in zip(self.greedy(src), batch["ref"]):
                eos = self.sp.eos_id()
                pairs.append((self.sp.decode(ids[: ids.index(eos)] if eos in ids else ids), ref))
        dist.all_reduce(stats)
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, pairs)
        hyps = [h for part in everything for h, _ in part]
        refs = [r for part in everything for _, r in part]
        self.model.train()
        return (stats[0] / stats[1]).item(), sacrebleu.corpus_bleu(hyps, [refs]).score

    def save(self, epoch, bleu):
        os.makedirs(self.args.save_dir, exist_ok=True)
        state = {"model": self.model.module.state_dict(), "optimizer": self.opt.state_dict(),
                 "scaler": self.scaler.state_dict(), "num_updates": self.num_updates,
                 "epoch": epoch, "bleu": bleu, "args": vars(self.args)}
        path = os.path.join(self.args.save_dir, f"checkpoint{epoch}.pt")
        torch.save(state, path)
        shutil.copyfile(path, os.path.join(self.args.save_dir, "checkpoint_last.pt"))
        if self.best_bleu is None or bleu > self.best_bleu:
            self.best_bleu = bleu
            shutil.copyfile(path, os.path.join(self.args.save_dir, "checkpoint_best.pt"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save-dir", required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=4000)
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--clip-norm", type=float, default=1.0)
    ap.add_argument("--max-epoch", type=int, default=20)
    ap.add_argument("--log-interval", type=int, default=200)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if dist.get_rank() == 0 else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    torch.manual_seed(17)

    sp = spm.SentencePieceProcessor(model_file=os.path.join(args.data, "spm40k.model"))
    train = TSVPairs(os.path.join(args.data, "train.tsv"), sp, 250)
    valid = TSVPairs(os.path.join(args.data, "newstest2013.tsv"), sp, 250)
    coll = Collate(sp)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=DistributedSampler(train, drop_last=True),
                              collate_fn=coll, num_workers=4, pin_memory=True)
    # strided shard of the dev set without DistributedSampler's padding, so no sentence is counted twice
    valid_shard = Subset(valid, range(dist.get_rank(), len(valid), dist.get_world_size()))
    valid_loader = DataLoader(valid_shard, batch_size=64, shuffle=False, collate_fn=coll, num_workers=2)

    model = TransformerModel(sp.get_piece_size(), sp.pad_id()).to(device)
    trainer = Trainer(args, model, train_loader, valid_loader, sp, device)
    for epoch in range(1, args.max_epoch + 1):
        trainer.train_epoch(epoch)
        vloss, bleu = trainer.validate()
        log.info("| epoch %d | valid nll %.3f | ppl %.2f | BLEU %.2f", epoch, vloss, math.exp(vloss), bleu)
        trainer.save(epoch, bleu)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
