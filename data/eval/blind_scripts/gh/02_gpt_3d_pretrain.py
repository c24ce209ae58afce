"""
GPT pretraining, 3D parallel (pipeline x FSDP2 x tensor parallel), pure torch.

torchrun --standalone --nproc_per_node=8 train_gpt3d.py --pp 2 --tp 2 --data_dir data/openwebtext
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor import Replicate


# -----------------------------------------------------------------------------
# model

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head, self.hd = n_head, n_embd // n_head
        self.q_proj = nn.Linear(n_embd, n_embd)
        self.k_proj = nn.Linear(n_embd, n_embd)
        self.v_proj = nn.Linear(n_embd, n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTStage(nn.Module):
    """The slice of GPT owned by one pipeline stage."""

    def __init__(self, cfg, layer_ids, first, last):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["n_embd"]) if first else None
        self.wpe = nn.Embedding(cfg["block_size"], cfg["n_embd"]) if first else None
        self.h = nn.ModuleDict({str(i): Block(cfg["n_embd"], cfg["n_head"]) for i in layer_ids})
        self.ln_f = nn.LayerNorm(cfg["n_embd"]) if last else None
        self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False) if last else None

    def forward(self, x):
        if self.wte is not None:
            pos = torch.arange(x.size(1), device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for blk in self.h.values():
            x = blk(x)
        if self.ln_f is not None:
            x = self.lm_head(self.ln_f(x))
        return x

    @torch.no_grad()
    def reset_parameters(self):
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                std = 0.02 / math.sqrt(2 * self.cfg["n_layer"]) if name.endswith("c_proj") else 0.02
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()


# -----------------------------------------------------------------------------
# data

def get_batch(data, batch_size, block_size, gen):
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


# -----------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data_dir", default="data/openwebtext")
    p.add_argument("--out_dir", default="out/gpt3d")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--n_layer", type=int, default=24)
    p.add_argument("--n_head", type=int, default=16)
    p.add_argument("--n_embd", type=int, default=2048)
    p.add_argument("--block_size", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=16, help="per data-parallel replica")
    p.add_argument("--n_microbatches", type=int, default=4)
    p.add_argument("--max_iters", type=int, default=60000)
    p.add_argument("--warmup_iters", type=int, default=2000)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--min_lr", type=float, default=6e-5)
    p.add_argument("--eval_interval", type=int, default=1000)
    p.add_argument("--eval_iters", type=int, default=50)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()

    rank = dist.get_rank()
    world_size = dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}")

    dp = world_size // (args.pp * args.tp)
    assert dp * args.pp * args.tp == world_size, "world size must be pp * dp * tp"
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = mesh["pp"].get_local_rank()
    dp_rank = mesh["dp"].get_local_rank()
    master = rank == 0
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        print(f"world={world_size} pp={args.pp} dp={dp} tp={args.tp}")

    cfg = dict(vocab_size=50304, block_size=args.block_size, n_layer=args.n_layer,
               n_head=args.n_head, n_embd=args.n_embd)
    per = args.n_layer // args.pp
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    with torch.device("meta"):
        model = GPTStage(cfg, range(pp_rank * per, (pp_rank + 1) * per), first, last)

    tp_mesh = mesh["tp"]
    if last:
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    for blk in model.h.values():
        parallelize_module(blk, tp_mesh, {
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.h.values():
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    torch.manual_seed(args.seed)
    model.to_empty(device=device)
    model.reset_parameters()

    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    schedule = Schedule1F1B(stage, n_microbatches=args.n_microbatches, loss_fn=loss_fn)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))

    def get_lr(it):
        if it < args.warmup_iters:
            return args.lr * (it + 1) / args.warmup_iters
        ratio = min(1.0, (it - args.warmup_iters) / (args.max_iters - args.warmup_iters))
        return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)

    train_data = np.memmap(os.path.join(args.data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val_data = np.memmap(os.path.join(args.data_dir, "val.bin"), dtype=np.uint16, mode="r")
    # every rank of the same dp replica draws the same batch: the first stage
    # needs the tokens and the last stage the targets
    gen = torch.Generator().manual_seed(args.seed + dp_rank)
    val_gen_seed = 10_000 + dp_rank

    iter_num = 0
    ckpt_path = os.path.join(args.out_dir, "ckpt")
    if os.path.exists(os.path.join(ckpt_path, ".metadata")):
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
              "iter_num": 0}
        dcp.load(sd, checkpoint_id=ckpt_path)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, optimizer, sd["optim"])
        iter_num = sd["iter_num"]
        gen.manual_seed(args.seed + dp_rank + 7919 * iter_num)
        if master:
            print(f"resuming from iter {iter_num}")

    def run_step(x, y, train=True):
        losses = [] if last else None
        fn = schedule.step if train else schedule.eval
        if first:
            fn(x.to(device), target=y.to(device) if last else None, losses=losses)
        else:
            fn(target=y.to(device) if last else None, losses=losses)
        if last:
            return torch.stack(losses).mean().detach()
        return torch.tensor(-1.0, device=device)

    def global_loss(t):
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
        return t.item()

    @torch.no_grad()
    def evaluate():
        model.eval()
        vgen = torch.Generator().manual_seed(val_gen_seed)
        acc = torch.zeros((), device=device)
        for _ in range(args.eval_iters):
            x, y = get_batch(val_data, args.batch_size, args.block_size, vgen)
            acc += run_step(x, y, train=False)
        model.train()
        return global_loss(acc / args.eval_iters)

    t0 = time.time()
    while iter_num < args.max_iters:
        lr = get_lr(iter_num)
        for g in optimizer.param_groups:
            g["lr"] = lr

        x, y = get_batch(train_data, args.batch_size, args.block_size, gen)
        optimizer.zero_grad(set_to_none=True)
        loss = run_step(x, y)
        optimizer.step()
        iter_num += 1

        if iter_num % 20 == 0:
            lossf = global_loss(loss)
            if master:
                dt = (time.time() - t0) / 20
                print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, {dt * 1000:.0f} ms/iter")
            t0 = time.time()

        if iter_num % args.eval_interval == 0:
            val_loss = evaluate()
            if master:
                print(f"iter {iter_num}: val loss {val_loss:.4f}")
            sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
                  "iter_num": iter_num}
            dcp.save(sd, checkpoint_id=ckpt_path)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
