# Continued pretraining of an 8B Llama checkpoint on domain data (PP x FSDP2 x TP).
# Starts from the consolidated bf16 state dict written by tools/merge_shards.py, then
# saves/resumes with torch.distributed.checkpoint.
#
#   torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
#       continue_pretrain.py --init-from /shared/models/llama8b_base/consolidated.pt --pp 2 --tp 4
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
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CFG = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
           rope_theta=500000.0, norm_eps=1e-5)


def rope_cache(head_dim, seq_len, theta, device):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    f = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(f), f)


def rotate(x, freqs):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[None, : x.shape[1], None, :]).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        d, h, kv = CFG["dim"], CFG["n_heads"], CFG["n_kv_heads"]
        self.hd, self.rep = d // h, h // kv
        self.wq = nn.Linear(d, h * self.hd, bias=False)
        self.wk = nn.Linear(d, kv * self.hd, bias=False)
        self.wv = nn.Linear(d, kv * self.hd, bias=False)
        self.wo = nn.Linear(h * self.hd, d, bias=False)

    def forward(self, x, freqs):
        B, S, _ = x.shape
        q = rotate(self.wq(x).view(B, S, -1, self.hd), freqs)
        k = rotate(self.wk(x).view(B, S, -1, self.hd), freqs)
        v = self.wv(x).view(B, S, -1, self.hd)
        k, v = k.repeat_interleave(self.rep, 2), v.repeat_interleave(self.rep, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(CFG["dim"], CFG["ffn_dim"], bias=False)
        self.w2 = nn.Linear(CFG["ffn_dim"], CFG["dim"], bias=False)
        self.w3 = nn.Linear(CFG["dim"], CFG["ffn_dim"], bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(CFG["dim"], eps=CFG["norm_eps"])
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(CFG["dim"], eps=CFG["norm_eps"])
        self.feed_forward = FFN()

    def forward(self, x, freqs):
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.seq_len = seq_len
        self.tok_embeddings = nn.Embedding(CFG["vocab_size"], CFG["dim"])
        self.layers = nn.ModuleDict({str(i): TransformerBlock() for i in range(CFG["n_layers"])})
        self.norm = nn.RMSNorm(CFG["dim"], eps=CFG["norm_eps"])
        self.output = nn.Linear(CFG["dim"], CFG["vocab_size"], bias=False)

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        freqs = rope_cache(CFG["dim"] // CFG["n_heads"], h.shape[1], CFG["rope_theta"], h.device)
        for layer in self.layers.values():
            h = layer(h, freqs)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def split_for_stage(model, stage, n_stages):
    per = CFG["n_layers"] // n_stages
    for k in list(model.layers.keys()):
        if not stage * per <= int(k) < (stage + 1) * per:
            del model.layers[k]
    if stage > 0:
        model.tok_embeddings = None
    if stage < n_stages - 1:
        model.norm = model.output = None
    return model


class DomainTokens(Dataset):
    def __init__(self, path, seq_len):
        self.tok = np.memmap(path, dtype=np.uint32, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.tok) - 1) // self.seq_len

    def __getitem__(self, i):
        x = torch.from_numpy(self.tok[i * self.seq_len: (i + 1) * self.seq_len + 1].astype(np.int64))
        return x[:-1], x[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--init-from", required=True)
    ap.add_argument("--data", default="/shared/data/biomed_llama3tok/train.u32")
    ap.add_argument("--out", default="/shared/runs/llama8b_biomed")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--n-microbatches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=1000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1

    with torch.device("meta"):
        model = split_for_stage(Transformer(args.seq_len), pp_rank, args.pp)
    tp_mesh = mesh["tp"]
    top = {}
    if first:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if last:
        top["output"] = ColwiseParallel(output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for blk in model.layers.values():
        parallelize_module(blk, tp_mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=device)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    lr_at = lambda s: min(1.0, (s + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)

    ckpt_dir = os.path.join(args.out, "dcp")
    step = 0
    if os.path.exists(os.path.join(ckpt_dir, ".metadata")):
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
                 "step": 0}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        step = state["step"]
        scheduler.last_epoch = step - 1
        scheduler.step()
    else:
        # stage-local keys are picked out of the full dict, the rest are ignored
        full_sd = torch.load(args.init_from, mmap=True, weights_only=True)
        set_model_state_dict(model, full_sd,
                             options=StateDictOptions(full_state_dict=True, strict=False))
        del full_sd
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"starting at step {step}; dp={dp} pp={args.pp} tp={args.tp}", flush=True)

    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.n_microbatches,
                            loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten(0, 1)))

    ds = DomainTokens(args.data, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    batches = iter(loader)
    for _ in range(step % len(loader)):
        next(batches)
    t0 = time.time()
    while step < args.steps:
        try:
            x, y = next(batches)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            x, y = next(batches)
        optimizer.zero_grad(set_to_none=True)
        losses = [] if last else None
        if first:
            schedule.step(x.to(device, non_blocking=True))
        elif last:
            schedule.step(target=y.to(device, non_blocking=True), losses=losses)
        else:
            schedule.step()
        optimizer.step()
        scheduler.step()
        step += 1

        if step % 10 == 0:
            loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=device)
            dist.all_reduce(loss, group=mesh["pp"].get_group())
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            if rank == 0:
                print(f"step {step} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
            t0 = time.time()

        if step % args.save_every == 0 or step == args.steps:
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer),
                     "step": step}
            dcp.save(state, checkpoint_id=ckpt_dir)
            if rank == 0:
                print(f"checkpoint saved at step {step}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
