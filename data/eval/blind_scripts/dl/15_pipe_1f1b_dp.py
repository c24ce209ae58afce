"""1F1B pipeline parallelism x data parallelism for a GPT-style LM.

rank = dp_rank * pp + stage. Activations / gradients move between neighbouring
stages with batched isend/irecv; gradients of each stage are averaged over
its data-parallel replicas after the pipeline flush.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        15_pipe_1f1b_dp.py --pp 4 --data /shared/data/tok_train.bin --ckpt /shared/ckpt/pp4
"""
import argparse
import math
import os
import time
from collections import deque

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Topo:
    def __init__(self, pp):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pp, self.dp = pp, self.world // pp
        self.stage, self.dp_rank = self.rank % pp, self.rank // pp
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.prev, self.next = self.rank - 1, self.rank + 1
        self.pp_group = self.dp_group = None
        for d in range(self.dp):  # all ranks create all groups, in the same order
            g = dist.new_group([d * pp + s for s in range(pp)])
            if d == self.dp_rank:
                self.pp_group = g
        for s in range(pp):
            g = dist.new_group([d * pp + s for d in range(self.dp)])
            if s == self.stage:
                self.dp_group = g


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class StageModule(nn.Module):
    def __init__(self, topo, vocab, d, h, n_layer, seq):
        super().__init__()
        self.topo = topo
        per = n_layer // topo.pp
        if topo.first:
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(per))
        if topo.last:
            self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        if self.topo.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x)) if self.topo.last else x


class P2P:
    def __init__(self, topo, shape):
        self.t, self.shape = topo, shape

    def _run(self, send_next=None, recv_prev=False, send_prev=None, recv_next=False):
        ops, fwd, bwd = [], None, None
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.t.prev))
        if recv_prev:
            fwd = torch.empty(self.shape, device="cuda", dtype=torch.float32)
            ops.append(dist.P2POp(dist.irecv, fwd, self.t.prev))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.t.next))
        if recv_next:
            bwd = torch.empty(self.shape, device="cuda", dtype=torch.float32)
            ops.append(dist.P2POp(dist.irecv, bwd, self.t.next))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return fwd, bwd

    def recv_forward(self):
        return None if self.t.first else self._run(recv_prev=True)[0]

    def send_forward(self, y):
        if not self.t.last:
            self._run(send_next=y)

    def recv_backward(self):
        return None if self.t.last else self._run(recv_next=True)[1]

    def send_backward(self, dx):
        if not self.t.first:
            self._run(send_prev=dx)

    def send_forward_recv_backward(self, y):
        return None if self.t.last else self._run(send_next=y, recv_next=True)[1]

    def send_backward_recv_forward(self, dx):
        return None if self.t.first else self._run(send_prev=dx, recv_prev=True)[0]


def train_step(model, p2p, topo, ids, labels, n_micro):
    ids_mb, lab_mb = ids.chunk(n_micro), labels.chunk(n_micro)
    losses = []

    def fwd(i, x):
        if topo.first:
            x = ids_mb[i]
        else:
            x.requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        if topo.last:
            loss = F.cross_entropy(y.float().flatten(0, 1), lab_mb[i].flatten()) / n_micro
            losses.append(loss.detach())
            return x, loss
        return x, y.float()

    def bwd(x, y, dy):
        torch.autograd.backward(y, grad_tensors=None if topo.last else dy)
        return None if topo.first else x.grad

    warmup = min(topo.pp - topo.stage - 1, n_micro)
    steady = n_micro - warmup
    xs, ys = deque(), deque()
    for i in range(warmup):
        x, y = fwd(i, p2p.recv_forward())
        p2p.send_forward(y.detach() if not topo.last else None)
        xs.append(x)
        ys.append(y)
    x_next = p2p.recv_forward() if steady > 0 else None
    for i in range(steady):
        x, y = fwd(warmup + i, x_next)
        dy = p2p.send_forward_recv_backward(y.detach() if not topo.last else None)
        xs.append(x)
        ys.append(y)
        dx = bwd(xs.popleft(), ys.popleft(), dy)
        if i == steady - 1:
            p2p.send_backward(dx)
        else:
            x_next = p2p.send_backward_recv_forward(dx)
    for _ in range(warmup):
        dy = p2p.recv_backward()
        p2p.send_backward(bwd(xs.popleft(), ys.popleft(), dy))
    return torch.stack(losses).sum() if topo.last else None


@torch.no_grad()
def finish_grads(model, topo, max_norm):
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for g in grads:
        g.div_(topo.dp)
        dist.all_reduce(g, group=topo.dp_group)
    sq = torch.zeros((), device="cuda")
    for g in grads:
        sq += g.float().pow(2).sum()
    dist.all_reduce(sq, group=topo.pp_group)  # norm over the whole model = all stages
    scale = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)


class Tok(Dataset):
    def __init__(self, path, seq):
        self.m, self.seq = np.memmap(path, dtype=np.uint16, mode="r"), seq

    def __len__(self):
        return (len(self.m) - 1) // self.seq

    def __getitem__(self, i):
        t = torch.from_numpy(self.m[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return t[:-1], t[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt", default="ckpt/pp")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-bs", type=int, default=2)
    ap.add_argument("--n-micro", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--iters", type=int, default=50000)
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    topo = Topo(args.pp)
    dist.barrier()  # first collective on the world group before any batched p2p
    torch.manual_seed(1000 + topo.stage)

    model = StageModule(topo, args.vocab, args.d, args.heads, args.layers, args.seq).cuda()
    for p in model.parameters():  # identical replicas across data parallel
        dist.broadcast(p.data, src=topo.stage, group=topo.dp_group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 1000) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.iters))))
    p2p = P2P(topo, (args.micro_bs, args.seq, args.d))

    it = 0
    path = os.path.join(args.ckpt, f"stage{topo.stage:02d}.pt")
    if os.path.exists(path):
        sd = torch.load(path, map_location="cuda")
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        sched.load_state_dict(sd["sched"])
        it = sd["it"]

    ds = Tok(args.data, args.seq)
    # every stage of one pipeline reads the same batches: shard by dp_rank only
    sampler = DistributedSampler(ds, num_replicas=topo.dp, rank=topo.dp_rank, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.micro_bs * args.n_micro, sampler=sampler,
                    num_workers=2, pin_memory=True, drop_last=True)

    epoch = it // len(dl)
    t0 = time.time()
    while it < args.iters:
        sampler.set_epoch(epoch)
        for ids, labels in dl:
            opt.zero_grad(set_to_none=True)
            loss = train_step(model, p2p, topo, ids.cuda(non_blocking=True), labels.cuda(non_blocking=True), args.n_micro)
            finish_grads(model, topo, 1.0)
            opt.step()
            sched.step()
            it += 1
            if topo.last and it % 10 == 0:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=topo.dp_group)
                if topo.dp_rank == 0:
                    print(f"it {it} loss {loss.item():.4f} {(time.time() - t0) * 100:.0f} ms/it", flush=True)
                    t0 = time.time()
            if it % args.save_every == 0:
                if topo.dp_rank == 0:
                    os.makedirs(args.ckpt, exist_ok=True)
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "it": it}, path)
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
