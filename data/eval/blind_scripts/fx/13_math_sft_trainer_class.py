"""Math-reasoning SFT for a 3B Llama, float8 training with FSDP2 + TP.

Trainer-style script: one class owns mesh, model, optimizer and checkpointing.

    torchrun --nproc_per_node=8 math_sft.py --train /data/math/train.pt --val /data/math/val.pt \
        --init /ckpt/llama3b-base-dcp --out /ckpt/llama3b-math --tp 2
"""
import argparse
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.float8_tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
    PrepareFloat8ModuleInput,
)


@dataclass
class Args:
    dim: int = 3072
    n_layers: int = 28
    n_heads: int = 24
    n_kv_heads: int = 8
    ffn: int = 8192
    vocab: int = 128256
    seq_len: int = 4096


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def freqs_cis(a: Args):
    hd = a.dim // a.n_heads
    ang = torch.outer(torch.arange(a.seq_len).float(), 500000.0 ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(ang), ang)


def rope(x, fc):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * fc[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.hd = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(a.n_heads * self.hd, a.dim, bias=False)

    def forward(self, x, fc):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), fc).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), fc).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.w1, self.w3 = nn.Linear(a.dim, a.ffn, bias=False), nn.Linear(a.dim, a.ffn, bias=False)
        self.w2 = nn.Linear(a.ffn, a.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(a.dim), Attention(a)
        self.ffn_norm, self.feed_forward = RMSNorm(a.dim), FeedForward(a)

    def forward(self, x, fc):
        x = x + self.attention(self.attention_norm(x), fc)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, a: Args):
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(a) for i in range(a.n_layers)})
        self.norm = RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        self.register_buffer("freqs_cis", freqs_cis(a), persistent=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("cpu:gloo,cuda:nccl")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh("cuda", (self.world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
        self.dp = self.mesh["dp"]
        self.model = self._build()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0
        self.pending = None

    def log(self, msg):
        if self.rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def _build(self):
        a = Args(seq_len=self.cfg.seq_len)
        with torch.device("meta"):
            model = Transformer(a)
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                   module_filter_fn=lambda mod, fqn: fqn != "output")
        tp = self.mesh["tp"]
        parallelize_module(model, tp, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for lid, blk in model.layers.named_children():
            parallelize_module(blk, tp, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareFloat8ModuleInput(input_layouts=(Shard(1), None),
                                                      desired_input_layouts=(Replicate(), None)),
                "attention.wq": Float8ColwiseParallel(),
                "attention.wk": Float8ColwiseParallel(),
                "attention.wv": Float8ColwiseParallel(),
                "attention.wo": Float8RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareFloat8ModuleInput(input_layouts=(Shard(1),),
                                                         desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": Float8ColwiseParallel(),
                "feed_forward.w3": Float8ColwiseParallel(),
                "feed_forward.w2": Float8RowwiseParallel(output_layouts=Shard(1)),
            })
            blk = torch.compile(checkpoint_wrapper(blk, preserve_rng_state=False), fullgraph=True)
            fully_shard(blk, mesh=self.dp, mp_policy=mp)
            model.layers.register_module(lid, blk)
        fully_shard(model, mesh=self.dp, mp_policy=mp)
        model.to_empty(device="cuda")
        model.freqs_cis = freqs_cis(a).cuda()
        base = {"model": get_model_state_dict(model)}
        dcp.load(base, checkpoint_id=self.cfg.init)
        set_model_state_dict(model, base["model"])
        return model

    def loader(self, path, train):
        blob = torch.load(path, map_location="cpu", weights_only=True)  # {"input_ids": [N, L+1], "labels": [N, L+1]}
        ds = TensorDataset(blob["input_ids"], blob["labels"])
        sampler = DistributedSampler(ds, num_replicas=self.dp.size(), rank=self.dp.get_local_rank(),
                                     shuffle=train, seed=self.cfg.seed, drop_last=train)
        return DataLoader(ds, batch_size=self.cfg.bs, sampler=sampler, num_workers=2, pin_memory=True), sampler

    def loss_fn(self, ids, labels):
        logits = self.model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)

    @torch.no_grad()
    def validate(self, val_loader):
        self.model.eval()
        tot = torch.zeros(2, device="cuda")
        for ids, labels in val_loader:
            ids, labels = ids.cuda(), labels.cuda()
            n = (labels[:, 1:] != -100).sum()
            tot += torch.stack([self.loss_fn(ids, labels) * n, n.float()])
        dist.all_reduce(tot, group=self.dp.get_group())
        self.model.train()
        return (tot[0] / tot[1]).item()

    def save(self):
        if self.pending is not None:
            self.pending.result()
        m, o = get_state_dict(self.model, self.opt)
        self.pending = dcp.async_save({"model": m, "optim": o, "step": self.step},
                                      checkpoint_id=os.path.join(self.cfg.out, f"step{self.step:06d}"))

    def fit(self):
        cfg = self.cfg
        train_loader, train_sampler = self.loader(cfg.train, True)
        val_loader, _ = self.loader(cfg.val, False)
        total = cfg.epochs * len(train_loader)
        sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / total)))
        for epoch in range(cfg.epochs):
            train_sampler.set_epoch(epoch)
            t0 = time.time()
            for ids, labels in train_loader:
                ids, labels = ids.cuda(non_blocking=True), labels.cuda(non_blocking=True)
                loss = self.loss_fn(ids, labels)
                if not torch.isfinite(loss):
                    print(f"rank {self.rank}: non-finite loss at step {self.step}, skipping batch", flush=True)
                    self.opt.zero_grad(set_to_none=True)
                    continue
                loss.backward()
                gn = nn.utils.clip_grad_norm_(self.model.parameters(), 1.0).full_tensor()
                self.opt.step()
                precompute_float8_dynamic_scale_for_fsdp(self.model)
                self.opt.zero_grad(set_to_none=True)
                sched.step()
                self.step += 1
                if self.step % 10 == 0:
                    l = loss.detach()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG, group=self.dp.get_group())
                    self.log(f"ep {epoch} step {self.step}/{total} loss {l.item():.4f} gn {gn.item():.2f} "
                             f"{(time.time() - t0) / 10:.2f}s/it")
                    t0 = time.time()
                if self.step % cfg.save_every == 0:
                    self.save()
            self.log(f"epoch {epoch} val_loss {self.validate(val_loader):.4f}")
            self.save()
        if self.pending is not None:
            self.pending.result()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    Trainer(ap.parse_args()).fit()


if __name__ == "__main__":
    main()
