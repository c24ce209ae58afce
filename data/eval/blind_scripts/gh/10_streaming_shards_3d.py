# Pretraining over pre-tokenized shard files (*.u16) streamed from disk.
# 3D parallel: pipeline (1F1B) x FSDP2 x tensor parallel.
#
#   torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
#       train_stream.py --shards '/lustre/tok/redpajama_v2/*.u16' --pp 2 --tp 2 --epochs 1
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class ShardStream(IterableDataset):
    """Streams (x, y) windows from a list of token shards; each dp replica reads its own shards."""

    def __init__(self, files, seq_len, dp_rank, dp_size, seed=0, epoch=0):
        self.files = files[dp_rank::dp_size]
        self.seq_len, self.seed, self.epoch = seq_len, seed, epoch

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        files = list(self.files)
        np.random.default_rng(self.seed + self.epoch).shuffle(files)
        wi = get_worker_info()
        if wi is not None:
            files = files[wi.id::wi.num_workers]
        L = self.seq_len + 1
        for f in files:
            toks = np.memmap(f, dtype=np.uint16, mode="r")
            for i in range(len(toks) // L):
                w = torch.from_numpy(toks[i * L:(i + 1) * L].astype(np.int64))
                yield w[:-1], w[1:]


class Block(nn.Module):
    def __init__(self, d, nh, ff):
        super().__init__()
        self.hd = d // nh
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w_gate, self.w_up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.w_down = nn.Linear(ff, d, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, s, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class LM(nn.Module):
    def __init__(self, vocab, d, n_layers, nh, ff, seq):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleDict({str(i): Block(d, nh, ff) for i in range(n_layers)})
        self.ln_f = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for b in self.blocks.values():
            x = b(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def build(args, pp_rank, mesh, device):
    with torch.device("meta"):
        m = LM(50304, args.d_model, args.n_layers, args.n_heads, args.d_ff, args.seq_len)
    per = args.n_layers // args.pp
    for k in list(m.blocks):
        if int(k) // per != pp_rank:
            del m.blocks[k]
    if pp_rank != 0:
        m.emb = m.pos = None
    if pp_rank != args.pp - 1:
        m.ln_f = m.head = None
    tp = mesh["tp"]
    if m.head is not None:
        parallelize_module(m, tp, {"head": ColwiseParallel(output_layouts=Replicate())})
    for b in m.blocks.values():
        parallelize_module(b, tp, {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
                                   "wo": RowwiseParallel(), "w_gate": ColwiseParallel(),
                                   "w_up": ColwiseParallel(), "w_down": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in m.blocks.values():
        fully_shard(b, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(m, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    m.to_empty(device=device)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or "ln_f" in n:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--ckpt-dir", default="/lustre/ckpt/stream_lm")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--n-layers", type=int, default=24)
    ap.add_argument("--n-heads", type=int, default=16)
    ap.add_argument("--d-ff", type=int, default=5504)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--est-steps", type=int, default=150_000, help="for the lr schedule")
    ap.add_argument("--ckpt-every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1

    torch.manual_seed(0)
    model = build(args, pp_rank, mesh, device)
    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.microbatches,
                            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(
        0.1, 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.est_steps)))))

    files = sorted(glob.glob(args.shards))
    ds = ShardStream(files, args.seq_len, dp_rank, dp)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=4, pin_memory=True, drop_last=True)

    step, start_epoch = 0, 0
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(os.path.join(latest, ".metadata")):
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "sched": sched.state_dict(), "step": 0, "epoch": 0}
        dcp.load(sd, checkpoint_id=latest)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        step, start_epoch = sd["step"], sd["epoch"]

    def save(epoch):
        m, o = get_state_dict(model, opt)
        dcp.save({"model": m, "optim": o, "sched": sched.state_dict(), "step": step, "epoch": epoch},
                 checkpoint_id=latest)
        if rank == 0:
            print(f"saved step {step}", flush=True)

    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        ds.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            losses = [] if last else None
            if first:
                schedule.step(x.to(device, non_blocking=True))
            elif last:
                schedule.step(target=y.to(device, non_blocking=True), losses=losses)
            else:
                schedule.step()
            opt.step()
            sched.step()
            step += 1

            if step % 20 == 0:
                loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=device)
                dist.all_reduce(loss, group=mesh["pp"].get_group())
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()
            if step % args.ckpt_every == 0:
                save(epoch)
        save(epoch + 1)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
