"""Pipeline-parallel token tagger (NER / POS) with dynamic padding.

Only the first stage reads data. Because batches are padded to the longest
sentence, the shape of the activations changes from batch to batch and is
passed down the pipe before the activations.

    torchrun --nproc_per_node 4 05_pipe_token_tagger.py --train data/ner_train.pt --dev data/ner_dev.pt
"""
import argparse
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

IGNORE = -100


def collate(batch):
    ids = pad_sequence([b[0] for b in batch], batch_first=True, padding_value=0)
    tags = pad_sequence([b[1] for b in batch], batch_first=True, padding_value=IGNORE)
    return ids, tags


class Layer(nn.Module):
    def __init__(self, d, h, drop):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(d, h, 4 * d, drop, activation="gelu",
                                              batch_first=True, norm_first=True)

    def forward(self, x):
        return self.enc(x)


def build_stage(args, stage, n_stages):
    per = args.layers // n_stages
    mods = []
    if stage == 0:
        mods.append(Embed(args.vocab, args.d, args.max_len))
    mods += [Layer(args.d, args.heads, args.dropout) for _ in range(per)]
    if stage == n_stages - 1:
        mods += [nn.LayerNorm(args.d), nn.Linear(args.d, args.n_tags)]
    return nn.Sequential(*mods)


class Embed(nn.Module):
    def __init__(self, vocab, d, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(max_len, d)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))


def pass_shape(shape, rank, world):
    """Forward (batch, length) from stage 0 to every later stage. batch == 0 ends the epoch."""
    if rank == 0:
        meta = torch.tensor(shape, dtype=torch.long)
    else:
        meta = torch.empty(2, dtype=torch.long)
        dist.recv(meta, src=rank - 1)
    if rank < world - 1:
        dist.send(meta, dst=rank + 1)
    return tuple(meta.tolist())


def run_batch(model, opt, rank, world, n_micro, ids=None, tags=None, d=768, train=True):
    first, last = rank == 0, rank == world - 1
    B, T = pass_shape(tuple(ids.shape) if first else (0, 0), rank, world)
    if B == 0:
        return True, None
    if first:
        dist.send(tags.contiguous(), dst=world - 1)
    if last:
        tags = torch.empty(B, T, dtype=torch.long, device="cuda")
        dist.recv(tags, src=0)

    mb = B // n_micro
    inputs, outputs = [], []
    loss_sum, n_tok = torch.zeros((), device="cuda"), (tags != IGNORE).sum() if last else None
    for m in range(n_micro):
        if first:
            x = ids[m * mb:(m + 1) * mb]
        else:
            x = torch.empty(mb, T, d, device="cuda")
            dist.recv(x, src=rank - 1)
            x.requires_grad_(train)
        with torch.set_grad_enabled(train):
            y = model(x)
        if last:
            t = tags[m * mb:(m + 1) * mb]
            loss = F.cross_entropy(y.flatten(0, 1), t.flatten(), ignore_index=IGNORE, reduction="sum") / n_tok
            loss_sum += loss.detach()
            outputs.append(loss)
        else:
            dist.send(y.detach().contiguous(), dst=rank + 1)
            outputs.append(y)
        inputs.append(x)

    if train:
        for x, y in zip(inputs, outputs):
            if last:
                y.backward()
            else:
                g = torch.empty_like(y)
                dist.recv(g, src=rank + 1)
                y.backward(g)
            if not first:
                dist.send(x.grad.contiguous(), dst=rank - 1)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return False, (loss_sum if last else None)


def epoch_loop(model, opt, args, rank, world, loader, train):
    model.train(train)
    tot, steps = 0.0, 0
    batches = iter(loader) if rank == 0 else None
    while True:
        ids = tags = None
        if rank == 0:
            nxt = next(batches, None)
            if nxt is None:
                ids = torch.empty(0, 0, dtype=torch.long)  # tells the later stages to stop
            else:
                ids, tags = nxt[0].cuda(non_blocking=True), nxt[1].cuda(non_blocking=True)
        done, loss = run_batch(model, opt, rank, world, args.n_micro, ids, tags, args.d, train)
        if done:
            break
        if loss is not None:
            tot += loss.item()
        steps += 1
        if rank == world - 1 and train and steps % args.log_every == 0:
            print(f"step {steps} loss {tot / steps:.4f}", flush=True)
    return tot / max(steps, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--n-tags", type=int, default=9)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--n-micro", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--out", default="ckpt/pipe_tagger")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert args.layers % world == 0 and args.batch % args.n_micro == 0
    random.seed(0)
    torch.manual_seed(rank)

    model = build_stage(args, rank, world).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    train_loader = dev_loader = None
    if rank == 0:
        train_set = torch.load(args.train, map_location="cpu")  # list of (ids, tags) tensors
        dev_set = torch.load(args.dev, map_location="cpu")
        train_loader = DataLoader(train_set, batch_size=args.batch, shuffle=True, drop_last=True,
                                  collate_fn=collate, num_workers=2)
        dev_loader = DataLoader(dev_set, batch_size=args.batch, shuffle=False, drop_last=True,
                                collate_fn=collate)

    best = float("inf")
    for ep in range(args.epochs):
        epoch_loop(model, opt, args, rank, world, train_loader, train=True)
        with torch.no_grad():
            dev_loss = epoch_loop(model, opt, args, rank, world, dev_loader, train=False)
        # the dev loss only exists on the last stage; share it so every stage agrees on "best"
        t = torch.tensor([dev_loss], device="cuda")
        dist.broadcast(t, src=world - 1)
        dev_loss = t.item()
        if rank == world - 1:
            print(f"epoch {ep} dev loss {dev_loss:.4f}", flush=True)
        if dev_loss < best:
            best = dev_loss
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(args.out, f"stage{rank}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
