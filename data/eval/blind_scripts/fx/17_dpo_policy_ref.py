"""DPO on preference pairs for an 8B Llama (policy + frozen reference).

Both models are sharded the same way: TP over "tp", FSDP2 over "dp". The policy
trains with bf16 params / fp32 reduce, compiled + checkpointed blocks; the
reference is forward-only.

    torchrun --nproc_per_node=8 dpo.py --pairs /data/prefs/ultrafeedback_tok.pt \
        --sft /ckpt/llama8b-sft-dcp --out /ckpt/llama8b-dpo --tp 4
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
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, TensorDataset

D, NL, NH, NKV, FF, V = 4096, 32, 32, 8, 14336, 128256


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rope_freqs(n, hd=D // NH, theta=500000.0):
    a = torch.outer(torch.arange(n).float(), theta ** (-torch.arange(0, hd, 2).float() / hd))
    return torch.polar(torch.ones_like(a), a)


def rope(x, f):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * f[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = D // NH
        self.wq, self.wo = nn.Linear(D, NH * self.hd, bias=False), nn.Linear(NH * self.hd, D, bias=False)
        self.wk, self.wv = nn.Linear(D, NKV * self.hd, bias=False), nn.Linear(D, NKV * self.hd, bias=False)

    def forward(self, x, f):
        b, t, _ = x.shape
        q = rope(self.wq(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        k = rope(self.wk(x).view(b, t, -1, self.hd), f).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(D), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(D), FeedForward()

    def forward(self, x, f):
        x = x + self.attention(self.attention_norm(x), f)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(NL))
        self.norm = RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)
        self.register_buffer("freqs_cis", rope_freqs(seq_len), persistent=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for blk in self.layers:
            h = blk(h, self.freqs_cis)
        return self.output(self.norm(h))


def build(mesh, seq_len, ckpt, trainable):
    with torch.device("meta"):
        model = Llama(seq_len)
    tp, dp = mesh["tp"], mesh["dp"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, blk in enumerate(model.layers):
        parallelize_module(blk, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        if trainable:
            blk = checkpoint_wrapper(blk, preserve_rng_state=False)
        blk = torch.compile(blk)
        fully_shard(blk, mesh=dp, mp_policy=mp)
        model.layers[i] = blk
    fully_shard(model, mesh=dp, mp_policy=mp)
    model.to_empty(device="cuda")
    model.freqs_cis = rope_freqs(seq_len).cuda()
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=ckpt)
    set_model_state_dict(model, sd["model"])
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return model


def seq_logps(logits, labels):
    """Sum of log-probs of the label tokens (labels == -100 are masked)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    mask = labels != -100
    lp = torch.gather(logits.log_softmax(-1), -1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", required=True)
    ap.add_argument("--sft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=2, help="pairs per rank per step")
    ap.add_argument("--lr", type=float, default=5e-7)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--save-every", type=int, default=200)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("cpu:gloo,cuda:nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    torch.manual_seed(0)

    policy = build(mesh, args.seq_len, args.sft, trainable=True)
    ref = build(mesh, args.seq_len, args.sft, trainable=False)

    pairs = torch.load(args.pairs, map_location="cpu", weights_only=True)
    ds = TensorDataset(pairs["chosen_ids"], pairs["chosen_labels"], pairs["rejected_ids"], pairs["rejected_labels"])
    loader = DataLoader(ds, batch_size=args.bs, shuffle=True, drop_last=True, num_workers=2, pin_memory=True)

    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / (0.1 * total)) * 0.5 * (1 + math.cos(math.pi * s / total)))

    step, fut = 0, None
    for epoch in range(args.epochs):
        t0 = time.time()
        for c_ids, c_lab, r_ids, r_lab in loader:
            ids = torch.cat([c_ids, r_ids]).cuda(non_blocking=True)
            lab = torch.cat([c_lab, r_lab]).cuda(non_blocking=True)
            n = c_ids.size(0)
            with torch.no_grad():
                ref_lp = seq_logps(ref(ids), lab)
            pol_lp = seq_logps(policy(ids), lab)
            margin = (pol_lp[:n] - ref_lp[:n]) - (pol_lp[n:] - ref_lp[n:])
            loss = -F.logsigmoid(args.beta * margin).mean()
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0).full_tensor()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            step += 1

            if step % 10 == 0:
                stats = torch.stack([loss.detach(), (margin > 0).float().mean(), margin.mean().detach()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG, group=dp.get_group())
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {stats[0]:.4f} acc {stats[1]:.3f} "
                          f"margin {stats[2]:.3f} gn {gn.item():.2f} {(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()

            if step % args.save_every == 0:
                if fut is not None:
                    fut.result()
                m, o = get_state_dict(policy, opt)
                fut = dcp.async_save({"model": m, "optim": o, "step": step},
                                     checkpoint_id=os.path.join(args.out, f"step{step:05d}"))

    if fut is not None:
        fut.result()
    dcp.save({"model": get_model_state_dict(policy)}, checkpoint_id=os.path.join(args.out, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
