"""
Mistral-architecture 400M model pretrained from scratch on a tokenized multilingual mix.

Data: <data>/train/*.bin shards (uint32 ids, vocab 64k) + <data>/valid.bin.
Checkpoints and eval perplexity every --eval_interval steps.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node001:29500 \
        20_mistral_style_pretrain_eval.py --data /nfs/tok/multiling64k --out /nfs/ckpt/m400m
"""
import argparse
import glob
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import MistralConfig, MistralForCausalLM


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--micro_bs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--min_lr_ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--max_steps", type=int, default=60000)
    ap.add_argument("--eval_interval", type=int, default=1000)
    ap.add_argument("--eval_batches", type=int, default=40)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


class MixedShards:
    """Random windows from a list of shards, shard picked proportionally to its size."""

    def __init__(self, files, seq_len, seed):
        self.arrs = [np.memmap(f, dtype=np.uint32, mode="r") for f in files]
        sizes = np.array([len(x) for x in self.arrs], dtype=np.float64)
        self.p = sizes / sizes.sum()
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)

    def sample(self, bs):
        out = np.empty((bs, self.seq_len + 1), dtype=np.int64)
        for b in range(bs):
            arr = self.arrs[self.rng.choice(len(self.arrs), p=self.p)]
            s = self.rng.integers(0, len(arr) - self.seq_len - 1)
            out[b] = arr[s:s + self.seq_len + 1]
        return torch.from_numpy(out)


def lr_lambda(step, a):
    if step < a.warmup:
        return (step + 1) / a.warmup
    prog = min(1.0, (step - a.warmup) / (a.max_steps - a.warmup))
    return a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))


@torch.no_grad()
def evaluate(model, valid, a, rank, world, device):
    """Deterministic held-out loss: rank r scores windows r, r+W, r+2W, ..."""
    model.eval()
    n_windows = (len(valid) - 1) // a.seq_len
    mine = np.arange(rank, min(n_windows, a.eval_batches * a.micro_bs * world), world)
    nll = torch.zeros((), device=device, dtype=torch.float64)
    cnt = torch.zeros((), device=device, dtype=torch.float64)
    for j in range(0, len(mine), a.micro_bs):
        rows = [valid[i * a.seq_len:i * a.seq_len + a.seq_len + 1].astype(np.int64) for i in mine[j:j + a.micro_bs]]
        t = torch.from_numpy(np.stack(rows)).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=t[:, :-1]).logits
        nll += torch.nn.functional.cross_entropy(out.float().flatten(0, 1), t[:, 1:].flatten(),
                                                 reduction="sum").double()
        cnt += t[:, 1:].numel()
    dist.all_reduce(nll)
    dist.all_reduce(cnt)
    model.train()
    return (nll / cnt).item()


def main():
    a = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    is_master = rank == 0

    files = sorted(glob.glob(os.path.join(a.data, "train", "*.bin")))
    data = MixedShards(files, a.seq_len, seed=a.seed * 1000 + rank)
    valid = np.memmap(os.path.join(a.data, "valid.bin"), dtype=np.uint32, mode="r")

    cfg = MistralConfig(vocab_size=64000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=a.seq_len,
                        sliding_window=None, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(a.seed)
    model = MistralForCausalLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, a))

    step = 0
    last_ckpt = os.path.join(a.out, "last.pt")
    if os.path.exists(last_ckpt):
        ck = torch.load(last_ckpt, map_location=device)
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        step = ck["step"]
        data.rng = np.random.default_rng(a.seed * 1000 + rank + 1_000_003 * step)
        del ck
    if is_master:
        os.makedirs(a.out, exist_ok=True)
        n = sum(p.numel() for p in model.parameters())
        print(f"{n / 1e6:.0f}M params | {len(files)} shards | world {world} | "
              f"{a.micro_bs * a.accum * world * a.seq_len:,} tok/step", flush=True)

    best = float("inf")
    t0 = time.time()
    while step < a.max_steps:
        loss_acc = 0.0
        for m in range(a.accum):
            batch = data.sample(a.micro_bs).to(device, non_blocking=True)
            model.require_backward_grad_sync = m == a.accum - 1
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
            (loss / a.accum).backward()
            loss_acc += loss.item() / a.accum
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if is_master and step % 10 == 0:
            dt, t0 = time.time() - t0, time.time()
            tps = 10 * a.micro_bs * a.accum * world * a.seq_len / dt
            print(f"step {step} loss {loss_acc:.4f} gnorm {gnorm:.3f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{tps / 1e6:.2f}M tok/s", flush=True)

        if is_master and step % a.eval_interval == 0:
            val_loss = evaluate(model, valid, a, rank, world, device)
            print(f"step {step} val loss {val_loss:.4f} ppl {math.exp(val_loss):.2f}", flush=True)
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(),
                     "sched": sched.state_dict(), "step": step, "val_loss": val_loss}
            torch.save(state, last_ckpt + ".tmp")
            os.replace(last_ckpt + ".tmp", last_ckpt)
            if val_loss < best:
                best = val_loss
                model.module.save_pretrained(os.path.join(a.out, "best_hf"))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
