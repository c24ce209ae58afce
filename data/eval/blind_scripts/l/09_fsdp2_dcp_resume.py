"""
1B Llama-architecture pretraining with FSDP2 + torch.distributed.checkpoint (resumable).

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=${MASTER_ADDR}:29400 --rdzv_id=llama1b --max_restarts=3 \
        09_fsdp2_dcp_resume.py --train_bin /shared/tok/train.bin --val_bin /shared/tok/val.bin \
        --ckpt_dir /shared/ckpt/llama1b
"""
import argparse
import itertools
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM


class Windows(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = i * self.seq_len
        x = torch.from_numpy(self.data[s : s + self.seq_len + 1].astype(np.int64))
        return x[:-1], x[1:]


class AppState(Stateful):
    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optim,
                       model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def lr_schedule(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = min(1.0, (step - a.warmup) / max(1, a.max_steps - a.warmup))
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def save(ckpt_dir, step, epoch, app, rank):
    path = os.path.join(ckpt_dir, f"step_{step:07d}")
    dcp.save({"app": app}, checkpoint_id=path)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(ckpt_dir, "latest.json.tmp"), "w") as f:
            json.dump({"path": path, "step": step, "epoch": epoch}, f)
        os.replace(os.path.join(ckpt_dir, "latest.json.tmp"), os.path.join(ckpt_dir, "latest.json"))
    dist.barrier()


@torch.no_grad()
def evaluate(model, loader, max_batches, device):
    model.eval()
    tot = torch.zeros(2, device=device)
    for x, y in itertools.islice(loader, max_batches):
        x, y = x.to(device), y.to(device)
        logits = model(input_ids=x).logits
        tot[0] += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        tot[1] += y.numel()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_bin", required=True)
    ap.add_argument("--val_bin", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--seq_len", type=int, default=4096)
    ap.add_argument("--bsz", type=int, default=4)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--max_steps", type=int, default=50000)
    ap.add_argument("--ckpt_every", type=int, default=500)
    ap.add_argument("--eval_every", type=int, default=1000)
    a = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    os.makedirs(a.ckpt_dir, exist_ok=True)

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                      max_position_embeddings=a.seq_len, rope_theta=10000.0,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optim = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    app = AppState(model, optim)

    step, epoch = 0, 0
    latest = os.path.join(a.ckpt_dir, "latest.json")
    if os.path.exists(latest):
        with open(latest) as f:
            meta = json.load(f)
        dcp.load({"app": app}, checkpoint_id=meta["path"])
        step, epoch = meta["step"], meta["epoch"]
        if rank == 0:
            print(f"resumed from {meta['path']} (step {step})", flush=True)

    train_ds, val_ds = Windows(a.train_bin, a.seq_len), Windows(a.val_bin, a.seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=17, drop_last=True)
    loader = DataLoader(train_ds, batch_size=a.bsz, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=a.bsz,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            num_workers=2, drop_last=True)
    steps_per_epoch = len(loader)
    skip = step - epoch * steps_per_epoch

    model.train()
    t0 = time.time()
    while step < a.max_steps:
        sampler.set_epoch(epoch)
        it = iter(loader)
        if skip > 0:
            it = itertools.islice(it, skip, None)
            skip = 0
        for x, y in it:
            for g in optim.param_groups:
                g["lr"] = lr_schedule(step, a)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                gn = gn.full_tensor()
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} gnorm {gn.item():.2f} "
                          f"{(time.time() - t0) / 10:.2f}s/it", flush=True)
                t0 = time.time()
            if step % a.eval_every == 0:
                vl = evaluate(model, val_loader, 50, device)
                if rank == 0:
                    print(f"step {step} val_loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
            if step % a.ckpt_every == 0:
                save(a.ckpt_dir, step, epoch, app, rank)
            if step >= a.max_steps:
                break
        else:
            epoch += 1

    if step % a.ckpt_every != 0:
        save(a.ckpt_dir, step, epoch, app, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
