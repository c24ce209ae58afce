"""2D parallel (FSDP over "dp" x tensor parallel over "tp") training of a small
Llama-style model with torch.distributed.tensor.parallel.

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
    04_dtensor_llama_2d.py --tp 8 --data /shared/datasets/slimpajama_2k_tok --ckpt /shared/ckpt/llama2d
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Attention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.head_dim = d // n_heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        # -1: after tensor parallel each rank only holds n_heads / tp heads
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, n_heads, hidden):
        super().__init__()
        self.attn_norm, self.ffn_norm = RMSNorm(d), RMSNorm(d)
        self.attn = Attention(d, n_heads)
        self.ffn = FeedForward(d, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab, d, n_layers, n_heads, hidden, max_len):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(Block(d, n_heads, hidden) for _ in range(n_layers))
        self.norm = RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def apply_tp(model, tp_mesh):
    for block in model.layers:
        plan = {
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
            "ffn.w1": ColwiseParallel(),
            "ffn.w3": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(model, tp_mesh, {"output": ColwiseParallel(output_layouts=Replicate())})


def apply_fsdp(model, dp_mesh):
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)


def cosine(step, warmup, total):
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt", default="ckpt/llama2d")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch-per-dp", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
    is_main = dist.get_rank() == 0
    torch.manual_seed(0)

    model = Llama(args.vocab, args.dim, args.layers, args.heads, args.ffn, args.seq).cuda()
    apply_tp(model, tp_mesh)
    apply_fsdp(model, dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    ds = load_from_disk(args.data)
    ds.set_format("torch", columns=["input_ids"])
    train_ds, val_ds = ds["train"], ds["validation"]
    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=1)
    loader = DataLoader(train_ds, batch_size=args.batch_per_dp, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_per_dp, sampler=val_sampler, drop_last=True)
    total_steps = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, args.warmup, total_steps))

    step = 0
    if os.path.isdir(args.ckpt) and os.path.exists(os.path.join(args.ckpt, "latest")):
        with open(os.path.join(args.ckpt, "latest")) as f:
            path = os.path.join(args.ckpt, f.read().strip())
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = int(path.rsplit("_", 1)[-1])
        for _ in range(step):
            sched.step()
        if is_main:
            print(f"resumed from {path}", flush=True)

    start_epoch = step // len(loader)
    for epoch in range(start_epoch, args.epochs):
        model.train()
        t0 = time.time()
        for batch in loader:
            ids = batch["input_ids"].cuda(non_blocking=True)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 10 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
                if is_main:
                    tps = 10 * args.batch_per_dp * dp_size * args.seq / (time.time() - t0)
                    print(f"ep {epoch} step {step} loss {l.item():.4f} gnorm {gnorm.full_tensor().item():.3f} "
                          f"tok/s {tps:,.0f}", flush=True)
                    t0 = time.time()

            if step % args.save_every == 0:
                msd, osd = get_state_dict(model, opt)
                path = os.path.join(args.ckpt, f"step_{step}")
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
                if is_main:
                    with open(os.path.join(args.ckpt, "latest"), "w") as f:
                        f.write(f"step_{step}")

        model.eval()
        acc = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for batch in val_loader:
                ids = batch["input_ids"].cuda(non_blocking=True)
                logits = model(ids[:, :-1])
                acc[0] += F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
                acc[1] += 1
        dist.all_reduce(acc, group=dp_mesh.get_group())
        if is_main:
            vl = (acc[0] / acc[1]).item()
            print(f"epoch {epoch} val loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
