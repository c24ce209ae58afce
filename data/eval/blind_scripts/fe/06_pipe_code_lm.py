#!/usr/bin/env python
"""Code LM continued pre-training, DeepSpeed pipeline engine, fp16.

    deepspeed --num_gpus 8 06_pipe_code_lm.py --deepspeed_config configs/code_pp2_fp16.json \
        --stages 2 --train /data/stack_py/train.npy --valid /data/stack_py/valid.npy \
        --save /shared/exp/code_lm_pp2
"""
import argparse
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import RepeatingLoader
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--valid", required=True)
    parser.add_argument("--save", required=True)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--d", type=int, default=2560)
    parser.add_argument("--n-layer", type=int, default=32)
    parser.add_argument("--n-head", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--valid-every", type=int, default=500)
    parser.add_argument("--valid-batches", type=int, default=10)
    parser.add_argument("--ckpt-every", type=int, default=1000)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class NpyWindows(Dataset):
    def __init__(self, path, ctx):
        self.arr = np.load(path, mmap_mode="r")
        self.ctx = ctx

    def __len__(self):
        return (self.arr.shape[0] - 1) // self.ctx

    def __getitem__(self, i):
        w = torch.from_numpy(np.asarray(self.arr[i * self.ctx:(i + 1) * self.ctx + 1], dtype=np.int64))
        return w[:-1].contiguous(), w[1:].contiguous()


class TokEmbed(nn.Module):
    def __init__(self, vocab, d, ctx):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)

    def forward(self, ids):
        return self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))


class GPTLayer(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_head, batch_first=True, bias=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x):
        T = x.size(1)
        mask = torch.full((T, T), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.ln_f = nn.LayerNorm(d)
        self.proj = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.proj(self.ln_f(x))


def causal_lm_loss(logits, target):
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def main():
    args = get_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    torch.manual_seed(7)

    specs = [LayerSpec(TokEmbed, args.vocab, args.d, args.ctx)]
    specs += [LayerSpec(GPTLayer, args.d, args.n_head) for _ in range(args.n_layer)]
    specs += [LayerSpec(Head, args.d, args.vocab)]
    net = PipelineModule(layers=specs, num_stages=args.stages, loss_fn=causal_lm_loss,
                         partition_method="parameters", activation_checkpoint_interval=2,
                         checkpointable_layers=["GPTLayer"])

    topo = net.topology()
    dp_size = topo.get_dim("data")
    dp_rank = net.mpu().get_data_parallel_rank()

    train_ds = NpyWindows(args.train, args.ctx)
    valid_ds = NpyWindows(args.valid, args.ctx)

    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    mbs = engine.train_micro_batch_size_per_gpu()

    sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=7)
    train_loader = DataLoader(train_ds, batch_size=mbs, sampler=sampler, num_workers=4,
                              pin_memory=True, drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=mbs,
                              sampler=DistributedSampler(valid_ds, num_replicas=dp_size, rank=dp_rank,
                                                         shuffle=False),
                              num_workers=2, drop_last=True)
    valid_iter = RepeatingLoader(valid_loader)

    if os.path.isfile(os.path.join(args.save, "latest")):
        engine.load_checkpoint(args.save)

    batches_per_epoch = len(train_loader) // engine.gradient_accumulation_steps()
    epoch = engine.global_steps // batches_per_epoch
    sampler.set_epoch(epoch)
    train_iter = iter(train_loader)
    is_logger = dist.get_rank() == 0

    while engine.global_steps < args.steps:
        if engine.global_steps > 0 and engine.global_steps % batches_per_epoch == 0:
            epoch += 1
            sampler.set_epoch(epoch)
            train_iter = iter(train_loader)
        loss = engine.train_batch(data_iter=train_iter)
        step = engine.global_steps

        if is_logger and step % 20 == 0:
            print(f"[{step}/{args.steps}] epoch {epoch} loss {loss.item():.4f} "
                  f"lr {engine.get_lr()[0]:.3e} loss_scale {engine.optimizer.cur_scale if hasattr(engine.optimizer, 'cur_scale') else 'n/a'}",
                  flush=True)

        if step % args.valid_every == 0:
            vloss = 0.0
            for _ in range(args.valid_batches):
                vloss += engine.eval_batch(valid_iter).item()
            vloss /= args.valid_batches
            if is_logger:
                print(f"[{step}] valid loss {vloss:.4f} ppl {math.exp(vloss):.2f}", flush=True)

        if step % args.ckpt_every == 0:
            engine.save_checkpoint(args.save, tag=f"global_step{step}")

    engine.save_checkpoint(args.save, tag=f"global_step{engine.global_steps}")

    # plain state dict for the conversion / eval harness
    export_dir = os.path.join(args.save, "export")
    os.makedirs(export_dir, exist_ok=True)
    torch.save({"args": vars(args), "module": engine.module.state_dict()},
               os.path.join(export_dir, "pytorch_model.pt"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
