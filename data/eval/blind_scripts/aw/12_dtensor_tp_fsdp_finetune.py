"""Continued pretraining of a Llama-style model with DTensor tensor parallelism
(inside groups of --tp GPUs) composed with FSDP2 over the data-parallel mesh
dimension. Checkpoints use torch.distributed.checkpoint (sharded, every rank
writes its own piece, reloadable on a different mesh).

    torchrun --standalone --nproc_per_node=8 12_dtensor_tp_fsdp_finetune.py --tp 4 \
        --train-jsonl data/domain_corpus.jsonl --tokenizer /models/llama-3b
"""
import argparse
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train-jsonl", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--ckpt-dir", default="ckpt/dtensor_tp")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dim", type=int, default=3072)
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--val-frac", type=float, default=0.01)
    p.add_argument("--save-every", type=int, default=500)
    return p.parse_args()


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.hd = a.dim // a.heads
        self.ln1, self.ln2 = RMSNorm(a.dim), RMSNorm(a.dim)
        self.q = nn.Linear(a.dim, a.dim, bias=False)
        self.k = nn.Linear(a.dim, a.dim, bias=False)
        self.v = nn.Linear(a.dim, a.dim, bias=False)
        self.o = nn.Linear(a.dim, a.dim, bias=False)
        self.gate = nn.Linear(a.dim, a.ffn, bias=False)
        self.up = nn.Linear(a.dim, a.ffn, bias=False)
        self.down = nn.Linear(a.ffn, a.dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.ln1(x)
        # local head count is heads / tp once q/k/v are column-sharded
        q, k, v = (m(h).view(B, T, -1, self.hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(B, T, -1))
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, a, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, a.dim)
        self.pos = nn.Embedding(a.seq_len, a.dim)
        self.blocks = nn.ModuleList([Block(a) for _ in range(a.layers)])
        self.norm = RMSNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


def parallelize(model, mesh):
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })
    for b in model.blocks:
        parallelize_module(b, tp, {
            "q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel(),
        })
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def main():
    a = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # generous timeout: the other ranks wait in a barrier while rank 0 tokenizes
    dist.init_process_group("nccl", timeout=timedelta(hours=2))
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world // a.tp, a.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    dp_pg = mesh["dp"].get_group()

    tok = AutoTokenizer.from_pretrained(a.tokenizer)

    def tokenize(batch):
        out = tok(batch["text"], add_special_tokens=False)
        flat = [t for ids in out["input_ids"] for t in ids + [tok.eos_token_id]]
        n = len(flat) // (a.seq_len + 1)
        return {"ids": [flat[i * (a.seq_len + 1):(i + 1) * (a.seq_len + 1)] for i in range(n)]}

    # rank 0 tokenizes and fills the datasets cache; the others then read it
    if rank != 0:
        dist.barrier()
    raw = load_dataset("json", data_files=a.train_jsonl, split="train")
    packed = raw.map(tokenize, batched=True, batch_size=2000, remove_columns=raw.column_names, num_proc=16)
    split = packed.train_test_split(test_size=a.val_frac, seed=1234)
    if rank == 0:
        dist.barrier()
    train_ds, val_ds = split["train"].with_format("torch"), split["test"].with_format("torch")

    # identical seed on every rank: DTensor init must agree across the TP group
    torch.manual_seed(0)
    model = parallelize(Model(a, len(tok)).cuda(), mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.05)

    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=0)
    loader = DataLoader(train_ds, a.batch, sampler=sampler, drop_last=True, num_workers=2)
    val_loader = DataLoader(val_ds, a.batch, drop_last=False,
                            sampler=DistributedSampler(val_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False))
    total = a.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / total)))

    step, start_epoch = 0, 0
    latest = os.path.join(a.ckpt_dir, "latest")
    if os.path.isdir(latest):
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "meta": {"step": 0, "epoch": 0}}
        dcp.load(state, checkpoint_id=latest)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step, start_epoch = state["meta"]["step"], state["meta"]["epoch"]
        for _ in range(step):
            sched.step()

    def save(tag_epoch):
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "meta": {"step": step, "epoch": tag_epoch}},
                 checkpoint_id=os.path.join(a.ckpt_dir, f"step{step}"))
        dist.barrier()
        if rank == 0:
            tmp = latest + ".tmp"
            if os.path.lexists(tmp):
                os.remove(tmp)
            os.symlink(f"step{step}", tmp)
            os.replace(tmp, latest)
        dist.barrier()

    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in loader:
            ids = batch["ids"].cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1
            if step % 20 == 0:
                # TP ranks hold the same loss, so averaging over dp is enough
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG, group=dp_pg)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} {(time.time() - t0) / 20:.2f}s/it", flush=True)
                    t0 = time.time()
            if step % a.save_every == 0:
                save(epoch)

        model.eval()
        tot = torch.zeros(2, device="cuda")
        with torch.no_grad():
            for batch in val_loader:
                ids = batch["ids"].cuda(non_blocking=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(ids[:, :-1])
                tot[0] += F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
                tot[1] += ids[:, 1:].numel()
        dist.all_reduce(tot, group=dp_pg)
        if rank == 0:
            print(f"epoch {epoch} val loss {(tot[0] / tot[1]).item():.4f}", flush=True)
        save(epoch + 1)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
