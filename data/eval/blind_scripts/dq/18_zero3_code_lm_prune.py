#!/usr/bin/env python
# Code-completion model for the IDE plugin (runs locally on laptops):
# distill StarCoderBase-3B into tiny_starcoder (164M) and prune the student's MLP
# to 2:4-friendly 50% unstructured sparsity along the way.
#
# ZeRO-3 shards the student across ranks, so weights are gathered (read-only)
# when masks are recomputed. Masks are buffers: every rank holds the full mask
# and computes the same one from the same gathered weights.
#
#   deepspeed --num_gpus 4 18_zero3_code_lm_prune.py --config cfg/code_kd.yaml
import argparse
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from datasets import load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, AutoTokenizer


class SparseLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.data.clone())
        self.bias = nn.Parameter(linear.bias.data.clone()) if linear.bias is not None else None
        self.register_buffer("mask", torch.ones_like(linear.weight, dtype=torch.bool))

    def forward(self, x):
        return F.linear(x, self.weight * self.mask, self.bias)


def sparsify_mlp(model):
    wrapped = []
    for block in model.transformer.h:
        block.mlp.c_fc = SparseLinear(block.mlp.c_fc)
        block.mlp.c_proj = SparseLinear(block.mlp.c_proj)
        wrapped += [block.mlp.c_fc, block.mlp.c_proj]
    return wrapped


@torch.no_grad()
def refresh_masks(layers, sparsity):
    kept, total = 0, 0
    for layer in layers:
        with deepspeed.zero.GatheredParameters([layer.weight], modifier_rank=None):
            w = layer.weight.detach().float().abs()
            k = int(sparsity * w.numel())
            if k > 0:
                thresh = w.flatten().kthvalue(k).values
                layer.mask.copy_(w > thresh)
        kept += int(layer.mask.sum())
        total += layer.mask.numel()
    return 1.0 - kept / max(total, 1)


def cubic(step, start, end, final):
    if step < start:
        return 0.0
    t = min(1.0, (step - start) / max(1, end - start))
    return final * (1.0 - (1.0 - t) ** 3)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--local_rank", type=int, default=-1)
    a = ap.parse_args()
    with open(a.config) as f:
        cfg = yaml.safe_load(f)
    cfg.setdefault("data", "/data/code_kd/tokenized_2048")
    cfg.setdefault("teacher", "bigcode/starcoderbase-3b")
    cfg.setdefault("student", "bigcode/tiny_starcoder_py")
    cfg.setdefault("micro_batch", 8)
    cfg.setdefault("accum", 4)
    cfg.setdefault("lr", 3e-4)
    cfg.setdefault("steps", 30000)
    cfg.setdefault("temperature", 2.0)
    cfg.setdefault("alpha", 0.5)
    cfg.setdefault("sparsity", 0.5)
    cfg.setdefault("prune_start", 2000)
    cfg.setdefault("prune_end", 20000)
    cfg.setdefault("prune_every", 500)
    cfg.setdefault("out", "ckpt/tiny_starcoder_kd_sparse")
    return cfg


def main():
    cfg = load_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ds_config = {
        "train_micro_batch_size_per_gpu": cfg["micro_batch"],
        "gradient_accumulation_steps": cfg["accum"],
        "train_batch_size": cfg["micro_batch"] * cfg["accum"] * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": 5e7,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": cfg["lr"], "weight_decay": 0.1,
                                                   "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": cfg["steps"], "warmup_num_steps": 1000}},
        "wall_clock_breakdown": False,
    }

    tok = AutoTokenizer.from_pretrained(cfg["student"])
    tok.pad_token = tok.eos_token
    data = load_from_disk(cfg["data"])
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=3)
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    loader = DataLoader(data, batch_size=cfg["micro_batch"], sampler=sampler, collate_fn=collator,
                        num_workers=4, drop_last=True)

    teacher = AutoModelForCausalLM.from_pretrained(cfg["teacher"], torch_dtype=torch.bfloat16)
    teacher = teacher.to(device).eval().requires_grad_(False)

    student = AutoModelForCausalLM.from_pretrained(cfg["student"])
    sparse_layers = sparsify_mlp(student)
    engine, _, _, _ = deepspeed.initialize(model=student, model_parameters=student.parameters(),
                                           config=ds_config)

    step, epoch, t0 = 0, 0, time.time()
    done = False
    while not done:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.no_grad():
                t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            out = engine(**batch)
            valid = (batch["labels"][:, 1:] != -100).float()
            T = cfg["temperature"]
            kl = F.kl_div(F.log_softmax(out.logits[:, :-1].float() / T, -1),
                          F.log_softmax(t_logits[:, :-1].float() / T, -1),
                          reduction="none", log_target=True).sum(-1)
            kd = (kl * valid).sum() / valid.sum().clamp_min(1) * T * T
            loss = cfg["alpha"] * kd + (1 - cfg["alpha"]) * out.loss
            engine.backward(loss)
            engine.step()

            if engine.global_steps != step:
                step = engine.global_steps
                if step >= cfg["prune_start"] and step % cfg["prune_every"] == 0:
                    actual = refresh_masks(sparse_layers,
                                           cubic(step, cfg["prune_start"], cfg["prune_end"], cfg["sparsity"]))
                    if rank == 0:
                        print(f"step {step}: MLP sparsity now {actual:.3f}", flush=True)
                if step % 100 == 0:
                    rep = torch.stack([out.loss.detach().float(), kd.detach().float()])
                    dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"step {step} ce {rep[0].item():.3f} (ppl {math.exp(rep[0].item()):.1f}) "
                              f"kd {rep[1].item():.3f} {time.time() - t0:.0f}s", flush=True)
                if step % 5000 == 0:
                    # every rank takes part: each writes its own ZeRO shard
                    engine.save_checkpoint(cfg["out"], tag=f"step{step}")
                if step >= cfg["steps"]:
                    done = True
                    break
        epoch += 1

    engine.save_checkpoint(cfg["out"], tag="final")
    engine.save_16bit_model(os.path.join(cfg["out"], "final_fp16"))
    if rank == 0:
        tok.save_pretrained(os.path.join(cfg["out"], "final_fp16"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
