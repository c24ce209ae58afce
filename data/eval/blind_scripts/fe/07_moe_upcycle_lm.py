#!/usr/bin/env python
"""Sparse upcycling: start an MoE LM from a dense checkpoint and keep training.

Each dense FFN in the selected layers is copied into all experts of a
DeepSpeed MoE layer (top-2 routing, experts sharded over --ep-size ranks).

    deepspeed --num_gpus 8 07_moe_upcycle_lm.py --deepspeed --deepspeed_config configs/moe_upcycle.json \
        --dense-ckpt /shared/models/dense_1b3/model.pt --text /shared/corpora/c4_en/*.json.gz \
        --cache-dir /shared/cache/c4_tok --output /shared/exp/upcycle_1b3_e16
"""
import argparse
import glob
import math
import os
from datetime import timedelta

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from datasets import load_dataset, load_from_disk
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense-ckpt", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--tokenizer", default="EleutherAI/gpt-neox-20b")
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--n-layer", type=int, default=24)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--ep-size", type=int, default=8)
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--eval-frac", type=float, default=0.005)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--save-every", type=int, default=2500)
    ap.add_argument("--wandb", action="store_true")
    ap.add_argument("--local_rank", type=int, default=-1)
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args()


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Layer(nn.Module):
    def __init__(self, args, sparse):
        super().__init__()
        d = args.d_model
        self.n_head = args.n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.sparse = sparse
        self.mlp = (MoE(hidden_size=d, expert=MLP(d), num_experts=args.experts, ep_size=args.ep_size,
                        k=2, capacity_factor=1.25, eval_capacity_factor=2.0, min_capacity=4)
                    if sparse else MLP(d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        if self.sparse:
            m, aux, _ = self.mlp(self.ln_2(x))
        else:
            m, aux = self.mlp(self.ln_2(x)), x.new_zeros(())
        return x + m, aux


class SparseLM(nn.Module):
    def __init__(self, args, vocab):
        super().__init__()
        self.wte = nn.Embedding(vocab, args.d_model)
        self.wpe = nn.Embedding(args.block, args.d_model)
        self.h = nn.ModuleList([Layer(args, sparse=(i % 2 == 1)) for i in range(args.n_layer)])
        self.ln_f = nn.LayerNorm(args.d_model)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))
        aux_total = 0.0
        for blk in self.h:
            x, aux = blk(x)
            aux_total = aux_total + aux
        logits = F.linear(self.ln_f(x), self.wte.weight)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
        return loss, aux_total


def upcycle_from_dense(model, path):
    dense = torch.load(path, map_location="cpu")
    dense = dense.get("module", dense)
    own = model.state_dict()
    copied = 0
    for name, tensor in dense.items():
        if name in own and own[name].shape == tensor.shape:
            own[name].copy_(tensor)
            copied += 1
    # every local expert of a sparse layer starts from that layer's dense FFN
    for i, blk in enumerate(model.h):
        if not blk.sparse:
            continue
        for expert in blk.mlp.deepspeed_moe.experts.deepspeed_experts:
            for pname, p in expert.named_parameters():
                with torch.no_grad():
                    p.copy_(dense[f"h.{i}.mlp.{pname}"])
    return copied


def tokenized_dataset(args, rank):
    if rank == 0 and not os.path.isdir(args.cache_dir):
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        raw = load_dataset("json", data_files=sorted(glob.glob(args.text)), split="train")

        def encode(batch):
            ids = tok(batch["text"])["input_ids"]
            flat = [t for seq in ids for t in seq + [tok.eos_token_id]]
            n = len(flat) // args.block * args.block
            return {"input_ids": [flat[j:j + args.block] for j in range(0, n, args.block)]}

        ds = raw.map(encode, batched=True, num_proc=32, remove_columns=raw.column_names)
        ds = ds.train_test_split(test_size=args.eval_frac, seed=0)
        ds.save_to_disk(args.cache_dir)
    dist.barrier()
    ds = load_from_disk(args.cache_dir)
    ds.set_format("torch")
    return ds["train"], ds["test"]


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    acc = torch.zeros(2, device=engine.device)
    for batch in loader:
        ids = batch["input_ids"].to(engine.device)
        loss, _ = engine(ids, ids)
        acc += torch.stack([loss.float() * ids.size(0), torch.tensor(float(ids.size(0)), device=engine.device)])
    dist.all_reduce(acc)
    engine.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # first run: rank 0 tokenizes the corpus while the others wait in the barrier
    deepspeed.init_distributed(timeout=timedelta(hours=6))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)

    train_ds, eval_ds = tokenized_dataset(args, rank)
    vocab = AutoTokenizer.from_pretrained(args.tokenizer).vocab_size

    model = SparseLM(args, vocab)
    n_copied = upcycle_from_dense(model, args.dense_ckpt)
    params = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"})
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=params)

    mbs = engine.train_micro_batch_size_per_gpu()
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    eval_sampler = DistributedSampler(eval_ds, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=mbs, sampler=train_sampler, drop_last=True,
                              num_workers=4, pin_memory=True)
    eval_loader = DataLoader(eval_ds, batch_size=mbs, sampler=eval_sampler, num_workers=2)

    run = None
    if rank == 0:
        print(f"copied {n_copied} dense tensors; global batch {engine.train_batch_size()}")
        if args.wandb:
            import wandb
            run = wandb.init(project="moe-upcycle", config=vars(args))

    gas = engine.gradient_accumulation_steps()
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for i, batch in enumerate(train_loader):
            ids = batch["input_ids"].to(engine.device, non_blocking=True)
            loss, aux = engine(ids, ids)
            engine.backward(loss + args.aux_weight * aux)
            engine.step()
            if (i + 1) % gas:
                continue

            step = engine.global_steps
            if step % 25 == 0:
                cur = torch.stack([loss.detach().float(), aux.detach().float()])
                dist.all_reduce(cur)
                cur /= world
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {cur[0]:.4f} aux {cur[1]:.4f}")
                    if run:
                        run.log({"loss": cur[0].item(), "aux": cur[1].item(), "lr": engine.get_lr()[0]}, step=step)
            if step % args.eval_every == 0:
                ev = evaluate(engine, eval_loader)
                if rank == 0:
                    print(f"step {step} eval loss {ev:.4f} ppl {math.exp(ev):.2f}")
                    if run:
                        run.log({"eval_loss": ev}, step=step)
            if step % args.save_every == 0:
                engine.save_checkpoint(args.output, client_state={"epoch": epoch})

    engine.save_checkpoint(args.output, tag="final", client_state={"epoch": args.epochs})
    if run:
        run.finish()
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
