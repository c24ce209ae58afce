"""Causal transformer LM on raw text. Builds a sentencepiece model and an id cache on first run.

usage: torchrun --nproc_per_node=4 05_spm_lm_cache.py --corpus-dir corpora/news_crawl --work-dir work/lm_news
"""
import argparse
import math
import os
import time

import sentencepiece as spm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def get_parser():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus-dir", required=True)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--vocab-size", type=int, default=16000)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--amp", action="store_true")
    return p


def build_tokenizer(corpus_dir, work_dir, vocab_size):
    prefix = os.path.join(work_dir, f"spm_unigram{vocab_size}")
    if not os.path.exists(prefix + ".model"):
        spm.SentencePieceTrainer.train(
            input=os.path.join(corpus_dir, "train.txt"), model_prefix=prefix, vocab_size=vocab_size,
            model_type="unigram", character_coverage=0.9995, input_sentence_size=2000000,
            shuffle_input_sentence=True, pad_id=0, unk_id=1, bos_id=2, eos_id=3, num_threads=16)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def encode_split(sp, corpus_dir, work_dir, split):
    cache = os.path.join(work_dir, f"{split}.ids.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    ids = []
    with open(os.path.join(corpus_dir, f"{split}.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                ids.extend(sp.encode(line) + [sp.eos_id()])
    ids = torch.tensor(ids, dtype=torch.int32)
    torch.save(ids, cache)
    return ids


class BlockDataset(Dataset):
    def __init__(self, ids, block):
        n = (ids.numel() - 1) // block
        self.ids = ids[: n * block + 1].long()
        self.block = block
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.block
        chunk = self.ids[s: s + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d, h, drop):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, dropout=drop, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(drop))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, vocab, d, n_layer, n_head, block, drop=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.drop = nn.Dropout(drop)
        self.blocks = nn.ModuleList([Block(d, n_head, drop) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, x):
        T = x.size(1)
        mask = torch.triu(torch.full((T, T), float("-inf"), device=x.device), diagonal=1)
        h = self.drop(self.tok(x) + self.pos(torch.arange(T, device=x.device)))
        for b in self.blocks:
            h = b(h, mask)
        return self.head(self.ln_f(h))


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    s = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        s[0] += F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction="sum").double()
        s[1] += y.numel()
    dist.all_reduce(s)
    model.train()
    return (s[0] / s[1]).item()


def main():
    args = get_parser().parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    os.makedirs(args.work_dir, exist_ok=True)

    sp = build_tokenizer(args.corpus_dir, args.work_dir, args.vocab_size)
    train_ids = encode_split(sp, args.corpus_dir, args.work_dir, "train")
    valid_ids = encode_split(sp, args.corpus_dir, args.work_dir, "valid")

    train_ds = BlockDataset(train_ids, args.block_size)
    valid_ds = BlockDataset(valid_ids, args.block_size)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    valid_idx = list(range(rank, len(valid_ds), world))
    valid_dl = DataLoader(torch.utils.data.Subset(valid_ds, valid_idx), batch_size=args.batch_size)

    torch.manual_seed(42)
    model = TransformerLM(sp.get_piece_size(), args.d_model, args.n_layer, args.n_head, args.block_size).to(device)
    model = DDP(model, device_ids=[local_rank])
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    scaler = torch.cuda.amp.GradScaler(enabled=args.amp)

    writer = SummaryWriter(os.path.join(args.work_dir, "tb")) if rank == 0 else None
    best = float("inf")
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast(enabled=args.amp):
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if writer is not None and step % 100 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                print(f"ep {epoch} step {step}/{total} loss {loss.item():.3f} {(time.time() - tic) / 100:.3f}s/it")
                tic = time.time()

        vloss = evaluate(model.module, valid_dl, device)
        if rank == 0:
            print(f"== epoch {epoch} valid loss {vloss:.4f} ppl {math.exp(vloss):.2f}")
            writer.add_scalar("valid/ppl", math.exp(vloss), epoch)
            ck = {"model": model.module.state_dict(), "spm": sp.serialized_model_proto(), "args": vars(args)}
            torch.save(ck, os.path.join(args.work_dir, "last.pt"))
            if vloss < best:
                best = vloss
                torch.save(ck, os.path.join(args.work_dir, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
