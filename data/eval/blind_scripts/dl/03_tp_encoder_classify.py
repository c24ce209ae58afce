"""Fine-tune a tensor-parallel transformer encoder for sentence classification.

2D layout: ranks [0..tp) form the first tensor-parallel group, data parallel runs
across TP groups. Gradients of the data-parallel replicas are averaged by hand.

    torchrun --nproc_per_node=8 03_tp_encoder_classify.py --tp 2 --train data/mnli_train.pt --dev data/mnli_dev.pt
"""
import argparse
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger("tp_cls")


def _groups_containing_me(rank, rank_lists):
    for ranks in rank_lists:
        if rank in ranks:
            return dist.new_group(ranks)
    raise RuntimeError(f"rank {rank} is in none of {rank_lists}")


class ParallelState:
    def __init__(self, tp):
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.tp = tp
        self.dp = self.world // tp
        tp_lists = [list(range(i * tp, (i + 1) * tp)) for i in range(self.dp)]
        dp_lists = [list(range(j, self.world, tp)) for j in range(tp)]
        self.tp_group = _groups_containing_me(self.rank, tp_lists)
        self.dp_group = _groups_containing_me(self.rank, dp_lists)
        self.tp_rank = self.rank % tp
        self.dp_rank = self.rank // tp


PS = None


class _Identity_AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=PS.tp_group)
        return g


class _AllReduce_IdentityGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=PS.tp_group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def sharded_weight(out_f, in_f, dim):
    w = torch.empty(out_f, in_f)
    nn.init.xavier_normal_(w)
    return nn.Parameter(torch.chunk(w, PS.tp, dim=dim)[PS.tp_rank].clone())


class ColParallel(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.weight = sharded_weight(o, i, 0)
        self.bias = nn.Parameter(torch.zeros(o // PS.tp))

    def forward(self, x):
        return F.linear(_Identity_AllReduceGrad.apply(x), self.weight, self.bias)


class RowParallel(nn.Module):
    def __init__(self, i, o):
        super().__init__()
        self.weight = sharded_weight(o, i, 1)
        self.bias = nn.Parameter(torch.zeros(o))

    def forward(self, x):
        return _AllReduce_IdentityGrad.apply(F.linear(x, self.weight)) + self.bias


class VocabEmbedding(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        assert vocab % PS.tp == 0
        self.per = vocab // PS.tp
        self.lo = PS.tp_rank * self.per
        w = torch.empty(vocab, d).normal_(std=0.02)
        self.weight = nn.Parameter(w[self.lo:self.lo + self.per].clone())

    def forward(self, ids):
        outside = (ids < self.lo) | (ids >= self.lo + self.per)
        local = (ids - self.lo).masked_fill(outside, 0)
        e = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _AllReduce_IdentityGrad.apply(e)


class EncoderLayer(nn.Module):
    def __init__(self, d, heads, ff, p_drop):
        super().__init__()
        self.h = heads // PS.tp
        self.dh = d // heads
        self.qkv = ColParallel(d, 3 * d)
        self.o = RowParallel(d, d)
        self.ff1 = ColParallel(d, ff)
        self.ff2 = RowParallel(ff, d)
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(p_drop)

    def forward(self, x, pad_mask):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.h, 3, self.dh).permute(3, 0, 2, 1, 4)
        attn_mask = pad_mask[:, None, None, :]  # True = attend
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=attn_mask)
        x = self.n1(x + self.drop(self.o(a.transpose(1, 2).reshape(B, T, -1))))
        return self.n2(x + self.drop(self.ff2(F.gelu(self.ff1(x)))))


class Classifier(nn.Module):
    def __init__(self, vocab, d, heads, layers, ff, max_len, n_cls, p_drop=0.1):
        super().__init__()
        self.tok = VocabEmbedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads, ff, p_drop) for _ in range(layers))
        self.pool = nn.Linear(d, d)
        self.cls = nn.Linear(d, n_cls)

    def forward(self, ids, pad_mask):
        x = self.norm(self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device)))
        for layer in self.layers:
            x = layer(x, pad_mask)
        return self.cls(torch.tanh(self.pool(x[:, 0])))


def allreduce_grads(params, group, world):
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    flat.div_(world)
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def load_split(path):
    d = torch.load(path, map_location="cpu")
    return TensorDataset(d["input_ids"], d["attention_mask"].bool(), d["labels"])


def main():
    global PS
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--dev", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=30528)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--classes", type=int, default=3)
    ap.add_argument("--batch-per-replica", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default="runs/tp_cls")
    args = ap.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    PS = ParallelState(args.tp)
    torch.manual_seed(42)
    if PS.rank != 0:
        log.setLevel(logging.WARNING)

    model = Classifier(args.vocab, args.d, args.heads, args.layers, 4 * args.d,
                       args.max_len, args.classes).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)

    train_ds, dev_ds = load_split(args.train), load_split(args.dev)
    sampler = DistributedSampler(train_ds, num_replicas=PS.dp, rank=PS.dp_rank, shuffle=True, seed=17)
    train_dl = DataLoader(train_ds, batch_size=args.batch_per_replica, sampler=sampler,
                          num_workers=2, pin_memory=True, drop_last=True)
    # strided split of the dev set, no padding, so the accuracy is exact
    dev_dl = DataLoader(Subset(dev_ds, range(PS.dp_rank, len(dev_ds), PS.dp)), batch_size=64)
    total = args.epochs * len(train_dl)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=total, pct_start=0.06,
                                                anneal_strategy="linear")

    best = 0.0
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        model.train()
        for step, (ids, mask, y) in enumerate(train_dl):
            ids, mask, y = ids.cuda(non_blocking=True), mask.cuda(non_blocking=True), y.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, mask)
            loss = F.cross_entropy(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            allreduce_grads(params, PS.dp_group, PS.dp)
            opt.step()
            sched.step()
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, group=PS.dp_group)
                log.info("epoch %d step %d/%d loss %.4f", ep, step, len(train_dl), l.item() / PS.dp)

        model.eval()
        stats = torch.zeros(2, device="cuda")
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for ids, mask, y in dev_dl:
                pred = model(ids.cuda(), mask.cuda()).argmax(-1)
                stats[0] += (pred == y.cuda()).sum()
                stats[1] += y.numel()
        dist.all_reduce(stats, group=PS.dp_group)
        acc = (stats[0] / stats[1]).item()
        log.info("epoch %d dev acc %.4f", ep, acc)
        if acc > best:
            best = acc
            if PS.dp_rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save(model.state_dict(), os.path.join(args.out, f"best_tp{PS.tp_rank}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
