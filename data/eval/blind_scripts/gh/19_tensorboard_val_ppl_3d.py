"""
3D parallel (PP 1F1B x FSDP2 x TP) pretraining with periodic validation perplexity,
logged to TensorBoard from the last pipeline stage.

  torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
      pretrain_tb.py --pp 2 --tp 4 --logdir /shared/tb/llama2b_3d
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class SwiGLUBlock(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.hd = dim // heads
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.attention_norm(x)
        q, k, v = (w(h).view(b, s, -1, self.hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        x = x + self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class PPModel(nn.Module):
    def __init__(self, vocab, dim, heads, hidden, n_layers, seq, pp_rank, pp):
        super().__init__()
        per = n_layers // pp
        self.embed = nn.Embedding(vocab, dim) if pp_rank == 0 else None
        self.pos = nn.Embedding(seq, dim) if pp_rank == 0 else None
        self.layers = nn.ModuleDict({str(i): SwiGLUBlock(dim, heads, hidden)
                                     for i in range(pp_rank * per, (pp_rank + 1) * per)})
        self.norm = nn.RMSNorm(dim) if pp_rank == pp - 1 else None
        self.lm_head = nn.Linear(dim, vocab, bias=False) if pp_rank == pp - 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():
            x = layer(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


class BinDataset(Dataset):
    def __init__(self, path, seq):
        self.data, self.seq = np.memmap(path, dtype=np.uint16, mode="r"), seq

    def __len__(self):
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i):
        w = torch.from_numpy(self.data[i * self.seq:(i + 1) * self.seq + 1].astype(np.int64))
        return w[:-1], w[1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-bin", default="/shared/data/fineweb_edu/train.bin")
    ap.add_argument("--val-bin", default="/shared/data/fineweb_edu/val.bin")
    ap.add_argument("--logdir", default="/shared/tb/llama2b_3d")
    ap.add_argument("--ckpt", default="/shared/ckpt/llama2b_3d")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=60_000)
    ap.add_argument("--val-every", type=int, default=500)
    ap.add_argument("--val-steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=2000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dp = int(os.environ["WORLD_SIZE"]) // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank, tp_rank = (mesh[d].get_local_rank() for d in ("pp", "dp", "tp"))
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    is_logger = last and dp_rank == 0 and tp_rank == 0
    dp_group = mesh["dp"].get_group()

    torch.manual_seed(0)
    with torch.device("meta"):
        model = PPModel(50304, 2560, 20, 6912, 24, args.seq, pp_rank, args.pp)
    tp_mesh = mesh["tp"]
    if last:
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, {"wq": ColwiseParallel(), "wk": ColwiseParallel(),
                                            "wv": ColwiseParallel(), "wo": RowwiseParallel(),
                                            "w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                            "w2": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=device)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.fill_(1.0) if "norm" in n else p.normal_(0.0, 0.02)

    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, args.micro,
                            loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1).float(), t.flatten(0, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(
        0.1, 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))

    train_ds, val_ds = BinDataset(args.train_bin, args.seq), BinDataset(args.val_bin, args.seq)
    sampler = DistributedSampler(train_ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)
    val_sampler = DistributedSampler(val_ds, num_replicas=dp, rank=dp_rank, shuffle=False, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=2, drop_last=True)
    writer = SummaryWriter(args.logdir) if is_logger else None

    step = 0
    if os.path.exists(os.path.join(args.ckpt, ".metadata")):
        m, o = get_state_dict(model, opt)
        sd = {"model": m, "optim": o, "sched": sched.state_dict(), "step": 0}
        dcp.load(sd, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        sched.load_state_dict(sd["sched"])
        step = sd["step"]

    def run_pipeline(fn, x, y):
        losses = [] if last else None
        tgt = y.to(device, non_blocking=True) if last else None
        if first:
            fn(x.to(device, non_blocking=True), target=tgt, losses=losses)
        else:
            fn(target=tgt, losses=losses)
        return torch.stack(losses).mean().detach() if last else None

    epoch = step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    t0 = time.time()
    while step < args.steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
        opt.zero_grad(set_to_none=True)
        loss = run_pipeline(schedule.step, x, y)
        opt.step()
        sched.step()
        step += 1

        if last and step % 10 == 0:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=dp_group)
            if is_logger:
                dt = (time.time() - t0) / 10
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                writer.add_scalar("perf/tok_per_s", args.bs * dp * args.seq / dt, step)
            t0 = time.time()

        if step % args.val_every == 0:
            model.eval()
            val_losses = []
            with torch.no_grad():
                for i, (vx, vy) in enumerate(val_loader):
                    if i == args.val_steps:
                        break
                    l = run_pipeline(schedule.eval, vx, vy)
                    if last:
                        val_losses.append(l)
            model.train()
            if is_logger:
                val_loss = torch.stack(val_losses).mean().item()
                writer.add_scalar("val/loss", val_loss, step)
                writer.add_scalar("val/ppl", math.exp(val_loss), step)
                print(f"step {step}: val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)

        if step % args.save_every == 0:
            m, o = get_state_dict(model, opt)
            dcp.save({"model": m, "optim": o, "sched": sched.state_dict(), "step": step}, checkpoint_id=args.ckpt)

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
