#!/usr/bin/env python
"""Chat SFT on a 13B decoder with DeepSpeed pipeline parallelism (PP=4, ZeRO-1, bf16).

Reports loss and next-token accuracy on the held-out conversations.

    deepspeed --num_gpus 8 11_pipe_chat_sft_eval.py --cfg configs/sft_13b.yaml
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
import deepspeed
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

IGNORE = -100


class TokenAccuracyLoss:
    """Loss for the last pipeline stage that also counts correct next-token predictions."""

    def __init__(self):
        self.correct = None
        self.total = None

    def reset(self):
        self.correct = None
        self.total = None

    def __call__(self, logits, labels):
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=IGNORE)
        with torch.no_grad():
            mask = labels != IGNORE
            hit = (logits.argmax(-1) == labels) & mask
            c, t = hit.sum().float(), mask.sum().float()
            self.correct = c if self.correct is None else self.correct + c
            self.total = t if self.total is None else self.total + t
        return loss


class JsonlChat(Dataset):
    def __init__(self, path, seq_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.seq_len = seq_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = self.rows[i]["input_ids"][: self.seq_len + 1]
        lab = self.rows[i]["labels"][: self.seq_len + 1]
        pad = self.seq_len + 1 - len(ids)
        ids = torch.tensor(ids + [0] * pad)
        lab = torch.tensor(lab + [IGNORE] * pad)
        return ids[:-1], lab[1:]


class Embed(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.weight = nn.Embedding(vocab, d)

    def forward(self, ids):
        return self.weight(ids)


class Decoder(nn.Module):
    def __init__(self, d, n_heads, ffn):
        super().__init__()
        self.n_heads = n_heads
        self.norm_a = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.norm_f = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm_a(x)).view(B, T, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        g, u = self.up(self.norm_f(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class Output(nn.Module):
    def __init__(self, d, vocab):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.proj(self.norm(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--local_rank", type=int, default=-1)
    cli = ap.parse_args()
    with open(cli.cfg) as f:
        cfg = yaml.safe_load(f)
    m, t = cfg["model"], cfg["train"]

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl")
    torch.manual_seed(t.get("seed", 1))

    metric = TokenAccuracyLoss()
    layers = [LayerSpec(Embed, m["vocab"], m["d_model"])]
    layers += [LayerSpec(Decoder, m["d_model"], m["n_heads"], m["ffn"]) for _ in range(m["n_layers"])]
    layers += [LayerSpec(Output, m["d_model"], m["vocab"])]
    net = PipelineModule(layers=layers, num_stages=t["pp"], loss_fn=metric,
                         partition_method="type:Decoder", activation_checkpoint_interval=1,
                         checkpointable_layers=["Decoder"])
    grid = net.mpu()
    dp_rank, dp_size = grid.get_data_parallel_rank(), grid.get_data_parallel_world_size()

    ds_config = {
        "train_micro_batch_size_per_gpu": t["micro_batch"],
        "gradient_accumulation_steps": t["grad_accum"],
        "train_batch_size": t["micro_batch"] * t["grad_accum"] * dp_size,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": t["lr"], "weight_decay": 0.0, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": t["steps"], "warmup_num_steps": t["warmup"],
                                 "cos_min_ratio": 0.1}},
        "steps_per_print": 100,
        "pipeline": {"activation_checkpoint_interval": 1},
    }
    engine, _, _, _ = deepspeed.initialize(model=net, config=ds_config,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad])
    if t.get("init_ckpt"):
        engine.load_checkpoint(t["init_ckpt"], load_module_only=True)

    train_ds = JsonlChat(t["train_file"], m["seq_len"])
    eval_ds = JsonlChat(t["eval_file"], m["seq_len"])
    tr_sampler = DistributedSampler(train_ds, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=t.get("seed", 1))
    ev_sampler = DistributedSampler(eval_ds, num_replicas=dp_size, rank=dp_rank, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=t["micro_batch"], sampler=tr_sampler, drop_last=True, num_workers=2)
    eval_loader = DataLoader(eval_ds, batch_size=t["micro_batch"], sampler=ev_sampler, drop_last=True, num_workers=2)

    def run_eval():
        metric.reset()
        it = iter(eval_loader)
        n = len(eval_loader) // engine.micro_batches
        losses = [engine.eval_batch(it).item() for _ in range(n)]
        acc = None
        if engine.is_last_stage():
            stats = torch.stack([metric.correct, metric.total])
            dist.all_reduce(stats)
            acc = (stats[0] / stats[1]).item()
        metric.reset()
        return sum(losses) / max(n, 1), acc

    per_epoch = len(train_loader) // t["grad_accum"]
    epoch, step = 0, engine.global_steps
    out_dir = t["output_dir"]
    while step < t["steps"]:
        tr_sampler.set_epoch(epoch)
        data = iter(train_loader)
        tic = time.time()
        for _ in range(per_epoch):
            loss = engine.train_batch(data_iter=data)
            metric.reset()
            step = engine.global_steps
            if dist.get_rank() == 0 and step % 10 == 0:
                print(f"ep {epoch} step {step} loss {loss.item():.4f} {time.time() - tic:.1f}s", flush=True)
                tic = time.time()
            if step % t["eval_every"] == 0:
                vloss, vacc = run_eval()
                if engine.is_last_stage() and dp_rank == 0:
                    print(f"step {step} eval loss {vloss:.4f} token acc {vacc:.4f}", flush=True)
            if step % t["save_every"] == 0:
                engine.save_checkpoint(out_dir, tag=f"step{step}", client_state={"epoch": epoch})
            if step >= t["steps"]:
                break
        epoch += 1

    engine.save_checkpoint(out_dir, tag="final", client_state={"epoch": epoch})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
