"""
Deep Gradient Compression (Lin et al., 2018) for a 2-layer LSTM LM on WikiText-103.

Per layer we keep only the top 0.1% of the accumulated (momentum-corrected)
gradient; everything else stays in the local accumulator (error feedback).
Values and flat indices of all layers are packed into one tensor each and
exchanged with a single all_gather per step.

  torchrun --nproc_per_node=8 13_dgc_lstm_lm.py --data data/wt103 --density 0.001
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class LSTMLM(nn.Module):
    def __init__(self, ntoken, emb=512, hidden=1024, layers=2, dropout=0.25):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, dropout=dropout, batch_first=False)
        self.proj = nn.Linear(hidden, emb)
        self.decoder = nn.Linear(emb, ntoken)
        self.decoder.weight = self.encoder.weight

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.drop(self.encoder(x)), hidden)
        return self.decoder(self.drop(self.proj(out))), hidden

    def init_hidden(self, bsz, device):
        n, h = self.rnn.num_layers, self.rnn.hidden_size
        return (torch.zeros(n, bsz, h, device=device), torch.zeros(n, bsz, h, device=device))


class DGC:
    def __init__(self, params, density, momentum, clip, device):
        self.params = list(params)
        self.world = dist.get_world_size()
        self.momentum, self.clip = momentum, clip
        self.sizes = [p.numel() for p in self.params]
        self.ks = [max(1, int(n * density)) for n in self.sizes]
        self.offsets = [0]
        for n in self.sizes[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.u = [torch.zeros_like(p).view(-1) for p in self.params]  # momentum
        self.v = [torch.zeros_like(p).view(-1) for p in self.params]  # accumulated velocity
        self.total = sum(self.sizes)
        self.device = device

    @torch.no_grad()
    def exchange(self):
        vals, idxs = [], []
        for i, p in enumerate(self.params):
            g = p.grad.view(-1)
            # local gradient clipping, scaled as in the DGC paper
            gn = g.norm()
            max_norm = self.clip / math.sqrt(self.world)
            if gn > max_norm:
                g = g * (max_norm / (gn + 1e-6))
            self.u[i].mul_(self.momentum).add_(g)
            self.v[i].add_(self.u[i])
            _, top = torch.topk(self.v[i].abs(), self.ks[i], sorted=False)
            vals.append(self.v[i][top])
            idxs.append(top + self.offsets[i])
            # momentum factor masking
            self.v[i][top] = 0
            self.u[i][top] = 0
        vals = torch.cat(vals)
        idxs = torch.cat(idxs)
        out_v = torch.empty(vals.numel() * self.world, device=self.device, dtype=vals.dtype)
        out_i = torch.empty(idxs.numel() * self.world, device=self.device, dtype=idxs.dtype)
        dist.all_gather_into_tensor(out_v, vals)
        dist.all_gather_into_tensor(out_i, idxs)
        dense = torch.zeros(self.total, device=self.device)
        dense.index_add_(0, out_i, out_v).div_(self.world)
        for i, p in enumerate(self.params):
            o = self.offsets[i]
            p.grad.copy_(dense[o:o + self.sizes[i]].view_as(p.grad))


def load_tokens(path):
    return torch.load(path)  # 1-D LongTensor produced by prepare_wt103.py


def batchify(tokens, bsz, rank, world):
    per_rank = tokens.numel() // world
    shard = tokens[rank * per_rank:(rank + 1) * per_rank]
    nbatch = shard.numel() // bsz
    return shard[:nbatch * bsz].view(bsz, -1).t().contiguous()


def get_chunk(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def detach(h):
    return tuple(t.detach() for t in h)


@torch.no_grad()
def evaluate(model, source, bsz, bptt, device):
    model.eval()
    hidden = model.init_hidden(bsz, device)
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    for i in range(0, source.size(0) - 1, bptt):
        x, y = get_chunk(source, i, bptt)
        logits, hidden = model(x, hidden)
        acc[0] += F.cross_entropy(logits.view(-1, logits.size(-1)), y, reduction="sum").double()
        acc[1] += y.numel()
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/wt103")
    ap.add_argument("--bsz", type=int, default=32)
    ap.add_argument("--bptt", type=int, default=70)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1.0)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--clip", type=float, default=0.25)
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--save", default="ckpt/dgc_lstm.pt")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1111)

    vocab = torch.load(os.path.join(args.data, "vocab.pt"))
    train = batchify(load_tokens(os.path.join(args.data, "train.pt")), args.bsz, rank, world).to(device)
    valid = batchify(load_tokens(os.path.join(args.data, "valid.pt")), 10, rank, world).to(device)

    model = LSTMLM(len(vocab)).to(device)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    dgc = DGC(model.parameters(), args.density, args.momentum, args.clip, device)
    # momentum lives in DGC, so the optimizer is plain SGD
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.25, patience=0)
    best = float("inf")

    for epoch in range(args.epochs):
        model.train()
        hidden = model.init_hidden(args.bsz, device)
        t0 = time.time()
        total_loss, n = 0.0, 0
        for batch, i in enumerate(range(0, train.size(0) - 1, args.bptt)):
            x, y = get_chunk(train, i, args.bptt)
            hidden = detach(hidden)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits, hidden = model(x, hidden)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y)
            if not torch.isfinite(loss):
                hidden = model.init_hidden(args.bsz, device)
                continue
            opt.zero_grad(set_to_none=False)
            loss.backward()
            dgc.exchange()
            opt.step()
            total_loss += loss.item()
            n += 1
            if rank == 0 and batch % 200 == 0 and n:
                cur = total_loss / n
                print(f"ep {epoch} batch {batch}/{train.size(0) // args.bptt} loss {cur:.3f} "
                      f"ppl {math.exp(cur):.1f} {(time.time() - t0) / max(batch, 1) * 1000:.0f}ms/b")

        val_loss = evaluate(model, valid, 10, args.bptt, device)
        sched.step(val_loss)
        if rank == 0:
            print(f"end of epoch {epoch}: valid ppl {math.exp(val_loss):.2f}, lr {opt.param_groups[0]['lr']}")
            if val_loss < best:
                best = val_loss
                os.makedirs(os.path.dirname(args.save), exist_ok=True)
                torch.save(model.state_dict(), args.save)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
