"""Continued pretraining of Llama-3-8B on the code + internal-docs mixture (DeepSpeed ZeRO-2).

Launch from the login node of the GPU cluster (4 nodes x 8 H100, hostfile lists
`gpu-node-[01-04] slots=8`):

    deepspeed --hostfile ./hostfile --num_nodes 4 --num_gpus 8 --master_port 29600 \
        cpt_llama_ds.py --data /shared/tokens/code_docs_mix_v3 \
        --save-dir /shared/ckpt/llama3-8b-codedocs --max-steps 12000

The data dir holds `train_*.bin` (uint32 token ids, documents packed with EOS) and `val.bin`.
Metrics go to MLflow (tracking URI from ~/.mlflow env on the login node is exported by
the launcher via .deepspeed_env).
"""
import argparse
import glob
import math
import os
import time

import deepspeed
import mlflow
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import AutoModelForCausalLM

SEQ_LEN = 4096

# 2M tokens per optimizer step (512 sequences x 4096)
DS_CONFIG = {
    "train_batch_size": 512,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 16,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False},
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
}


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Meta-Llama-3-8B")
    p.add_argument("--data", required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--max-steps", type=int, default=12000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--save-every", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-batches", type=int, default=50)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


class TokenBins(Dataset):
    def __init__(self, files, seq_len):
        self.maps = [np.memmap(f, dtype=np.uint32, mode="r") for f in files]
        self.counts = [(len(m) - 1) // seq_len for m in self.maps]
        self.cum = np.cumsum([0] + self.counts)
        self.seq_len = seq_len

    def __len__(self):
        return int(self.cum[-1])

    def __getitem__(self, idx):
        f = int(np.searchsorted(self.cum, idx, side="right") - 1)
        off = (idx - self.cum[f]) * self.seq_len
        x = torch.from_numpy(self.maps[f][off : off + self.seq_len + 1].astype(np.int64))
        return x[:-1], x[1:]


def cosine_with_warmup(step, warmup, total, min_ratio):
    if step < warmup:
        return (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * prog))


@torch.no_grad()
def run_eval(engine, loader, n_batches):
    engine.eval()
    tot = torch.zeros(2, device=engine.device)
    for i, (x, y) in enumerate(loader):
        if i >= n_batches:
            break
        logits = engine(input_ids=x.to(engine.device)).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.to(engine.device).flatten(),
                                                 reduction="sum")
        tot[0] += loss
        tot[1] += y.numel()
    dist.all_reduce(tot)
    engine.train()
    return (tot[0] / tot[1]).item()


def main():
    args = get_args()
    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    def make_sched(opt):
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: cosine_with_warmup(s, args.warmup, args.max_steps, args.min_lr_ratio))

    engine, _, _, sched = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=DS_CONFIG, lr_scheduler=make_sched)

    train_ds = TokenBins(sorted(glob.glob(os.path.join(args.data, "train_*.bin"))), SEQ_LEN)
    val_ds = TokenBins([os.path.join(args.data, "val.bin")], SEQ_LEN)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=1234, drop_last=True)
    loader = DataLoader(train_ds, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=4, sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=2, drop_last=True)

    start_step = 0
    _, client = engine.load_checkpoint(args.save_dir)
    if client is not None:
        start_step = client["step"]

    if rank == 0:
        mlflow.set_experiment("llama3-cpt")
        mlflow.start_run(run_name=os.path.basename(args.save_dir.rstrip("/")))
        mlflow.log_params({"world_size": world, **{k: v for k, v in DS_CONFIG.items() if not isinstance(v, dict)}})

    step = start_step
    accum = engine.gradient_accumulation_steps()
    micro_per_epoch = len(loader)
    epoch = step * accum // micro_per_epoch
    skip = step * accum % micro_per_epoch
    engine.train()
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue
            logits = engine(input_ids=x.to(engine.device)).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.to(engine.device).flatten())
            engine.backward(loss)
            engine.step()
            if (i + 1) % accum != 0:
                continue
            step += 1
            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tok_s = 10 * DS_CONFIG["train_batch_size"] * SEQ_LEN / (time.time() - t0)
                    mlflow.log_metrics({"train_loss": l.item(), "lr": sched.get_last_lr()[0],
                                        "tokens_per_sec": tok_s}, step=step)
                t0 = time.time()
            if step % args.eval_every == 0:
                vl = run_eval(engine, val_loader, args.eval_batches)
                if rank == 0:
                    mlflow.log_metrics({"val_loss": vl, "val_ppl": math.exp(vl)}, step=step)
            if step % args.save_every == 0:
                engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"step": step})
            if step >= args.max_steps:
                break
        skip = 0
        epoch += 1

    engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"step": step})
    if rank == 0:
        mlflow.end_run()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
