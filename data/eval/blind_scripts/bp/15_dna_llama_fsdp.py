"""1.3B-parameter Llama-architecture DNA language model (BPE over nucleotides) with FSDP.

Pre-tokenised training data: flat uint16 token files (data/*.bin), windows of --ctx tokens
drawn at random offsets; OpenGenome-style mixture of prokaryotic and phage genomes.

    torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 \
        15_dna_llama_fsdp.py --data /mnt/shared/opengenome_tok --out /mnt/shared/ckpt/dnallama_1b
"""
import argparse
import functools
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab_size", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--micro_bs", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min_lr", type=float, default=3e-5)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--save_every", type=int, default=2500)
    ap.add_argument("--val_every", type=int, default=500)
    return ap.parse_args()


class RandomWindows(Dataset):
    """Each rank/worker draws its own random windows; length is nominal (steps drive training)."""

    def __init__(self, files, ctx, n_samples, seed):
        self.arrs = [np.memmap(f, dtype=np.uint16, mode="r") for f in files]
        sizes = np.array([len(a) for a in self.arrs], dtype=np.float64)
        self.p = sizes / sizes.sum()
        self.ctx, self.n, self.seed = ctx, n_samples, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng((self.seed, i))
        a = self.arrs[rng.choice(len(self.arrs), p=self.p)]
        off = rng.integers(0, len(a) - self.ctx - 1)
        return torch.from_numpy(a[off:off + self.ctx + 1].astype(np.int64))


def cosine(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / (a.steps - a.warmup))
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * t))


@torch.no_grad()
def validate(model, loader, device, n=20):
    model.eval()
    acc = torch.zeros(2, device=device)
    for k, x in enumerate(loader):
        if k == n:
            break
        x = x.to(device)
        out = model(input_ids=x[:, :-1], labels=x[:, :-1])
        acc += torch.stack([out.loss.float(), torch.ones((), device=device)])
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    files = sorted(glob.glob(os.path.join(args.data, "train_*.bin")))
    val_files = sorted(glob.glob(os.path.join(args.data, "val_*.bin")))
    train_ds = RandomWindows(files, args.ctx, n_samples=args.steps * args.micro_bs, seed=1000 + rank)
    val_ds = RandomWindows(val_files, args.ctx, n_samples=10000, seed=7 + rank)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, shuffle=False, num_workers=4, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.micro_bs, num_workers=2)

    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=2048, intermediate_size=5504,
                      num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                      max_position_embeddings=args.ctx, rope_theta=50000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=policy, mixed_precision=mp, device_id=local_rank,
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD, use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world {world}, {sum(p.numel() for p in model.parameters()) * world / 1e9:.2f}B params (approx)",
              flush=True)

    step, t0 = 0, time.time()
    for x in loader:
        x = x.to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = cosine(step, args)
        out = model(input_ids=x[:, :-1], labels=x[:, :-1])
        out.loss.backward()
        gnorm = model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 20 == 0 and rank == 0:
            tps = 20 * args.micro_bs * args.ctx * world / (time.time() - t0)
            print(f"step {step} loss {out.loss.item():.4f} gnorm {gnorm.item():.2f} {tps / 1e3:.0f}k tok/s",
                  flush=True)
            t0 = time.time()
        if step % args.val_every == 0:
            vl = validate(model, val_loader, device)
            if rank == 0:
                print(f"step {step} val loss {vl:.4f} ppl {math.exp(vl):.3f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            if rank == 0:
                save_cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, save_cfg):
                    state = model.state_dict()
                torch.save({"model": state, "step": step, "config": cfg.to_dict()},
                           os.path.join(args.out, f"step_{step:06d}.pt"))
                print(f"saved checkpoint at step {step}", flush=True)
            dist.barrier()
        if step >= args.steps:
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
