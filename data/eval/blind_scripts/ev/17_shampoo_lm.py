"""LSTM language model on WikiText-103 (BPE-32k): Shampoo for the recurrent and
projection weights, AdamW for the embedding (too large for a Kronecker factor).

Token streams are pre-encoded to int32 .npy files by tools/encode_wt103.py.

    torchrun --nproc_per_node=4 shampoo_lm.py --data /data/wt103_bpe32k --out runs/lstm_shampoo
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch_optimizer
from torch.nn.parallel import DistributedDataParallel as DDP


class LSTMLM(nn.Module):
    def __init__(self, vocab, emb=512, hidden=1024, layers=2, dropout=0.3):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(emb, hidden, layers, dropout=dropout, batch_first=True)
        self.proj = nn.Linear(hidden, emb)
        self.out = nn.Linear(emb, vocab)
        self.out.weight = self.embed.weight

    def forward(self, x, hidden=None):
        h, hidden = self.rnn(self.drop(self.embed(x)), hidden)
        return self.out(self.drop(self.proj(h))), hidden


def rank_stream(path, rank, world, batch_size):
    """Contiguous equal-length slice of the token stream for this rank, laid out as [batch_size, T]."""
    tokens = torch.from_numpy(np.load(path).astype(np.int64))
    per_rank = len(tokens) // world
    mine = tokens[rank * per_rank:(rank + 1) * per_rank]
    cols = len(mine) // batch_size
    return mine[:cols * batch_size].view(batch_size, cols)


def detach(hidden):
    return tuple(h.detach() for h in hidden)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bptt", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.3, help="Shampoo LR (global batch 4 x 32)")
    ap.add_argument("--emb-lr", type=float, default=1e-3, help="AdamW LR for the embedding")
    ap.add_argument("--update-freq", type=int, default=50, help="Shampoo preconditioner update interval")
    ap.add_argument("--clip", type=float, default=0.25)
    ap.add_argument("--log-every", type=int, default=200)
    return ap.parse_args()


@torch.no_grad()
def evaluate(model, stream, bptt, device):
    model.eval()
    hidden = None
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(0, stream.size(1) - 1, bptt):
        n = min(bptt, stream.size(1) - 1 - i)
        x = stream[:, i:i + n].to(device)
        y = stream[:, i + 1:i + 1 + n].to(device)
        logits, hidden = model(x, hidden)
        tot[0] += F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum").double()
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1111)

    train = rank_stream(os.path.join(args.data, "train.npy"), rank, world, args.batch_size)
    valid = rank_stream(os.path.join(args.data, "valid.npy"), rank, world, 10)

    net = LSTMLM(args.vocab).to(device)
    model = DDP(net, device_ids=[local_rank])

    emb_params = [net.embed.weight]
    other = [p for n, p in net.named_parameters() if n != "embed.weight"]
    shampoo = torch_optimizer.Shampoo(other, lr=args.lr, momentum=0.9, epsilon=1e-4,
                                      update_freq=args.update_freq)
    adamw = torch.optim.AdamW(emb_params, lr=args.emb_lr, weight_decay=0.0)
    optimizers = [shampoo, adamw]
    base_lrs = [args.lr, args.emb_lr]

    steps_per_epoch = (train.size(1) - 1) // args.bptt
    total = args.epochs * steps_per_epoch
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}: {train.numel():,} tokens per rank, {steps_per_epoch} steps/epoch", flush=True)

    step = 0
    best = float("inf")
    for epoch in range(args.epochs):
        hidden = None
        t0 = time.time()
        for i in range(0, steps_per_epoch * args.bptt, args.bptt):
            x = train[:, i:i + args.bptt].to(device, non_blocking=True)
            y = train[:, i + 1:i + 1 + args.bptt].to(device, non_blocking=True)
            frac = step / total
            for opt, base in zip(optimizers, base_lrs):
                for g in opt.param_groups:
                    g["lr"] = base * min(1.0, (step + 1) / 1000) * 0.5 * (1 + math.cos(math.pi * frac))
            if hidden is not None:
                hidden = detach(hidden)
            logits, hidden = model(x, hidden)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for opt in optimizers:
                opt.step()
            step += 1

            if rank == 0 and step % args.log_every == 0:
                avg = loss.detach().clone()
                dist.all_reduce(avg, op=dist.ReduceOp.AVG)
                elapsed = time.time() - t0
                print(f"epoch {epoch} step {step} loss {avg.item():.3f} ppl {math.exp(avg.item()):.1f} "
                      f"{elapsed * 1000 / args.log_every:.0f}ms/step", flush=True)
                t0 = time.time()

        val_loss = evaluate(model.module, valid, args.bptt, device)
        if rank == 0:
            print(f"== epoch {epoch} valid loss {val_loss:.3f} ppl {math.exp(val_loss):.2f}", flush=True)
            state = {"model": net.state_dict(), "shampoo": shampoo.state_dict(), "adamw": adamw.state_dict(),
                     "epoch": epoch, "step": step}
            torch.save(state, os.path.join(args.out, "last.pt"))
            if val_loss < best:
                torch.save(state, os.path.join(args.out, "best.pt"))
        best = min(best, val_loss)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
