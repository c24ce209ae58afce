"""
Pretraining script, 3D parallel (pp x dp x tp) on torch-native APIs.

Batch size is configured globally (sequences per optimizer step across all replicas)
so runs at different scales are comparable.

    # 8 nodes x 8 GPUs, pp=4, tp=2 -> dp=8
    torchrun --nnodes 8 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500 \
        pretrain.py --pp 4 --tp 2 --global-batch-size 64 --seq-len 4096
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
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--data-path", default="/mnt/weka/tokens/dclm_baseline_gpt2/train.bin")
    p.add_argument("--save-path", default="/mnt/weka/ckpt/dclm_3b")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=64, help="sequences per step, all replicas")
    p.add_argument("--microbatches", type=int, default=None, help="default: 4 * pp")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--n-layer", type=int, default=32)
    p.add_argument("--n-embd", type=int, default=2560)
    p.add_argument("--n-head", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=2000)
    p.add_argument("--total-steps", type=int, default=100_000)
    p.add_argument("--checkpoint-interval", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.fc, self.fc_out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.h
        y = self.ln1(x)
        q, k, v = (m(y).view(B, T, -1, hd).transpose(1, 2) for m in (self.q, self.k, self.v))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPTStage(nn.Module):
    def __init__(self, args, stage, n_stages, vocab=50304):
        super().__init__()
        per = args.n_layer // n_stages
        self.tok = nn.Embedding(vocab, args.n_embd) if stage == 0 else None
        self.pos = nn.Embedding(args.seq_len, args.n_embd) if stage == 0 else None
        self.blocks = nn.ModuleDict({str(i): Block(args.n_embd, args.n_head)
                                     for i in range(stage * per, (stage + 1) * per)})
        self.ln_f = nn.LayerNorm(args.n_embd) if stage == n_stages - 1 else None
        self.head = nn.Linear(args.n_embd, vocab, bias=False) if stage == n_stages - 1 else None

    def forward(self, x):
        if self.tok is not None:
            x = self.tok(x) + self.pos.weight[: x.shape[1]]
        for b in self.blocks.values():
            x = b(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


class TokenData(Dataset):
    def __init__(self, path, T):
        self.d, self.T = np.memmap(path, dtype=np.uint16, mode="r"), T

    def __len__(self):
        return (len(self.d) - 1) // self.T

    def __getitem__(self, i):
        c = torch.from_numpy(self.d[i * self.T:(i + 1) * self.T + 1].astype(np.int64))
        return c[:-1], c[1:]


class CkptState(Stateful):
    def __init__(self, model, optimizer, scheduler):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.step = 0

    def state_dict(self):
        m, o = get_state_dict(self.model, self.optimizer)
        return {"model": m, "optim": o, "sched": self.scheduler.state_dict(), "step": self.step}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.step = sd["step"]


def setup(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    world = int(os.environ["WORLD_SIZE"])
    assert world % (args.pp * args.tp) == 0
    dp = world // (args.pp * args.tp)
    mesh = init_device_mesh("cuda", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    return mesh, torch.device("cuda", local_rank), dp


def build_model(args, mesh, device):
    pp_rank = mesh["pp"].get_local_rank()
    with torch.device("meta"):
        model = GPTStage(args, pp_rank, args.pp)
    tp = mesh["tp"]
    if model.head is not None:
        parallelize_module(model, tp, {"head": ColwiseParallel(output_layouts=Replicate())})
    for b in model.blocks.values():
        parallelize_module(b, tp, {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
                                   "proj": RowwiseParallel(), "fc": ColwiseParallel(),
                                   "fc_out": RowwiseParallel()})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks.values():
        fully_shard(b, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=False)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.LayerNorm):
                mod.reset_parameters()
            elif isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02 / math.sqrt(2 * args.n_layer)
                                if name.endswith(("proj", "fc_out")) else 0.02)
                if getattr(mod, "bias", None) is not None:
                    nn.init.zeros_(mod.bias)
    return model


def main():
    args = get_args()
    mesh, device, dp = setup(args)
    rank = dist.get_rank()
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = pp_rank == 0, pp_rank == args.pp - 1
    torch.manual_seed(args.seed)

    model = build_model(args, mesh, device)
    stage = PipelineStage(model, pp_rank, args.pp, device, group=mesh["pp"].get_group())
    # more microbatches -> smaller pipeline bubble
    n_micro = args.microbatches or 4 * args.pp
    local_batch = args.global_batch_size // dp
    schedule = Schedule1F1B(stage, n_microbatches=n_micro,
                            loss_fn=lambda o, t: F.cross_entropy(o.float().flatten(0, 1), t.flatten(0, 1)))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=args.warmup_steps),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.total_steps - args.warmup_steps,
                                                   eta_min=args.lr * 0.1),
    ], milestones=[args.warmup_steps])

    ds = TokenData(args.data_path, args.seq_len)
    sampler = DistributedSampler(ds, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=local_batch, sampler=sampler, num_workers=4, pin_memory=True,
                        drop_last=True)

    state = CkptState(model, opt, sched)
    last_ckpt = os.path.join(args.save_path, "last")
    if os.path.exists(os.path.join(last_ckpt, ".metadata")):
        dcp.load({"state": state}, checkpoint_id=last_ckpt)
    if rank == 0:
        print(f"dp={dp} local_batch={local_batch} microbatches={n_micro} start_step={state.step}", flush=True)

    epoch = state.step // len(loader)
    sampler.set_epoch(epoch)
    it = iter(loader)
    t0 = time.time()
    while state.step < args.total_steps:
        try:
            x, y = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(loader)
            x, y = next(it)
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
        state.step += 1

        if state.step % 10 == 0:
            loss = torch.stack(losses).mean().detach() if last else torch.tensor(-1.0, device=device)
            dist.all_reduce(loss, op=dist.ReduceOp.MAX, group=mesh["pp"].get_group())
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
            if rank == 0:
                sec = (time.time() - t0) / 10
                print(f"step {state.step} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{args.global_batch_size * args.seq_len / sec / 1e3:.1f}k tok/s", flush=True)
            t0 = time.time()

        if state.step % args.checkpoint_interval == 0:
            dcp.save({"state": state}, checkpoint_id=last_ckpt)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
