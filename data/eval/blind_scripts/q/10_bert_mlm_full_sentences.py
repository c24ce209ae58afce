"""
BERT-base pretraining, FULL-SENTENCES packing (no NSP, as in RoBERTa).
Model code kept compatible with our older MLM+NSP checkpoints.

    torchrun --nproc_per_node=8 10_bert_mlm_full_sentences.py --train corpus/wiki_books.train.txt \
        --valid corpus/wiki_books.valid.txt --vocab vocab/bert-base-uncased-vocab.txt
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import BertWordPieceTokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--valid", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--out", default="runs/bert_base_fs")
    ap.add_argument("--max-seq", type=int, default=128)
    ap.add_argument("--bsz", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup-ratio", type=float, default=0.06)
    return ap.parse_args()


class FullSentencesDataset(Dataset):
    """Pack contiguous sentences into blocks of max_seq tokens ([CLS] ... [SEP])."""

    def __init__(self, path, tok, max_seq):
        self.cls, self.sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        lines = [l.strip() for l in open(path, encoding="utf-8") if l.strip()]
        ids = []
        for enc in tok.encode_batch(lines, add_special_tokens=False):
            ids.extend(enc.ids)
        body = max_seq - 2
        self.blocks = [ids[i:i + body] for i in range(0, len(ids) - body + 1, body)]

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return torch.tensor([self.cls] + self.blocks[i] + [self.sep])


class MLMCollator:
    def __init__(self, tok, prob=0.15):
        self.mask_id = tok.token_to_id("[MASK]")
        self.special = {tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]")}
        self.vocab = tok.get_vocab_size()
        self.prob = prob

    def __call__(self, batch):
        x = torch.stack(batch)
        labels = x.clone()
        special = torch.zeros_like(x, dtype=torch.bool)
        for s in self.special:
            special |= x.eq(s)
        m = torch.bernoulli(torch.full(x.shape, self.prob)).bool() & ~special
        labels[~m] = -100
        r = torch.rand(x.shape)
        x[m & (r < 0.8)] = self.mask_id
        rnd = m & (r >= 0.8) & (r < 0.9)
        x[rnd] = torch.randint(self.vocab, (int(rnd.sum()),))
        return x, labels


class BertModel(nn.Module):
    def __init__(self, vocab, hidden=768, layers=12, heads=12, max_pos=512, type_vocab=2):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(max_pos, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab, hidden)
        self.emb_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.emb_drop = nn.Dropout(0.1)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, 0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        # pretraining heads
        self.mlm_transform = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=1e-12))
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))
        self.pooler = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.nsp_head = nn.Linear(hidden, 2)

    def forward(self, input_ids, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.word_embeddings(input_ids) + self.position_embeddings(pos) + self.token_type_embeddings(token_type_ids)
        h = self.encoder(self.emb_drop(self.emb_norm(h)))
        mlm_logits = F.linear(self.mlm_transform(h), self.word_embeddings.weight, self.mlm_bias)
        nsp_logits = self.nsp_head(self.pooler(h[:, 0]))
        return mlm_logits, nsp_logits


def linear_warmup_decay(total, warmup):
    def f(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    acc = torch.zeros(3, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        mlm_logits, _ = model(x)
        mask = y.ne(-100)
        acc[0] += F.cross_entropy(mlm_logits[mask].float(), y[mask], reduction="sum").double()
        acc[1] += (mlm_logits[mask].argmax(-1) == y[mask]).sum()
        acc[2] += mask.sum()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    tok = BertWordPieceTokenizer(args.vocab, lowercase=True)
    train_ds = FullSentencesDataset(args.train, tok, args.max_seq)
    valid_ds = FullSentencesDataset(args.valid, tok, args.max_seq)
    collate = MLMCollator(tok)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.bsz, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    valid_loader = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                              batch_size=args.bsz, collate_fn=collate)

    model = BertModel(tok.get_vocab_size()).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    total_steps = args.epochs * len(train_loader)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_warmup_decay(total_steps, int(args.warmup_ratio * total_steps)))
    scaler = torch.cuda.amp.GradScaler()

    tb = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        tb = SummaryWriter(args.out)
        print(f"train blocks {len(train_ds)}, steps/epoch {len(train_loader)}, total {total_steps}")

    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        tic = time.time()
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.cuda.amp.autocast():
                mlm_logits, _ = model(x)
                loss = F.cross_entropy(mlm_logits.view(-1, mlm_logits.size(-1)).float(), y.view(-1),
                                       ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            if tb is not None and step % 50 == 0:
                tb.add_scalar("loss/train_mlm", loss.item(), step)
                tb.add_scalar("lr", sched.get_last_lr()[0], step)
            if rank == 0 and step % 1000 == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f} {(time.time() - tic):.0f}s", flush=True)

        vloss, vacc = evaluate(model.module, valid_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: valid mlm loss {vloss:.4f} ppl {math.exp(vloss):.2f} acc {vacc:.4f}")
            tb.add_scalar("loss/valid_mlm", vloss, step)
            tb.add_scalar("acc/valid_mlm", vacc, step)
            torch.save({"model": model.module.state_dict(), "step": step, "epoch": epoch},
                       os.path.join(args.out, f"bert_fs_ep{epoch}.pt"))
        dist.barrier()

    if tb is not None:
        tb.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
