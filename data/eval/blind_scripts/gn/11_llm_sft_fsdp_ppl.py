"""Continued pre-training of a 1B decoder on a domain corpus with FSDP.

Validation perplexity every --eval-interval steps; the best consolidated
checkpoint is written to --save-dir/best, and training stops when the
perplexity has not improved for --patience evaluations.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        11_llm_sft_fsdp_ppl.py --model TinyLlama/TinyLlama_v1.1 --data /shared/corpus_tokenized
"""
import argparse
import contextlib
import functools
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
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


class TokenBlocks(Dataset):
    """Fixed-length blocks from a flat uint16 token file (memory-mapped)."""

    def __init__(self, path, block_size, max_blocks=None):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block_size
        self.n = (len(self.tokens) - 1) // block_size
        if max_blocks is not None:
            self.n = min(self.n, max_blocks)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        chunk = torch.from_numpy(self.tokens[i * self.block: (i + 1) * self.block + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="TinyLlama/TinyLlama_v1.1")
    ap.add_argument("--data", required=True, help="dir with train.bin / val.bin")
    ap.add_argument("--save-dir", default="/shared/ckpt/tinyllama_domain")
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--eval-interval", type=int, default=250)
    ap.add_argument("--val-blocks", type=int, default=2048)
    ap.add_argument("--patience", type=int, default=6)
    return ap.parse_args()


@torch.no_grad()
def val_perplexity(model, loader, device):
    model.eval()
    nll = torch.zeros(2, device=device, dtype=torch.float64)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1),
                                                 reduction="sum")
        nll[0] += loss.double()
        nll[1] += y.numel()
    dist.all_reduce(nll)
    model.train()
    return math.exp((nll[0] / nll[1]).item())


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = TokenBlocks(os.path.join(args.data, "train.bin"), args.block_size)
    val_ds = TokenBlocks(os.path.join(args.data, "val.bin"), args.block_size, max_blocks=args.val_blocks)
    # same number of val blocks on every rank: FSDP forwards are collectives
    val_ds.n = (val_ds.n // world) * world
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, num_workers=2,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.micro_batch, sampler=DistributedSampler(val_ds, shuffle=False),
                        num_workers=2, pin_memory=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                           transformer_layer_cls={LlamaDecoderLayer}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        device_id=torch.cuda.current_device(),
        limit_all_gathers=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.max_steps)

    best_dir = os.path.join(args.save_dir, "best")
    if rank == 0:
        os.makedirs(best_dir, exist_ok=True)
        print(f"world {world}, tokens/step {args.micro_batch * args.grad_accum * world * args.block_size}")

    best_ppl, bad_evals, step, micro, epoch = float("inf"), 0, 0, 0, 0
    finished = False
    t0 = time.time()
    while not finished:
        train_sampler.set_epoch(epoch)
        for x, y in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            micro += 1
            sync_now = micro % args.grad_accum == 0
            ctx = model.no_sync() if not sync_now else contextlib.nullcontext()
            with ctx:
                out = model(input_ids=x, labels=y)
                (out.loss / args.grad_accum).backward()
            if not sync_now:
                continue
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"step {step} loss {out.loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / step:.2f}s/step", flush=True)

            if step % args.eval_interval == 0:
                ppl = val_perplexity(model, val_dl, device)
                if rank == 0:
                    print(f"[eval] step {step} val ppl {ppl:.3f} (best {best_ppl:.3f})", flush=True)
                if ppl < best_ppl:
                    best_ppl, bad_evals = ppl, 0
                    if rank == 0:
                        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                            state = model.state_dict()
                        torch.save(state, os.path.join(best_dir, "model.pt"))
                        with open(os.path.join(best_dir, "meta.txt"), "w") as f:
                            f.write(f"step={step}\nval_ppl={ppl:.4f}\n")
                    dist.barrier()
                else:
                    bad_evals += 1
                if bad_evals >= args.patience or step >= args.max_steps:
                    finished = True
                    break
            elif step >= args.max_steps:
                finished = True
                break
        epoch += 1

    if rank == 0:
        print(f"done at step {step}; best val ppl {best_ppl:.3f} saved in {best_dir}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
