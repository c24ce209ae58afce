"""Expert-parallel MoE pretraining that streams raw jsonl.gz shards.

Each rank reads its own subset of the shard files (no global index needed, so
the corpus can be far larger than RAM), tokenizes on the fly and packs tokens
into fixed-length sequences. MoE layers use top-1 routing across ranks with
all_to_all_single; dense weights go through DDP, expert weights do not.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29400 \
        18_expert_parallel_streaming.py --shards "/mnt/corpus/shard-*.jsonl.gz" --tokenizer gpt2
"""
import argparse
import glob
import gzip
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from transformers import AutoTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--shards", required=True)
    p.add_argument("--tokenizer", default="gpt2")
    p.add_argument("--save-dir", default="/mnt/ckpt/moe_stream")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=16)
    p.add_argument("--n-heads", type=int, default=16)
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--capacity-factor", type=float, default=1.5)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--save-every", type=int, default=2000)
    return p.parse_args()


class ShardStream(IterableDataset):
    def __init__(self, files, tokenizer, seq_len):
        self.files, self.tok, self.seq_len = files, tokenizer, seq_len

    def __iter__(self):
        info = get_worker_info()
        files = self.files if info is None else self.files[info.id::info.num_workers]
        buf = []
        for path in files:
            with gzip.open(path, "rt") as f:
                for line in f:
                    buf.extend(self.tok.encode(json.loads(line)["text"]) + [self.tok.eos_token_id])
                    while len(buf) >= self.seq_len + 1:
                        chunk, buf = buf[: self.seq_len + 1], buf[self.seq_len + 1:]
                        yield torch.tensor(chunk, dtype=torch.long)


class A2A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        ctx.s = (out_splits, in_splits)
        out = x.new_empty(sum(out_splits), x.size(1))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        o, i = ctx.s
        return A2A.apply(g, i, o), None, None


class ExpertParallelFFN(nn.Module):
    def __init__(self, d, E, cf):
        super().__init__()
        self.ep = dist.get_world_size()
        self.E, self.L, self.cf = E, E // self.ep, cf
        self.router = nn.Linear(d, E, bias=False)
        self.fc1 = nn.Parameter(torch.randn(self.L, d, 4 * d) * 0.02)
        self.fc2 = nn.Parameter(torch.randn(self.L, 4 * d, d) * 0.02)
        self.aux = None

    def forward(self, x):
        shp = x.shape
        x = x.reshape(-1, shp[-1])
        p = self.router(x).float().softmax(-1)
        gate, e = p.max(-1)
        self.aux = self.E * (F.one_hot(e, self.E).float().mean(0) * p.mean(0)).sum()
        cap = math.ceil(self.cf * x.size(0) / self.E)
        oh = F.one_hot(e, self.E)
        keep = (((oh.cumsum(0) - 1) * oh).sum(-1) < cap).nonzero(as_tuple=True)[0]
        keep = keep[torch.argsort(e[keep], stable=True)]
        send = torch.bincount(e[keep], minlength=self.E)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        in_s, out_s = send.view(self.ep, self.L).sum(1).tolist(), recv.view(self.ep, self.L).sum(1).tolist()
        h = A2A.apply(x[keep], out_s, in_s)
        rc = recv.view(self.ep, self.L)
        parts = list(h.split(rc.flatten().tolist()))
        for j in range(self.L):
            ids = [s * self.L + j for s in range(self.ep)]
            y = torch.cat([parts[i] for i in ids])
            y = F.gelu(y @ self.fc1[j].to(y.dtype)) @ self.fc2[j].to(y.dtype)
            for i, piece in zip(ids, y.split(rc[:, j].tolist())):
                parts[i] = piece
        back = A2A.apply(torch.cat(parts), in_s, out_s)
        out = torch.zeros_like(x)
        out[keep] = (back * gate[keep, None]).to(x.dtype)
        return out.view(shp)


class Block(nn.Module):
    def __init__(self, a, moe):
        super().__init__()
        self.h = a.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(a.d_model), nn.LayerNorm(a.d_model)
        self.attn_in, self.attn_out = nn.Linear(a.d_model, 3 * a.d_model), nn.Linear(a.d_model, a.d_model)
        self.ffn = ExpertParallelFFN(a.d_model, a.num_experts, a.capacity_factor) if moe else nn.Sequential(
            nn.Linear(a.d_model, 4 * a.d_model), nn.GELU(), nn.Linear(4 * a.d_model, a.d_model))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.attn_in(self.ln1(x)).chunk(3, -1))
        x = x + self.attn_out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.ffn(self.ln2(x))


class MoELM(nn.Module):
    def __init__(self, a, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, a.d_model)
        self.pos = nn.Embedding(a.seq_len, a.d_model)
        self.blocks = nn.ModuleList([Block(a, moe=i % 2 == 1) for i in range(a.n_layers)])
        self.ln = nn.LayerNorm(a.d_model)
        self.head = nn.Linear(a.d_model, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def main():
    a = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    all_files = sorted(glob.glob(a.shards))
    my_files = all_files[rank::world]
    print(f"[rank {rank}] {len(my_files)} of {len(all_files)} shards", flush=True)
    loader = DataLoader(ShardStream(my_files, tok, a.seq_len), batch_size=a.batch_size,
                        num_workers=4, pin_memory=True, drop_last=True)

    torch.manual_seed(rank)
    model = MoELM(a, len(tok)).to(dev)
    experts = [n for n, _ in model.named_parameters() if n.endswith("ffn.fc1") or n.endswith("ffn.fc2")]
    DDP._set_params_and_buffers_to_ignore_for_model(model, experts)
    ddp = DDP(model, device_ids=[local_rank])
    expert_params = [p for n, p in model.named_parameters() if n in set(experts)]
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    step = 0
    for epoch in range(a.epochs):
        t0 = time.time()
        for ids in loader:
            ids = ids.to(dev, non_blocking=True)
            for g in opt.param_groups:
                g["lr"] = a.lr * min(1.0, (step + 1) / 2000)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = ddp(ids[:, :-1])
            ce = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            aux = torch.stack([b.ffn.aux for b in model.blocks if isinstance(b.ffn, ExpertParallelFFN)]).mean()
            opt.zero_grad(set_to_none=True)
            (ce + a.aux_coef * aux).backward()
            for p in expert_params:
                p.grad.div_(world)
            opt.step()
            step += 1
            if step % 50 == 0:
                stats = torch.stack([ce.detach(), aux.detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} ce {stats[0]:.4f} aux {stats[1]:.4f} "
                          f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                    t0 = time.time()
            if step % a.save_every == 0:
                os.makedirs(a.save_dir, exist_ok=True)
                sd = model.state_dict()
                torch.save({k: sd[k].cpu() for k in experts}, os.path.join(a.save_dir, f"step{step}_experts_{rank:03d}.pt"))
                if rank == 0:
                    torch.save({"model": {k: v.cpu() for k, v in sd.items() if k not in set(experts)},
                                "opt_step": step}, os.path.join(a.save_dir, f"step{step}_dense.pt"))
                dist.barrier()
        if rank == 0:
            print(f"epoch {epoch} finished after {step} steps", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
