"""
Transformer-base NMT (de->en), fairseq-style dictionaries, label smoothed CE.

    torchrun --nproc_per_node=8 02_nmt_transformer_torchrun.py --data data-bin/iwslt14.de-en
"""
import argparse
import logging
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

logging.basicConfig(format="%(asctime)s | %(levelname)s | %(message)s", level=logging.INFO)
logger = logging.getLogger("nmt")

PAD, BOS, EOS, UNK = 0, 1, 2, 3


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--save-dir", default="checkpoints/transformer")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=4000)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--max-epoch", type=int, default=50)
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dropout", type=float, default=0.3)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


def load_dict(path):
    syms = ["<pad>", "<s>", "</s>", "<unk>"]
    with open(path, encoding="utf-8") as f:
        for line in f:
            syms.append(line.split()[0])
    return {s: i for i, s in enumerate(syms)}


class ParallelText(Dataset):
    def __init__(self, src_path, tgt_path, sdict, tdict, max_len):
        self.pairs = []
        with open(src_path, encoding="utf-8") as fs, open(tgt_path, encoding="utf-8") as ft:
            for s, t in zip(fs, ft):
                s_ids = [sdict.get(w, UNK) for w in s.split()][: max_len - 1] + [EOS]
                t_ids = [tdict.get(w, UNK) for w in t.split()][: max_len - 1] + [EOS]
                self.pairs.append((s_ids, t_ids))

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


def collater(samples):
    src = [torch.tensor(s) for s, _ in samples]
    tgt = [torch.tensor(t) for _, t in samples]
    prev = [torch.cat([torch.tensor([BOS]), t[:-1]]) for t in tgt]
    pad = lambda xs: nn.utils.rnn.pad_sequence(xs, batch_first=True, padding_value=PAD)
    return pad(src), pad(prev), pad(tgt)


class PositionalEmbedding(nn.Module):
    def __init__(self, d, max_len=1024):
        super().__init__()
        pe = torch.zeros(max_len, d)
        pos = torch.arange(max_len).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, d, 2).float() * (-math.log(10000.0) / d))
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        return x + self.pe[: x.size(1)].unsqueeze(0)


class TransformerNMT(nn.Module):
    def __init__(self, n_src, n_tgt, d_model, layers, dropout):
        super().__init__()
        self.d_model = d_model
        self.src_emb = nn.Embedding(n_src, d_model, padding_idx=PAD)
        self.tgt_emb = nn.Embedding(n_tgt, d_model, padding_idx=PAD)
        self.pos = PositionalEmbedding(d_model)
        self.drop = nn.Dropout(dropout)
        self.transformer = nn.Transformer(d_model, 8, layers, layers, 4 * d_model, dropout, batch_first=True)
        self.proj = nn.Linear(d_model, n_tgt, bias=False)
        self.proj.weight = self.tgt_emb.weight

    def forward(self, src, prev):
        s = self.drop(self.pos(self.src_emb(src) * math.sqrt(self.d_model)))
        t = self.drop(self.pos(self.tgt_emb(prev) * math.sqrt(self.d_model)))
        causal = self.transformer.generate_square_subsequent_mask(prev.size(1)).to(src.device)
        h = self.transformer(s, t, tgt_mask=causal, src_key_padding_mask=src.eq(PAD),
                             tgt_key_padding_mask=prev.eq(PAD), memory_key_padding_mask=src.eq(PAD))
        return self.proj(h)


def label_smoothed_nll(logits, target, eps):
    lprobs = F.log_softmax(logits.float(), dim=-1).view(-1, logits.size(-1))
    target = target.view(-1)
    mask = target.ne(PAD)
    nll = -lprobs.gather(1, target.unsqueeze(1)).squeeze(1)
    smooth = -lprobs.mean(-1)
    loss = ((1 - eps) * nll + eps * smooth)[mask].sum()
    return loss, nll[mask].sum(), mask.sum()


def inverse_sqrt(step, warmup):
    step = max(step, 1)
    return min(step / warmup, math.sqrt(warmup / step))


@torch.no_grad()
def evaluate(model, loader, eps, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for src, prev, tgt in loader:
        src, prev, tgt = src.to(device), prev.to(device), tgt.to(device)
        _, nll, ntok = label_smoothed_nll(model(src, prev), tgt, eps)
        tot[0] += nll.double()
        tot[1] += ntok
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item() / math.log(2)


def main():
    args = parse_args()
    torch.cuda.set_device(args.local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda", args.local_rank)
    torch.manual_seed(args.seed)

    sdict = load_dict(os.path.join(args.data, f"dict.{args.src}.txt"))
    tdict = load_dict(os.path.join(args.data, f"dict.{args.tgt}.txt"))
    pfx = lambda split, l: os.path.join(args.data, f"{split}.{args.src}-{args.tgt}.{l}")
    train_ds = ParallelText(pfx("train", args.src), pfx("train", args.tgt), sdict, tdict, args.max_len)
    valid_ds = ParallelText(pfx("valid", args.src), pfx("valid", args.tgt), sdict, tdict, args.max_len)

    train_sampler = DistributedSampler(train_ds, num_replicas=world_size, rank=rank, shuffle=True,
                                       seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collater, num_workers=2, pin_memory=True, drop_last=True)
    valid_shard = Subset(valid_ds, list(range(rank, len(valid_ds), world_size)))
    valid_loader = DataLoader(valid_shard, batch_size=args.batch_size, collate_fn=collater)

    model = TransformerNMT(len(sdict), len(tdict), args.d_model, args.layers, args.dropout).to(device)
    model = DistributedDataParallel(model, device_ids=[args.local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: inverse_sqrt(s, args.warmup))

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        logger.info(f"world_size={world_size} src_vocab={len(sdict)} tgt_vocab={len(tdict)} "
                    f"params={sum(p.numel() for p in model.parameters())}")

    best, bad_epochs, num_updates = float("inf"), 0, 0
    for epoch in range(1, args.max_epoch + 1):
        train_sampler.set_epoch(epoch)
        start = time.time()
        for i, (src, prev, tgt) in enumerate(train_loader):
            src, prev, tgt = src.to(device), prev.to(device), tgt.to(device)
            loss, nll, ntok = label_smoothed_nll(model(src, prev), tgt, args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            (loss / ntok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 25.0)
            optimizer.step()
            scheduler.step()
            num_updates += 1
            if rank == 0 and num_updates % 100 == 0:
                logger.info(f"epoch {epoch:03d} | upd {num_updates} | loss {loss.item() / ntok.item() / math.log(2):.3f}"
                            f" | lr {scheduler.get_last_lr()[0]:.2e} | {time.time() - start:.0f}s")

        valid_nll = evaluate(model.module, valid_loader, args.label_smoothing, device)
        if rank == 0:
            logger.info(f"epoch {epoch:03d} | valid nll_loss {valid_nll:.3f} | ppl {2 ** valid_nll:.2f}")
            ckpt = {"args": vars(args), "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(), "num_updates": num_updates, "epoch": epoch}
            torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_last.pt"))
        if valid_nll < best:
            best, bad_epochs = valid_nll, 0
            if rank == 0:
                torch.save(ckpt, os.path.join(args.save_dir, "checkpoint_best.pt"))
        else:
            bad_epochs += 1
        dist.barrier()
        if bad_epochs >= args.patience:
            if rank == 0:
                logger.info(f"early stop: no improvement for {args.patience} epochs")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
