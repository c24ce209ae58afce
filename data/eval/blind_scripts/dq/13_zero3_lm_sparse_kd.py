"""
On-device assistant LM: distill Llama-2-7B (frozen, bf16) into a 1.1B student
while pruning the student's MLP projections to 50% unstructured sparsity.

The student's MLP Linear layers are replaced with MaskedLinear (weight * mask,
mask is a non-trainable buffer). Masks are recomputed from weight magnitudes
every --mask-every steps following a cubic sparsity ramp.

Launch:
    deepspeed --num_gpus 8 13_zero3_lm_sparse_kd.py --data /data/assistant_sft_tok \
        --teacher meta-llama/Llama-2-7b-hf --student TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T
"""
import argparse
import math
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, default_data_collator


class MaskedLinear(nn.Linear):
    def __init__(self, in_features, out_features, bias=False):
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("mask", torch.ones(out_features, in_features), persistent=True)

    def forward(self, x):
        return F.linear(x, self.weight * self.mask.to(self.weight.dtype), self.bias)


def swap_mlp_linears(model):
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            old = getattr(layer.mlp, name)
            new = MaskedLinear(old.in_features, old.out_features, bias=old.bias is not None)
            new.weight.data.copy_(old.weight.data)
            setattr(layer.mlp, name, new)
    return model


def target_sparsity(step, start, end, final):
    if step <= start:
        return 0.0
    if step >= end:
        return final
    return final * (1 - (1 - (step - start) / (end - start)) ** 3)


@torch.no_grad()
def recompute_masks(model, sparsity):
    for module in model.modules():
        if isinstance(module, MaskedLinear):
            w = module.weight.float().abs()
            k = int(sparsity * w.numel())
            if k < 1:
                continue
            thresh = torch.kthvalue(w.flatten(), k).values
            module.mask.copy_((w > thresh).to(module.mask.dtype))


def token_kd_loss(s_logits, t_logits, labels, T):
    mask = (labels != -100).float()
    s = F.log_softmax(s_logits.float() / T, dim=-1)
    t = F.softmax(t_logits.float() / T, dim=-1)
    kl = (t * (torch.log(t.clamp_min(1e-9)) - s)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp_min(1.0) * T * T


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--micro-bs", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-steps", type=int, default=20000)
    parser.add_argument("--T", type=float, default=1.0)
    parser.add_argument("--kd-weight", type=float, default=0.8)
    parser.add_argument("--final-sparsity", type=float, default=0.5)
    parser.add_argument("--prune-start", type=int, default=1000)
    parser.add_argument("--prune-end", type=int, default=12000)
    parser.add_argument("--mask-every", type=int, default=200)
    parser.add_argument("--save-dir", default="ckpt/tinyllama_sparse_kd")
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device("cuda", local_rank)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": 500, "total_num_steps": args.max_steps}},
        "steps_per_print": 100,
    }

    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, torch_dtype=torch.bfloat16)
    teacher.to(device).eval()
    teacher.requires_grad_(False)

    student = AutoModelForCausalLM.from_pretrained(args.student, torch_dtype=torch.float32)
    student = swap_mlp_linears(student)
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    engine, _, _, _ = deepspeed.initialize(model=student, model_parameters=student.parameters(),
                                           config=ds_config)

    train = load_from_disk(args.data)["train"].with_format("torch")
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=11)
    loader = DataLoader(train, batch_size=args.micro_bs, sampler=sampler,
                        collate_fn=default_data_collator, num_workers=4, pin_memory=True, drop_last=True)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)

    step, epoch = 0, 0
    micro = 0
    engine.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            input_ids = batch["input_ids"].to(device)
            attn = batch["attention_mask"].to(device)
            labels = batch["labels"].to(device)

            with torch.no_grad():
                t_logits = teacher(input_ids=input_ids, attention_mask=attn).logits
            out = engine(input_ids=input_ids, attention_mask=attn, labels=labels)
            kd = token_kd_loss(out.logits[:, :-1], t_logits[:, :-1], labels[:, 1:], args.T)
            loss = args.kd_weight * kd + (1 - args.kd_weight) * out.loss
            engine.backward(loss)
            engine.step()
            micro += 1

            if micro % args.grad_accum == 0:
                step += 1
                if step >= args.prune_start and step % args.mask_every == 0:
                    sp = target_sparsity(step, args.prune_start, args.prune_end, args.final_sparsity)
                    recompute_masks(engine.module, sp)
                    if rank == 0:
                        print(f"step {step}: masks updated, target sparsity {sp:.3f}", flush=True)
                if step % 50 == 0:
                    stats = torch.stack([loss.detach().float(), kd.detach().float(), out.loss.detach().float()])
                    dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"step {step} loss {stats[0].item():.4f} kd {stats[1].item():.4f} "
                              f"ppl {math.exp(min(stats[2].item(), 20)):.2f}", flush=True)
                if step % 2000 == 0:
                    engine.save_checkpoint(args.save_dir, tag=f"step{step}")
                if step >= args.max_steps:
                    break
        epoch += 1

    engine.save_checkpoint(args.save_dir, tag="final")
    engine.save_16bit_model(os.path.join(args.save_dir, "final_hf"), "pytorch_model.bin")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
