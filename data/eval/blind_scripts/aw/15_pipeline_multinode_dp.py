"""Pipeline parallel (8 stages, one node) x data parallel (across nodes) GPT training.

Stage s of replica r is global rank r * PP + s. Activations move with
isend / irecv inside a node; gradients of each stage are averaged with its
replicas on the other nodes.

    # node 0 and node 1
    MASTER_ADDR=10.0.0.11 MASTER_PORT=29500 torchrun --nnodes=2 --node_rank=$NODE_RANK \
        --nproc_per_node=8 --master_addr=10.0.0.11 --master_port=29500 \
        15_pipeline_multinode_dp.py --data /shared/data/slimpajama_tok --pp 8
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
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", default="/shared/ckpt/pp_gpt")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=16)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=5120)
    p.add_argument("--n-heads", type=int, default=40)
    p.add_argument("--n-layers", type=int, default=40)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--lr", type=float, default=1.2e-4)
    p.add_argument("--steps", type=int, default=30000)
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--save-every", type=int, default=1000)
    return p.parse_args()


def init_distributed():
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://", rank=local_rank, world_size=world_size)
    return local_rank, world_size


class Tokens(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(os.path.join(path, "train.bin"), dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i):
        s = i * self.seq_len
        return torch.from_numpy(self.data[s:s + self.seq_len + 1].astype(np.int64))


class Layer(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PipeStage(nn.Module):
    def __init__(self, a, stage):
        super().__init__()
        self.first, self.last = stage == 0, stage == a.pp - 1
        n = a.n_layers // a.pp
        if self.first:
            self.wte = nn.Embedding(a.vocab, a.d_model)
            self.wpe = nn.Embedding(a.seq_len, a.d_model)
        self.layers = nn.ModuleList([Layer(a.d_model, a.n_heads) for _ in range(n)])
        if self.last:
            self.ln_f = nn.LayerNorm(a.d_model)
            self.lm_head = nn.Linear(a.d_model, a.vocab, bias=False)

    def forward(self, x):
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for l in self.layers:
            x = l(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def train_step(stage, batch, a, prev_rank, next_rank, dev):
    """GPipe: all forwards, then all backwards. Returns summed loss on last stage."""
    shape = (a.micro_batch_size, a.seq_len, a.d_model)
    ins, outs, total = [], [], 0.0
    for m in range(a.micro_batches):
        if stage.first:
            x = batch[m * a.micro_batch_size:(m + 1) * a.micro_batch_size, :-1].to(dev, non_blocking=True)
        else:
            x = torch.empty(shape, device=dev, dtype=torch.bfloat16)
            dist.irecv(x, src=prev_rank).wait()
            x.requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = stage(x)
        if stage.last:
            tgt = batch[m * a.micro_batch_size:(m + 1) * a.micro_batch_size, 1:].to(dev, non_blocking=True)
            y = F.cross_entropy(y.float().flatten(0, 1), tgt.flatten()) / a.micro_batches
            total += y.item()
        else:
            y = y.to(torch.bfloat16)
            dist.isend(y.detach(), dst=next_rank).wait()
        ins.append(x)
        outs.append(y)
    for m in reversed(range(a.micro_batches)):
        if stage.last:
            outs[m].backward()
        else:
            g = torch.empty(shape, device=dev, dtype=torch.bfloat16)
            dist.irecv(g, src=next_rank).wait()
            outs[m].backward(g)
        if not stage.first:
            dist.isend(ins[m].grad, dst=prev_rank).wait()
    return total


def allreduce_grads(params, group, n):
    grads = [p.grad for p in params if p.grad is not None]
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= n
    for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(s)


def main():
    a = parse_args()
    local_rank, world = init_distributed()
    rank = dist.get_rank()
    dp = world // a.pp
    stage_id, replica = rank % a.pp, rank // a.pp
    dev = torch.device("cuda", local_rank)

    dp_group = None
    for s in range(a.pp):
        g = dist.new_group([r * a.pp + s for r in range(dp)])
        if s == stage_id:
            dp_group = g

    torch.manual_seed(1234 + stage_id)
    stage = PipeStage(a, stage_id).to(dev)
    for p in stage.parameters():
        dist.broadcast(p.data, src=stage_id, group=dp_group)
    params = list(stage.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps)))))

    ds = Tokens(a.data, a.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=replica, shuffle=True, seed=99)
    loader = DataLoader(ds, batch_size=a.micro_batches * a.micro_batch_size, sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    needs_data = stage.first or stage.last

    step, epoch = 0, 0
    t0 = time.time()
    while step < a.steps:
        sampler.set_epoch(epoch)
        batches = iter(loader) if needs_data else None
        for _ in range(len(loader)):
            batch = next(batches) if needs_data else None
            opt.zero_grad(set_to_none=True)
            loss = train_step(stage, batch, a, rank - 1, rank + 1, dev)
            if dp > 1:
                allreduce_grads(params, dp_group, dp)
            opt.step()
            sched.step()
            step += 1

            if step % 10 == 0:
                # only last stages hold a loss; sum them and average over replicas
                t = torch.tensor([loss if stage.last else 0.0], device=dev)
                dist.all_reduce(t)
                if rank == 0:
                    print(f"step {step} loss {t.item() / dp:.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 10:.2f}s/step", flush=True)
                    t0 = time.time()
            if step % a.save_every == 0 and replica == 0:
                d = os.path.join(a.save_dir, f"step{step}")
                os.makedirs(d, exist_ok=True)
                torch.save({"stage": stage.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "step": step, "pp": a.pp}, os.path.join(d, f"stage_{stage_id:02d}.pt"))
            if step >= a.steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
